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

from recipe.config import ConfigError, TrainConfig


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Validate and convert once; raises ConfigError naming the field and the fix."""
    typed = OmegaConf.to_object(cfg)
    if not isinstance(typed, TrainConfig):  # composed without the schema
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
    return typed


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


def _worker(cfg: TrainConfig) -> dict:
    from recipe.trainer import train

    return train(cfg)


def launch_world(cfg: TrainConfig) -> dict:
    """Start cfg.world_size local ranks and wait; returns rank 0's result."""
    import torch
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
        results = elastic_launch(launch_cfg, entrypoint=_worker)(cfg)
    except ChildFailedError as err:
        first = min(err.failures)
        failure = err.failures[first]
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        print(f"rank {failure.local_rank} failed: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    del torch
    return results[0]


def run(cfg: DictConfig):
    """Hydra task: validate, resolve the one output directory, train (here or on own ranks)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        typed = to_typed(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    typed.output_dir = HydraConfig.get().runtime.output_dir
    if typed.world_size == 1 or launched_externally():
        from recipe.trainer import train

        result = train(typed)
    else:
        result = launch_world(typed)
    summary = result["summary"]
    if int(os.environ.get("RANK", "0")) == 0:
        print(_format_summary(summary, typed.output_dir))
    return summary.get("final_eval_lm_loss")


def _format_summary(summary: dict, output_dir: str) -> str:
    def fmt(value):
        return "n/a" if value is None else (f"{value:.4f}" if isinstance(value, float) else value)

    lines = [f"run directory: {output_dir}"]
    lines += [f"  {key}: {fmt(value)}" for key, value in summary.items()]
    return "\n".join(lines)
