"""Shared fixtures: compose the real Hydra config, then shrink it so tests run in seconds."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipe.config import register_configs
from recipe.launch.overrides import quote_numeric_group_choices
from recipe.launch.task import to_typed

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = str(ROOT / "conf")

# Tiny model and data: real code paths, seconds per run.
TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    "data.max_seq_len=256",
    "data.markov.mean_doc_len=60",
    "data.markov.max_doc_len=200",
    "data.markov.num_train_docs=300",
    "data.markov.num_eval_docs=20",
    "data.max_eval_tokens=2048",
    "batching.tokens_per_step=1024",
    "batching.max_tokens_per_rank=512",
    "trainer.max_steps=4",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "optim.warmup_steps=2",
    "logger.wandb.mode=disabled",
]


# Short sequences in many micro-batches: keep four ranks on two cores fast in parity tests.
SHORT_SEQUENCES = [
    "data.max_seq_len=128",
    "data.markov.max_doc_len=120",
    "data.markov.mean_doc_len=40",
    "batching.tokens_per_step=512",
    "batching.max_tokens_per_rank=256",
    "data.max_eval_tokens=512",
    "trainer.eval_every=0",
]


def run_train_cli(args, cwd, timeout=300, launcher=()):
    """`python [LAUNCHER] train.py TINY ARGS` in a clean environment, as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    return subprocess.run(
        [sys.executable, *launcher, str(ROOT / "train.py"), *TINY, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def compose_config(overrides: list[str] | None = None, tiny: bool = True):
    """The composed DictConfig, exactly as `python train.py OVERRIDES` would see it."""
    register_configs()
    args = (TINY if tiny else []) + list(overrides or [])
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=quote_numeric_group_choices(args))


def typed_config(overrides: list[str] | None = None, tiny: bool = True, output_dir=None):
    cfg = to_typed(compose_config(overrides, tiny))
    cfg.output_dir = None if output_dir is None else str(output_dir)
    return cfg


RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


@pytest.fixture(autouse=True)
def _isolated_environment():
    """A test process is a lone rank unless a test says otherwise, and whatever a test (or the
    code under test) writes into os.environ is undone afterwards."""
    saved = dict(os.environ)
    for var in RANK_VARIABLES:
        os.environ.pop(var, None)
    os.environ.setdefault("WANDB_MODE", "disabled")
    yield
    os.environ.clear()
    os.environ.update(saved)


@contextlib.contextmanager
def lone_world(seed: int = 0):
    """A world of one process with megatron's parallel state, for building models in tests."""
    from recipe.model.cpu_compat import apply_cpu_compat, seed_model_parallel_rng
    from recipe.parallel import groups as distributed

    apply_cpu_compat()
    layout = distributed.init_distributed()
    try:
        seed_model_parallel_rng(seed)
        yield layout
    finally:
        distributed.shutdown_distributed()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
