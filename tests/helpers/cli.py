"""Run `train.py` as a user would: a subprocess in a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.config import ROOT, TINY

RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


def run_train_cli(args, cwd, timeout=300, launcher=(), env_extra=None):
    """`python [LAUNCHER] train.py TINY ARGS` in a clean environment, as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *launcher, str(ROOT / "train.py"), *TINY, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_train_cli(args, run_dir, env_extra=None, **popen_kwargs) -> subprocess.Popen:
    """Start `python train.py TINY ARGS hydra.run.dir=RUN_DIR` in the background, in a clean
    environment and its own session (so a test can signal or kill the whole job)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    env.update(env_extra or {})
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *TINY, *args, f"hydra.run.dir={run_dir}"],
        env=env,
        text=True,
        start_new_session=True,
        **popen_kwargs,
    )


def wait_for_steps(job: subprocess.Popen, run_dir, steps: int, timeout: float = 300) -> None:
    """Wait until the job's metrics.jsonl has `steps` lines; fail with its output if it ends."""
    import time
    from pathlib import Path

    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        if job.poll() is not None:
            out, err = job.communicate()
            raise AssertionError(
                f"the job ended (exit {job.returncode}):\n{(out or '')[-2000:]}"
                f"{(err or '')[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"the job did not train {steps} steps in {timeout:.0f} s")
        time.sleep(0.1)


def signal_after_steps(job: subprocess.Popen, run_dir, steps: int, signum) -> str:
    """Send `signum` to a job started by start_train_cli once it logged `steps` steps; returns
    its stderr after it ended (the whole job is killed if it outlives two minutes)."""
    import signal

    try:
        wait_for_steps(job, run_dir, steps)
        job.send_signal(signum)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return stderr
