"""The one module that creates and looks up process groups (torch.distributed and megatron's).

Everything else takes ranks and sizes as plain arguments (`layout`) or is handed a group
(`collectives`). A single-process run still initialises a
world of one (gloo), because megatron-core builds its layers against process groups.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from recipe.config.layout import ParallelDims, ParallelLayout
from recipe.environment import (
    ProcessEnvironment,
    collective_backend,
    gpu_sharing,
    read_environment,
)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(
    dims: ParallelDims | None = None,
    env: ProcessEnvironment | None = None,
    timeout_s: float = 300.0,
) -> ParallelLayout:
    """Join (or create, for a lone process) the process group and megatron's parallel state.

    Under a launcher (torchrun, SLURM, the recipe's own) the world is joined through env://
    (MASTER_ADDR/MASTER_PORT); a lone process starts a world of one on a free loopback port and
    leaves the environment alone, so a later job in the same process (a multirun) does not
    mistake it for a launcher's. Every group gets the same `timeout_s`: megatron's groups, which
    carry the gradient, loss and CP exchanges, would otherwise keep megatron's 30 minutes.
    """
    from datetime import timedelta

    from megatron.core import parallel_state

    dims = dims or ParallelDims()
    env = env or read_environment(os.environ)
    if not dist.is_initialized():
        _check_launched_world(dims, env)
        device = env.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        sharing = gpu_sharing()
        backend = collective_backend(device.type, sharing)
        if device.type == "cuda" and sharing == "nccl":
            # read by NCCL when the communicator is created; refused by NCCL before 2.30
            os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        timeout = timedelta(seconds=timeout_s)
        if env.external:
            _join_external_world(backend, timeout, env)
        else:
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                rank=0,
                world_size=1,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
    dims.check_world_size(dist.get_world_size())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            context_parallel_size=dims.cp,
            pipeline_model_parallel_size=dims.pp,
            create_gloo_process_groups=False,
            distributed_timeout_minutes=timeout_s / 60,  # megatron builds timedelta(minutes=...)
        )
    layout = dims.layout_of(dist.get_rank())
    megatron_says = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    recipe_says = (layout.tp_rank, layout.cp_rank, layout.dp_rank, layout.pp_rank)
    if megatron_says != recipe_says:
        raise RuntimeError(
            f"rank {layout.rank}: megatron places it at (tp, cp, dp, pp) = {megatron_says}, the "
            f"recipe's layout at {recipe_says}; the rank "
            "order of megatron-core changed and recipe/config/layout.py must follow it"
        )
    return layout


RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")


def _rendezvous_variables() -> str:
    return " ".join(f"{k}={os.environ[k]}" for k in RENDEZVOUS_VARIABLES if k in os.environ)


def _check_launched_world(dims: ParallelDims, env: ProcessEnvironment) -> None:
    from recipe.errors import ConfigError

    try:
        dims.check_world_size(env.world_size)
    except ConfigError as err:
        if not env.external:
            raise
        raise ConfigError(
            f"{err} ({_rendezvous_variables()} came from the environment; if no launcher set "
            "them, unset them and the recipe starts its own ranks)"
        ) from None


SELF_LAUNCHED_RUN_PREFIX = "recipe-self-launch-"
"""How the recipe's own launcher (recipe/launch/local.py) names its runs; torch elastic hands the
name to each rank as TORCHELASTIC_RUN_ID."""


def _join_external_world(backend: str, timeout, env: ProcessEnvironment) -> None:
    """Join ranks a launcher started. Say at once which variables made the recipe think so: left
    over in a shell, they would otherwise mean a silent wait for ranks that never come."""
    from recipe.errors import ConfigError
    from recipe.log import get_logger

    seen = _rendezvous_variables()
    # The recipe's own ranks: it set those variables itself, there is nothing to say.
    if not os.environ.get("TORCHELASTIC_RUN_ID", "").startswith(SELF_LAUNCHED_RUN_PREFIX):
        get_logger(__name__).info(
            f"joining a world of {env.world_size} ranks started outside the recipe ({seen}); "
            f"waiting up to {timeout.total_seconds():g} s for them"
        )
    try:
        dist.init_process_group(backend=backend, timeout=timeout)
    except (RuntimeError, dist.DistError) as err:
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            raise
        raise ConfigError(
            f"rank {env.rank}: the other ranks of a world of {env.world_size} did not join within "
            f"{timeout.total_seconds():g} s. {seen} came from the environment: if no launcher "
            "started those ranks (variables left over in this shell), unset them and the recipe "
            "starts its own ranks; otherwise check that every rank reaches MASTER_ADDR:MASTER_PORT"
        ) from None


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def release_model_parallel() -> None:
    """Forget megatron's parallel state and destroy every group but the world, which stays up:
    the next job in the same world may use another (tp, cp, dp). megatron's own teardown only
    drops its references, so without this each job would leave a dozen gloo groups (sockets and
    threads) behind."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


@contextlib.contextmanager
def parallel_world(dims: ParallelDims | None = None, timeout_s: float = 300.0):
    """Megatron's parallel state for `dims` in the world this process is in (a world of one if
    it is in none), torn down afterwards: the world too when this call created it, else only
    the groups, so a world that outlives the job stays usable."""
    owns_world = not dist.is_initialized()
    layout = init_distributed(dims, timeout_s=timeout_s)
    try:
        yield layout
    finally:
        if owns_world:
            shutdown_distributed()
        else:
            release_model_parallel()


def gradient_group():
    """Gradients are summed over data-parallel x context-parallel ranks (the loss is already
    divided by the global token count, so the sum is the full-batch gradient)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def megatron_parallel_state():
    """megatron's parallel_state module itself, for released functions that read their ranks
    from it (recipe/upstream/releases.py)."""
    from megatron.core import parallel_state

    return parallel_state


def pipeline_group():
    """The ranks that hold the other stages of this rank's model (one per stage)."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def embedding_group():
    """megatron's group of the first and last pipeline stage of this rank's pipeline: the stages
    that hold an embedding (the last one for its output layer or MTP block)."""
    from megatron.core import parallel_state

    return parallel_state.get_embedding_group()


def cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()
