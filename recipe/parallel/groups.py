"""The one module that touches torch.distributed and megatron's process groups.

Everything else takes ranks and sizes as plain arguments. A single-process run still initialises a
world of one (gloo), because megatron-core builds its layers against process groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the tp x cp x dp grid."""

    rank: int
    world_size: int
    tp_size: int
    cp_size: int
    dp_size: int
    cp_rank: int
    dp_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(
    tp_size: int = 1, cp_size: int = 1, timeout_minutes: int = 5
) -> ParallelLayout:
    """Join (or create, for a lone process) the process group and megatron's parallel state.

    Reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as set by torchrun or the recipe's own launcher;
    with none set it starts a world of one on a free loopback port.
    """
    from datetime import timedelta

    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # A lone process: leave the environment alone, so a later job in the same process
            # (a multirun) does not mistake it for a launcher's.
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                rank=0,
                world_size=1,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
    world = dist.get_world_size()
    if world % (tp_size * cp_size):
        raise ValueError(
            f"world size {world} is not a multiple of tp*cp = {tp_size}*{cp_size}; "
            "launch tp*cp*dp processes"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            context_parallel_size=cp_size,
            create_gloo_process_groups=False,
        )
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=world,
        tp_size=tp_size,
        cp_size=cp_size,
        dp_size=world // (tp_size * cp_size),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
    )


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def gradient_group():
    """Gradients are summed over data-parallel x context-parallel ranks (the loss is already
    divided by the global token count, so the sum is the full-batch gradient)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()
