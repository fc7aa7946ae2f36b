"""One rank's run: its world, its data, its Trainer, where it starts, its records.

`train(cfg)` is what every rank runs, whoever started it: the Hydra task in this process (a world
of one, or a rank of torchrun / SLURM / submitit), or the local launcher's spawned ranks, which
receive the start-up check's result (`Preflight`) from the parent instead of checking again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from recipe.checkpoint import set_aside_newer
from recipe.config import TrainConfig
from recipe.data.corpus import load_corpus
from recipe.environment import cuda_available, read_environment
from recipe.errors import ConfigError
from recipe.launch.preflight import Preflight, preflight
from recipe.log import get_logger
from recipe.megatron.cpu_patches import install_cpu_patches, seed_model_parallel_rng
from recipe.model.numerics import apply_determinism
from recipe.parallel import collectives, groups
from recipe.training.loggers import NullLogger, RunLogger
from recipe.training.preemption import Preempted, requeue_slurm_job
from recipe.training.trainer import Trainer

_log = get_logger(__name__)


def where_training_starts(resume: str | None, checkpoint: Path | None, step: int) -> str:
    """The one line that says where training starts (console and train.log)."""
    if checkpoint is not None:
        return f"resuming from {checkpoint}: training starts after step {step}"
    if resume == "auto":
        return "no checkpoint to resume in this run directory: starting at step 0"
    return "starting at step 0"


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


def check_one_run_directory(per_rank: list[str | None]) -> None:
    """Every rank of a world writes into one run directory: a checkpoint gathers every rank's
    shard there, and rank 0's manifest lists what it sees there."""
    if len(set(per_rank)) > 1:
        shown = ", ".join(f"rank {r}: {d}" for r, d in enumerate(per_rank))
        raise ConfigError(
            f"the ranks of this world name different run directories ({shown}); give every "
            "rank the same hydra.run.dir, on a filesystem all of them see"
        )


def share_cores(local_world: int) -> None:
    """Ranks of one machine share its cores instead of each grabbing all of them."""
    if not cuda_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def train(cfg: TrainConfig, checked: Preflight | None = None) -> dict:
    """Train one model on this rank; returns {"summary": ..., "history": [records]}.

    `checked`: what the start-up check resolved in the process that started this rank; without
    it (a script, a test) this process checks first."""
    install_cpu_patches()
    owns_world = not torch.distributed.is_initialized()
    env = read_environment(os.environ)
    layout = groups.init_distributed(cfg.parallel_dims, env, cfg.trainer.collective_timeout_s)
    logger = NullLogger()
    try:
        check_one_run_directory(collectives.gather_to_all(_absolute(cfg.output_dir)))
        share_cores(env.local_world_size)
        seed_model_parallel_rng(cfg.trainer.seed)
        if checked is None:
            checked = preflight(cfg, env.device)
        apply_determinism(cfg.trainer.deterministic)
        corpus = load_corpus(cfg.data, cfg.image_grid)
        trainer = Trainer(cfg, layout, env.device, corpus)
        checkpoint = checked.checkpoint
        changes = trainer.restore(checkpoint) if checkpoint else []
        _log.info(where_training_starts(cfg.trainer.resume, checkpoint, trainer.step))
        if layout.is_main:
            logger = trainer.logger = RunLogger(
                cfg, cfg.output_dir, cfg.trainer.max_steps, first_step=trainer.step
            )
            if cfg.trainer.resume is not None:
                moved = []
                if checkpoint is not None and trainer.checkpoint_dir is not None:
                    moved = set_aside_newer(trainer.checkpoint_dir, trainer.step)
                    for path in moved:
                        _log.warning(f"set aside {path}: a later step of the abandoned timeline")
                logger.log_resume(
                    trainer.step, trainer.history, checkpoint, changes, trainer.run_id, moved
                )
            else:
                logger.log_start(trainer.run_id)
        try:
            return trainer.train()
        except Preempted as err:
            if cfg.trainer.requeue and layout.is_main:
                err.requeue_outcome = requeue_slurm_job()
            raise
    finally:
        logger.close()
        if owns_world:
            groups.shutdown_distributed()
