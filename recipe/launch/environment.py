"""The one reader of the launcher environment: torchrun, SLURM, or a lone process.

torchrun (and the recipe's own launcher) set RANK/WORLD_SIZE/LOCAL_RANK; under SLURM the job
script sets MASTER_ADDR and each task knows itself from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID;
anything else is a lone process that may start its own ranks. `read_environment` is pure (it takes
the mapping), `adopt_environment` also exports SLURM's answer in torch.distributed's variables so
an env:// rendezvous works. The compute device follows from the local rank, here and only here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

LAUNCHERS = ("none", "torchrun", "slurm")
DEFAULT_MASTER_PORT = "29500"


@dataclass(frozen=True)
class ProcessEnvironment:
    """Who this process is, as its launcher says."""

    launcher: str
    """none (a lone process) | torchrun (RANK/WORLD_SIZE set) | slurm (SLURM task + MASTER_ADDR)."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def external(self) -> bool:
        """Ranks already exist: the job must join them rather than start its own."""
        return self.launcher != "none"

    @property
    def device(self):
        """The device this process computes on (see compute_device)."""
        return compute_device(self.local_rank)


def _slurm_tasks_per_node(environ: Mapping[str, str], world_size: int) -> int:
    # SLURM writes e.g. "8" or "8(x2)"; the leading count is this node's.
    value = environ.get("SLURM_NTASKS_PER_NODE", "")
    digits = value.split("(")[0].split(",")[0]
    return int(digits) if digits.isdigit() else world_size


def read_environment(environ: Mapping[str, str]) -> ProcessEnvironment:
    """Rank, local rank, world and local world of this process, from `environ` alone."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = int(environ["WORLD_SIZE"])
        return ProcessEnvironment(
            launcher="torchrun",
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
        )
    if "SLURM_PROCID" in environ and "MASTER_ADDR" in environ:
        world = int(environ.get("SLURM_NTASKS", "1"))
        return ProcessEnvironment(
            launcher="slurm",
            rank=int(environ["SLURM_PROCID"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            world_size=world,
            local_world_size=_slurm_tasks_per_node(environ, world),
        )
    return ProcessEnvironment("none", rank=0, local_rank=0, world_size=1, local_world_size=1)


def adopt_environment(environ: MutableMapping[str, str] = os.environ) -> ProcessEnvironment:
    """Read the environment; under SLURM also export it as torch.distributed's variables."""
    env = read_environment(environ)
    if env.launcher == "slurm":
        environ.setdefault("RANK", str(env.rank))
        environ.setdefault("WORLD_SIZE", str(env.world_size))
        environ.setdefault("LOCAL_RANK", str(env.local_rank))
        environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
        environ.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)
    return env


def compute_device(local_rank: int):
    """The GPU of this local rank where CUDA exists, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
