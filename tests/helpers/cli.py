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


def run_train_cli(args, cwd, timeout=300, launcher=()):
    """`python [LAUNCHER] train.py TINY ARGS` in a clean environment, as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    return subprocess.run(
        [sys.executable, *launcher, str(ROOT / "train.py"), *TINY, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
