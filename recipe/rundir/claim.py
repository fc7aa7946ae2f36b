"""One job per run directory: a lock held for the job's life, and no overwriting of a finished run.

Two jobs in one directory (the same `hydra.run.dir`, or two started in the same second before the
default became sub-second) both exited 0 and one job's metrics were gone; reusing a directory
truncated `metrics.jsonl` and could leave a stale `summary.json` beside new metrics. The lock is an
advisory `flock` on `<run dir>/.lock`, released by the kernel when the job's process ends, however
it ends, so a killed job never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from recipe.errors import ConfigError
from recipe.rundir.layout import lock_path, metrics_path


def claim_run_directory(run_dir: str | Path, resuming: bool = False):
    """Lock `run_dir` for this job; returns the open lock file (keep it open until the end).
    Only a job that resumes (trainer.resume) may add to a directory that holds metrics."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(lock_path(run_dir), "a+")  # noqa: SIM115 - held for the job's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(
            f"run directory {run_dir} is in use by another job (pid {holder}); give this job its "
            "own hydra.run.dir (the default, outputs/DATE/TIME-MICROSECONDS, is unique)"
        ) from None
    metrics = metrics_path(run_dir)
    if metrics.exists() and metrics.stat().st_size > 0 and not resuming:
        lock.close()
        raise ConfigError(
            f"run directory {run_dir} already holds the metrics of an earlier run "
            f"({metrics.name}); give this job a new hydra.run.dir, move the old run away, or "
            "continue it with trainer.resume=auto"
        )
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock
