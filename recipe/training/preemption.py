"""Stop at a step boundary on SIGTERM or SIGUSR1/2 (a scheduler's warning), after a checkpoint.

A signal only sets a flag; at the end of each step the ranks agree (one all-reduce of the signal
number) so that they all checkpoint the same step and stop together, whichever of them the signal
reached first. SIGINT keeps Python's behaviour (stop at once): a person pressing Ctrl-C wants the
prompt back, a scheduler wants the work kept.

SIGUSR1 is what train.sbatch asks SLURM for; SIGUSR2 is what submitit asks for
(hydra/launcher=slurm, `signal_delay_s`). A submitit job process has submitit's own handlers
(SIGTERM ignored with a log line, SIGUSR2 to submitit's checkpoint-and-requeue); while the recipe
trains, its handlers take their place and give them back afterwards, so the recipe's checkpoint
at a step boundary is what happens.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(Exception):
    """The run stopped on a signal after writing a checkpoint of `step`."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.signum, self.step, self.checkpoint = int(signum), step, checkpoint
        self.requeue_outcome: str | None = None
        """What `trainer.requeue` did, when it was asked for."""
        super().__init__(signum, step, checkpoint)

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        where = f"wrote checkpoint {self.checkpoint}" if self.checkpoint else "wrote no checkpoint"
        requeue = f"; {self.requeue_outcome}" if self.requeue_outcome else ""
        return f"stopped by {name} after step {self.step}; {where}{requeue}"

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 143 for SIGTERM, 138 for SIGUSR1, 140 for SIGUSR2."""
        return 128 + self.signum


class StopRequests(contextlib.AbstractContextManager):
    """Catches the stop signals while training; `signum` is the first that arrived (0: none)."""

    def __init__(self):
        self.signum = 0
        self._previous: dict = {}

    def _catch(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._catch)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def requeue_slurm_job(environ=os.environ) -> str:
    """Ask SLURM to run this job again (it resumes with trainer.resume=auto); returns what
    happened, for the log."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return "trainer.requeue=true, but this is not a SLURM job (no SLURM_JOB_ID): not requeued"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"trainer.requeue=true, but scontrol is not on PATH: SLURM job {job} not requeued"
    done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode:
        return f"scontrol requeue {job} failed ({done.returncode}): {done.stderr.strip()}"
    return f"requeued SLURM job {job}"
