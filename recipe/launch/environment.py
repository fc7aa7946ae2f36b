"""What the launcher environment says about this process: torchrun, SLURM or a lone process."""

from __future__ import annotations

import os


def _adopt_slurm_environment() -> None:
    """Map SLURM's task variables onto torch.distributed's, when the job script set MASTER_ADDR."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    os.environ.setdefault("MASTER_PORT", "29500")


def launched_externally() -> bool:
    _adopt_slurm_environment()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
