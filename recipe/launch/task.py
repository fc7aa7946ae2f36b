"""From a composed Hydra config to running ranks.

`python train.py cp=2` needs no launcher: with no rank variables in the environment the job starts
its own tp*cp*dp ranks with PyTorch's elastic launch API (gloo on CPU, nccl on GPU) and exits with
their status. Under torchrun, SLURM (once MASTER_ADDR is set) or a multi-task submitit job the
ranks already exist and each simply trains. Hydra's output directory is resolved once, here in the
parent, and handed to every rank, so a job has exactly one. On a cluster a rank that fails says
which rank and host it is: each writes to its own log, and the first error is rarely rank 0's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from recipe.checkpoint import complete_checkpoints, resolve_resume
from recipe.config import ConfigError, TrainConfig
from recipe.environment import ProcessEnvironment, adopt_environment
from recipe.errors import RecipeError
from recipe.launch.compose import to_typed
from recipe.launch.local import RanksStopped, check_launchable, launch_world
from recipe.launch.noise_twin import is_sweep_baseline, train_twin_here
from recipe.launch.preflight import (
    Preflight,
    check_launched_world,
    check_resumable,
    check_run_choices,
)
from recipe.launch.rank import train
from recipe.log import get_logger, quiet_libraries
from recipe.rundir.claim import claim_run_directory
from recipe.rundir.job_files import write_job_files
from recipe.rundir.layout import checkpoints_dir
from recipe.training.preemption import Preempted

log = get_logger(__name__)


def run(cfg: DictConfig):
    """Hydra task: validate, resolve the one output directory, train (here or on own ranks)."""
    from hydra.core.hydra_config import HydraConfig

    quiet_libraries()
    # A log line that cannot be written (the run directory's disk is full) is dropped, not
    # followed by logging's own traceback: the error it was about is reported on the console.
    logging.raiseExceptions = False
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN"
    env = adopt_environment()
    where = _rank_and_host(env)
    try:
        typed = to_typed(cfg)
        check_launched_world(typed, env)
        check_run_choices(typed, env.device)  # before any rank starts or data loads
        if typed.world_size > 1 and not env.external:
            check_launchable(typed)
        typed.output_dir = hydra_cfg.runtime.output_dir
        if env.rank == 0:
            resuming = typed.trainer.resume is not None
            run_dir_lock = claim_run_directory(typed.output_dir, resuming)  # noqa: F841
        checked = Preflight(checkpoint=check_resumable(typed))
        if env.rank == 0:
            write_job_files(typed.output_dir, cfg, hydra_cfg)
        if multirun:
            group_sweep_in_wandb(typed, list(hydra_cfg.overrides.task))
        if typed.world_size == 1 or env.external:
            result = train(typed, checked)
        else:
            result = launch_world(typed, checked=checked)
    except RanksStopped as err:
        log.error(f"{err}; {_how_to_continue(typed.output_dir)}")
        raise SystemExit(err.exit_code) from None
    except Preempted as err:
        log.error(
            f"{where}{err}; continue with trainer.resume=auto hydra.run.dir={typed.output_dir}"
        )
        raise SystemExit(err.exit_code) from None
    except RecipeError as err:  # each carries its exit code
        if multirun:
            if where:
                log.error(f"{where}failed: {err}")
            raise  # Hydra marks the job failed; the sweep's parity report lists it
        prefix = "config error: " if isinstance(err, ConfigError) else ""
        log.error(f"{where}{prefix}{err}")
        raise SystemExit(err.exit_code) from None
    except KeyboardInterrupt:  # Ctrl-C stops at once (docs/checkpoints.md): one line, exit 130
        output_dir = hydra_cfg.runtime.output_dir
        log.error(f"{where}interrupted (SIGINT): stopped at once, without a checkpoint; "
                  f"{_how_to_continue(output_dir, verify=False)}")  # fmt: skip
        raise SystemExit(130) from None
    except Exception:
        if where:  # what Hydra prints next carries no rank: say whose traceback it is
            log.exception(f"{where}failed with an unexpected error")
        raise
    summary = result["summary"]
    log.info(_format_summary(summary, typed.output_dir))
    if multirun and env.rank == 0 and typed.compare.noise_floor == "twin":
        if is_sweep_baseline(typed, hydra_cfg.job.num):
            log.info(f"compare.noise_floor=twin: training the noise twin of {typed.output_dir}")
            train_twin_here(typed.output_dir)
    return summary.get("final_eval_lm_loss")


def _rank_and_host(env: ProcessEnvironment) -> str:
    """`rank 3 on node7: ` for a rank of a launched world; empty for a lone process, whose
    self-launched ranks are named by the launcher's failure report."""
    import socket

    return f"rank {env.rank} on {socket.gethostname()}: " if env.external else ""


def _how_to_continue(output_dir: str, verify: bool = True) -> str:
    """Where `trainer.resume=auto` would continue. `verify=False` (after Ctrl-C, where a user
    waits for the prompt) names the newest complete checkpoint without checksumming it."""
    try:
        if verify:
            checkpoint = resolve_resume("auto", output_dir)
        else:
            found = complete_checkpoints(checkpoints_dir(output_dir))
            checkpoint = found[-1][1] if found else None
    except ConfigError:  # each damaged one was named in a warning just now
        return "no checkpoint of this run verifies"
    if checkpoint is None:
        return "no checkpoint was written"
    return (
        f"newest checkpoint {checkpoint}; continue with trainer.resume=auto "
        f"hydra.run.dir={output_dir}"
    )


def group_sweep_in_wandb(cfg: TrainConfig, overrides: list[str]) -> None:
    """Jobs of one sweep share a wandb group (the sweep directory) and carry their overrides as
    tags, so the sweep can be compared in the wandb UI as in the parity report."""

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
