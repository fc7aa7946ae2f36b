"""Compose the real Hydra config, then shrink it so tests run in seconds."""

from __future__ import annotations

from pathlib import Path

from recipe.launch import compose
from recipe.launch.compose import to_typed

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = str(compose.CONF_DIR)

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


def compose_config(overrides: list[str] | None = None, tiny: bool = True):
    """The composed DictConfig, exactly as `python train.py OVERRIDES` would see it."""
    return compose.compose_config((TINY if tiny else []) + list(overrides or []))


def typed_config(overrides: list[str] | None = None, tiny: bool = True, output_dir=None):
    cfg = to_typed(compose_config(overrides, tiny))
    cfg.output_dir = None if output_dir is None else str(output_dir)
    return cfg
