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


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over `group` in place (the whole world by default); no-op for a world of one."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_gradients(parameters, group) -> None:
    """Sum gradients over `group` (bucketed into one flat buffer to keep gloo calls few).

    A rank that saw no tokens this step has no gradients yet; it joins with zeros so every rank
    reduces a buffer of the same layout.
    """
    if dist.get_world_size(group) == 1:
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class _AllGatherSumBackward(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradient over the group, keeps this rank's slice.

    Written with plain collectives on an explicit group because `torch.distributed.nn`'s all_gather
    misbehaves on sub-groups (dp > 1).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.rows = tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows], None


def all_gather_with_sum_backward(tensor: torch.Tensor, group) -> torch.Tensor:
    return _AllGatherSumBackward.apply(tensor, group)
