"""A trainer on this rank, for the jobs tests run in a world (a launched one or a world of one):
the one way they build it, so each test says only what it changes and what it reads."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def rank_trainer(cfg, seed: int | None = None):
    """A `Trainer` of `cfg` on this rank's CPU world, the world up while it is used: megatron's
    CPU patches installed, the model-parallel RNG seeded (`seed`, by default the run's), the
    run's corpus loaded (its images too, where it has them)."""
    import torch

    from recipe.data.corpus import load_corpus
    from recipe.megatron.cpu_patches import install_cpu_patches, seed_model_parallel_rng
    from recipe.parallel import groups
    from recipe.training.trainer import Trainer

    install_cpu_patches()
    with groups.parallel_world(cfg.parallel_dims, timeout_s=120) as layout:
        seed_model_parallel_rng(cfg.trainer.seed if seed is None else seed)
        yield Trainer(cfg, layout, torch.device("cpu"), load_corpus(cfg.data, cfg.image_grid))


def train_records(trainer, steps: int) -> list[dict]:
    """`steps` training steps' records."""
    return [trainer.train_step().to_record() for _ in range(steps)]


# A metrics record's wall-clock values: never equal between two runs of the same steps.
TIMINGS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu")


def without_timings(records) -> list[dict]:
    """Each record less its wall-clock values: what two runs of the same steps must share."""
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]
