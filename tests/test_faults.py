"""Faults a user meets, reproduced: each must end promptly with a message that names the cause.

(A catalogue that grows with the reliability work: a stalled rank here; failed and FAILing sweeps
and single runs in tests/test_compare.py; killed ranks and bad configs in tests/test_launch.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import RANK_VARIABLES
from tests.helpers.config import ROOT, TINY

TIMEOUT_S = 10
# torch elastic gives the remaining (here: stopped) worker 30 s after SIGTERM before SIGKILL.
SHUTDOWN_MARGIN_S = 60


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = []
    for child in map(int, children.stdout.split()):
        found += [child, *_descendants(child)]
    return found


def _rank_processes(pid: int) -> list[int]:
    """The spawned rank processes of a self-launched job, in start (= local rank) order."""
    ranks = []
    for child in _descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(child)
    return sorted(ranks)


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").exists(), reason="finds rank processes through /proc")
def test_a_stalled_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    """SIGSTOP of rank 1 at cp=2 used to block rank 0 silently for more than 9 minutes: megatron's
    groups, which carry the CP exchanges and gradients, kept megatron's 30-minute timeout."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    job = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *TINY,
            "cp=2",
            "trainer.max_steps=500",
            f"trainer.collective_timeout_s={TIMEOUT_S}",
            f"hydra.run.dir={run_dir}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stalled = None
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert job.poll() is None, job.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the job never trained two steps"
            time.sleep(0.2)
        ranks = _rank_processes(job.pid)
        assert len(ranks) == 2, ranks
        stalled = ranks[1]
        os.kill(stalled, signal.SIGSTOP)
        stopped_at = time.monotonic()
        output, _ = job.communicate(timeout=TIMEOUT_S + SHUTDOWN_MARGIN_S + 60)
        took = time.monotonic() - stopped_at
    finally:
        if job.poll() is None:
            job.kill()
        if stalled is not None:
            try:
                os.kill(stalled, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert job.returncode == 1
    assert took < TIMEOUT_S + SHUTDOWN_MARGIN_S, f"took {took:.0f} s"
    assert f"rank 0 waited more than {TIMEOUT_S} s for the other ranks in" in output
    assert f"trainer.collective_timeout_s={TIMEOUT_S}" in output
