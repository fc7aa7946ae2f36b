"""Start a job's ranks on this machine with PyTorch's elastic launch API, and report failures.

A rank that fails takes the others down at once and its traceback comes back in RanksFailed, so a
user sees the real error instead of a hang or a wall of launcher output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from recipe.config import ConfigError, TrainConfig
from recipe.environment import cuda_available, gpu_sharing
from recipe.errors import RecipeError
from recipe.log import JobLogging, quiet_libraries, set_up_spawned_rank
from recipe.parallel.groups import SELF_LAUNCHED_RUN_PREFIX


@record
def _worker(cfg: TrainConfig, checked=None, job_logging: JobLogging | None = None) -> dict:
    set_up_spawned_rank(job_logging)
    quiet_libraries()
    from recipe.launch.rank import train
    from recipe.training.preemption import Preempted

    try:
        return train(cfg, checked)
    except Preempted as err:  # the parent, signalled too, reports it; exit as the signal says
        if err.requeue_outcome:
            print(err.requeue_outcome, file=sys.stderr)
        raise SystemExit(err.exit_code) from None


# The agent forwards these to the ranks (and ends them 30 s later); SIGUSR1 and SIGUSR2, the
# warnings before a time limit that train.sbatch and submitit ask SLURM for, are added so that they
# reach the ranks' checkpoint instead of killing the parent alone.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


RANKS_PER_SHARED_GPU = 8
"""With GPU sharing on (a diagnostic, see recipe.environment.GPU_SHARING_MODES)."""


def max_local_ranks() -> int:
    """How many ranks one machine may start: one per GPU (a few with GPU sharing on), or a few
    per CPU core (gloo ranks share cores; beyond this the job would crawl, which usually means a
    typo in cp or dp)."""
    import torch

    if cuda_available():
        shared = gpu_sharing() != "off"
        return torch.cuda.device_count() * (RANKS_PER_SHARED_GPU if shared else 1)
    return max(8, 4 * (os.cpu_count() or 1))


def check_launchable(cfg: TrainConfig) -> None:
    limit = max_local_ranks()
    if cfg.world_size > limit:
        raise ConfigError(
            f"{cfg.parallel_dims.product()} ranks, but this machine can host at most {limit}; "
            "lower cp or parallel.dp, or launch across nodes with torchrun/SLURM"
        )


def launch_world(cfg: TrainConfig, entrypoint=_worker, checked=None) -> dict:
    """Start cfg.world_size local ranks running `entrypoint(cfg)`; returns rank 0's result.
    `checked` (a `recipe.launch.preflight.Preflight`): what this process's start-up check
    resolved, handed to every rank of the default entrypoint (which then checks no more), as is
    this Hydra job's logging set-up (rank 0 logs to the job's console and train.log).

    A rank that fails takes the others down at once (the agent watches every 0.1 s); its error
    comes back as RanksFailed.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"{SELF_LAUNCHED_RUN_PREFIX}{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        # The ranks' MASTER_ADDR (their process group's store) would otherwise be this host's
        # fully qualified name, which need not resolve (containers, laptops off their network):
        # every rank is on this machine, so loopback always reaches rank 0.
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle=FORWARDED_SIGNALS,
    )
    # torch elastic logs every failed rank's traceback at ERROR; the recipe reports the root
    # failure itself (RanksFailed), once
    elastic_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)
    try:
        if entrypoint is _worker:
            args = (cfg, checked, JobLogging.of_this_job())
        else:
            args = (cfg,) if checked is None else (cfg, checked)
        results = elastic_launch(launch_cfg, entrypoint=entrypoint)(*args)
    except ChildFailedError as err:
        signum = stopped_by_signal([f.exitcode for f in err.failures.values()])
        if signum:  # a rank was signalled, every rank stopped at the step boundary with it
            raise RanksStopped(signum, by_rank=True) from None
        raise RanksFailed(describe_failures(err.failures)) from None
    except SignalException as err:  # the agent has already ended the ranks
        raise RanksStopped(err.sigval) from None
    finally:
        elastic_log.setLevel(level)
    return results[0]


def stopped_by_signal(exit_codes: list[int]) -> int:
    """The stop signal the ranks ended on, when they all exited with the shell's code for the
    same forwarded signal (128 + its number: what a rank's checkpoint-and-stop exits with), else
    0. A signal sent to one rank then ends the job as a signal to the parent does."""
    import signal

    stop_codes = {128 + int(getattr(signal, name)) for name in FORWARDED_SIGNALS.split(",")}
    codes = set(exit_codes)
    if len(codes) == 1 and (code := codes.pop()) in stop_codes:
        return code - 128
    return 0


class RanksStopped(Exception):
    """The job was sent a termination signal (SIGTERM, SIGINT, ...); its ranks were ended."""

    def __init__(self, signum: int, by_rank: bool = False):
        import signal

        self.signum = int(signum)
        name = signal.Signals(self.signum).name
        how = (
            "a rank was sent it and every rank stopped at the step boundary"
            if by_rank
            else "the ranks were ended"
        )
        super().__init__(f"stopped by {name}; {how}")

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + self.signum


# What a rank reports when it failed only because another one died first.
LOST_PEER_MARKERS = (
    "Connection closed by peer",
    "remote worker crashing",
    "Connection reset by peer",
)


def describe_failures(failures: dict) -> str:
    """The root failure in full, then one line per other failed rank.

    When one rank dies, its peers' collectives fail too and the launcher may notice them first;
    the rank whose recorded error is not about a lost peer is the cause.
    """

    def secondary(item) -> tuple:
        rank, failure = item
        lost_peer = any(marker in _failure_text(failure) for marker in LOST_PEER_MARKERS)
        # A rank the agent terminated may still have recorded its own error before: keep that.
        recorded = isinstance(failure.message, dict)
        return (lost_peer, not recorded, failure.timestamp, rank)

    import socket

    ordered = sorted(failures.items(), key=secondary)
    (rank, failure), others = ordered[0], ordered[1:]
    host = socket.gethostname()  # self-launched ranks all run on this machine
    text = _failure_text(failure)
    said = recipe_error_line(text)
    if said:  # the recipe's own error already names the problem and the fix: no traceback
        return f"rank {rank} failed (exit code {failure.exitcode}) on {host}: {said}"
    lines = [f"rank {rank} failed (exit code {failure.exitcode}) on {host}:\n{text}"]
    for other_rank, other in others:
        last = (_failure_text(other).strip().splitlines() or ["(no error recorded)"])[-1]
        lines.append(f"(also failed: rank {other_rank}, exit code {other.exitcode}: {last})")
    return "\n".join(lines)


def recipe_error_line(traceback_text: str) -> str | None:
    """`Name: message` when a rank's recorded traceback ends in one of the recipe's own errors
    (a RecipeError: a full disk, a config error, a non-finite step), else None."""
    import importlib

    # The traceback's exception line names the class with its module (the recorded message
    # after it repeats it without): the last line that starts with `recipe.`.
    for line in reversed(traceback_text.strip().splitlines()):
        qualified, sep, message = line.partition(": ")
        module, _, name = qualified.rpartition(".")
        if not sep or not module.startswith("recipe.") or " " in qualified:
            continue
        try:
            error = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
        if isinstance(error, type) and issubclass(error, RecipeError):
            return f"{name}: {message}"
        return None
    return None


class RanksFailed(RecipeError, RuntimeError):
    """A self-launched rank failed; the message carries its traceback."""


def _failure_text(failure) -> str:
    """The failed rank's error and traceback, as recorded by `@record` in the worker."""
    message = failure.message
    if isinstance(message, dict):
        info = message.get("extraInfo", {})
        return f"{info.get('py_callstack', '')}{message.get('message', '')}".strip()
    return str(message)


@contextlib.contextmanager
def lone_world(seed: int = 0):
    """This process as a world of one, with megatron's parallel state, for building and running
    models outside a training run (tests, scripts); torn down afterwards."""
    from recipe.megatron.cpu_patches import install_cpu_patches, seed_model_parallel_rng
    from recipe.parallel import groups

    install_cpu_patches()
    with groups.parallel_world() as layout:
        seed_model_parallel_rng(seed)
        yield layout
