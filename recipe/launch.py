"""From a composed Hydra config to running ranks.

`python train.py cp=2` needs no launcher: with no rank variables in the environment the job starts
its own tp*cp*dp ranks with PyTorch's elastic launch API (gloo on CPU, nccl on GPU) and exits with
their status. Under torchrun (or SLURM, once MASTER_ADDR is set) the ranks already exist and each
simply trains. Hydra's output directory is resolved once, here in the parent, and handed to every
rank, so a job has exactly one.
"""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from recipe.config import ConfigError, TrainConfig


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Validate and convert once; raises ConfigError naming the field and the fix."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))


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


def quiet_libraries() -> None:
    """megatron-core warns at import about optional GPU packages (Apex, Transformer Engine) that a
    CPU run does not need, and logs FSDP set-up at INFO; keep the console for the recipe."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")
    logging.getLogger("megatron").setLevel(logging.WARNING)


@record
def _worker(cfg: TrainConfig) -> dict:
    quiet_libraries()
    from recipe.trainer import train

    return train(cfg)


def max_local_ranks() -> int:
    """How many ranks one machine may start: one per GPU, or a few per CPU core (gloo ranks
    share cores; beyond this the job would crawl, which usually means a typo in cp or dp)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(8, 4 * (os.cpu_count() or 1))


def check_launchable(cfg: TrainConfig) -> None:
    limit = max_local_ranks()
    if cfg.world_size > limit:
        raise ConfigError(
            f"tp*cp*dp = {cfg.parallel.tp}*{cfg.cp.size}*{cfg.parallel.dp} = {cfg.world_size} "
            f"ranks, but this machine can host at most {limit}; lower cp or parallel.dp, or "
            "launch across nodes with torchrun/SLURM"
        )


def launch_world(cfg: TrainConfig, entrypoint=_worker) -> dict:
    """Start cfg.world_size local ranks running `entrypoint(cfg)`; returns rank 0's result.

    A rank that fails takes the others down at once (the agent watches every 0.1 s); its error
    comes back as RanksFailed.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"recipe-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(launch_cfg, entrypoint=entrypoint)(cfg)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise RanksFailed(
            f"rank {rank} failed (exit code {failure.exitcode}):\n{_failure_text(failure)}"
        ) from None
    return results[0]


class RanksFailed(RuntimeError):
    """A self-launched rank failed; the message carries its traceback."""


def _failure_text(failure) -> str:
    """The failed rank's error and traceback, as recorded by `@record` in the worker."""
    message = failure.message
    if isinstance(message, dict):
        info = message.get("extraInfo", {})
        return f"{info.get('py_callstack', '')}{message.get('message', '')}".strip()
    return str(message)


def run(cfg: DictConfig):
    """Hydra task: validate, resolve the one output directory, train (here or on own ranks)."""
    from hydra.core.hydra_config import HydraConfig

    quiet_libraries()
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN"
    try:
        typed = to_typed(cfg)
        if typed.world_size > 1 and not launched_externally():
            check_launchable(typed)
        typed.output_dir = hydra_cfg.runtime.output_dir
        if multirun:
            group_sweep_in_wandb(typed, list(hydra_cfg.overrides.task))
        if typed.world_size == 1 or launched_externally():
            from recipe.trainer import train

            result = train(typed)
        else:
            result = launch_world(typed)
    except (ConfigError, RanksFailed) as err:
        if multirun:
            raise  # Hydra marks the job failed; the sweep's parity report lists it
        prefix = "config error: " if isinstance(err, ConfigError) else ""
        print(f"{prefix}{err}", file=sys.stderr)
        raise SystemExit(2 if isinstance(err, ConfigError) else 1) from None
    summary = result["summary"]
    if int(os.environ.get("RANK", "0")) == 0:
        print(_format_summary(summary, typed.output_dir))
    return summary.get("final_eval_lm_loss")


def group_sweep_in_wandb(cfg: TrainConfig, overrides: list[str]) -> None:
    """Jobs of one sweep share a wandb group (the sweep directory) and carry their overrides as
    tags, so the sweep can be compared in the wandb UI as in the parity report."""
    from pathlib import Path

    sweep_dir = Path(cfg.output_dir).parent
    wandb_cfg = cfg.logger.wandb
    if wandb_cfg.group is None:
        wandb_cfg.group = f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"
    wandb_cfg.tags = [*wandb_cfg.tags, *(o[:64] for o in overrides if not o.startswith("hydra"))]


def _format_summary(summary: dict, output_dir: str) -> str:
    def fmt(value):
        return "n/a" if value is None else (f"{value:.4f}" if isinstance(value, float) else value)

    lines = [f"run directory: {output_dir}"]
    lines += [f"  {key}: {fmt(value)}" for key, value in summary.items()]
    return "\n".join(lines)
