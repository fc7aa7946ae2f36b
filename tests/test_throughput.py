"""Model FLOPs and MFU: the count against a hand-written one, and the metric in the step record."""

from __future__ import annotations

import pytest

from recipe.training.throughput import (
    device_peak_tflops,
    linear_parameter_count,
    model_flops_per_step,
)
from tests.helpers.config import typed_config
from tests.helpers.world import lone_world


def _matrices_by_hand(m, vocab: int) -> int:
    """Weight matrices of the recipe's GPT, from the config alone; the embedding and output layer
    have the padded vocabulary's rows (real work: the padded logits are computed too)."""
    vocab = -(-vocab // m.make_vocab_size_divisible_by) * m.make_vocab_size_divisible_by
    head_dim = m.hidden_size // m.num_attention_heads
    qkv = m.hidden_size * (m.hidden_size + 2 * m.num_query_groups * head_dim)
    proj = m.hidden_size * m.hidden_size
    mlp = (3 if m.swiglu else 2) * m.hidden_size * m.ffn_hidden_size  # gate, up, down
    return m.num_layers * (qkv + proj + mlp) + vocab * m.hidden_size  # + the output layer


@pytest.mark.stack_dependent
@pytest.mark.parametrize("extra", [[], ["model.tie_embeddings=true"], ["model.swiglu=true"]])
def test_linear_parameters_match_a_count_by_hand(extra):
    import torch

    from recipe.training.trainer import build_model

    cfg = typed_config(extra)
    with lone_world():
        model = build_model(cfg, 259, torch.device("cpu"))
    assert linear_parameter_count(model) == _matrices_by_hand(cfg.model, 259)


def test_flops_follow_real_lengths_and_causal_pairs():
    # 2 sequences of 3 and 1 tokens: 4 tokens, 6 + 1 attended (query, key) pairs.
    assert model_flops_per_step([3, 1], linear_params=10, hidden_size=2, attention_layers=5) == (
        6 * 10 * 4 + 12 * 2 * 5 * 7
    )


def test_peak_is_the_override_else_none_on_cpu():
    import torch

    assert device_peak_tflops(torch.device("cpu"), "fp32", None) is None
    assert device_peak_tflops(torch.device("cpu"), "fp32", 2.5) == 2.5


def test_mfu_in_the_record_when_a_peak_is_known():
    import torch

    from recipe.data.corpus import load_corpus
    from recipe.training.trainer import Trainer

    cfg = typed_config(["trainer.peak_tflops=0.5"])
    plain = typed_config()
    with lone_world() as layout:
        trainer = Trainer(cfg, layout, torch.device("cpu"), load_corpus(cfg.data))
        work_lengths = []
        original = trainer._plan

        def spy(sequences, *args):
            work_lengths.append([len(s) for s in sequences])
            return original(sequences, *args)

        trainer._plan = spy
        record = trainer.train_step().to_record()
        no_peak = Trainer(plain, layout, torch.device("cpu"), load_corpus(plain.data))
        assert "mfu" not in no_peak.train_step().to_record()
    flops = model_flops_per_step(
        work_lengths[0], _matrices_by_hand(cfg.model, 259), cfg.model.hidden_size, 1
    )
    assert record["mfu"] == pytest.approx(flops / record["step_time_s"] / 0.5e12, rel=1e-3)
    assert "tokens_per_s_per_device" not in record, "per-device throughput is a GPU metric"
