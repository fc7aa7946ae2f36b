"""End to end, in process: the training function on a tiny config learns, and writes its outputs."""

from __future__ import annotations

import json

import pytest

from recipe.launch.rank import train
from recipe.rundir.metrics import read_metrics
from tests.helpers.config import typed_config
from tests.helpers.world import lone_world

# Every step record has these keys, in this order (MTP and eval keys join when they apply).
REQUIRED = (
    "step",
    "lm_loss",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "padded_tokens",
    "micro_batches",
    "step_time_s",
    "tokens_per_s",
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = typed_config(
        [
            "trainer.max_steps=30",
            "trainer.eval_every=10",
            "optim.lr=1e-2",
            "optim.warmup_steps=3",
            "model.hidden_size=64",
            "model.ffn_hidden_size=128",
        ],
        output_dir=out,
    )
    return train(cfg), out


@pytest.mark.stack_dependent
def test_loss_falls(tiny_run):
    result, _ = tiny_run
    history = result["history"]
    first = sum(h["lm_loss"] for h in history[:3]) / 3
    last = sum(h["lm_loss"] for h in history[-3:]) / 3
    assert last < first - 1.0, (first, last)
    evals = [h["eval_lm_loss"] for h in history if "eval_lm_loss" in h]
    assert len(evals) == 3 and evals[-1] < evals[0]


def test_metrics_and_summary_files(tiny_run):
    result, out = tiny_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(set(REQUIRED) <= set(r) for r in rows)
    assert all(r["tokens"] <= 1024 and r["padded_tokens"] >= r["tokens"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary == result["summary"]
    assert summary["steps"] == 30
    assert summary["final_lm_loss"] == pytest.approx(sum(r["lm_loss"] for r in rows[-10:]) / 10)
    assert summary["final_eval_lm_loss"] == rows[-1]["eval_lm_loss"]
    # The Markov source knows its floor; the unigram baseline sits well above it.
    assert summary["baseline_loss"] - summary["entropy_floor"] > 0.5
    assert summary["wall_time_s"] > 0


@pytest.mark.stack_dependent
def test_micro_batching_does_not_change_the_step(tmp_path):
    """Same data, budget small enough to force several micro-batches: identical losses."""
    base = ["trainer.max_steps=3", "model.hidden_size=32"]
    one = train(typed_config(base + ["batching.max_tokens_per_rank=1024"]))["history"]
    many = train(typed_config(base + ["batching.max_tokens_per_rank=256"]))["history"]
    assert [h["micro_batches"] for h in one] != [h["micro_batches"] for h in many]
    for a, b in zip(one, many):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.stack_dependent
def test_runs_are_deterministic():
    cfg = ["trainer.max_steps=2"]
    a = train(typed_config(cfg))["history"]
    b = train(typed_config(cfg))["history"]
    assert [h["lm_loss"] for h in a] == [h["lm_loss"] for h in b]


def _trainer(cfg, layout):
    import torch

    from recipe.data.corpus import load_corpus
    from recipe.training.trainer import Trainer

    return Trainer(cfg, layout, torch.device("cpu"), load_corpus(cfg.data))


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("step_time_s", "tokens_per_s")}


@pytest.mark.stack_dependent
def test_a_trainer_resumed_from_its_state_dict_continues_bit_for_bit():
    """Two steps, state_dict, two more; a fresh trainer loads that state and takes the same two
    steps: the same records bit for bit, the same as four steps in one go, and the same state
    after them. The state is what a checkpoint writes (tensors and manifest), a copy that the
    later steps leave as it was. Restoring the weights alone (no optimizer moments, no data
    position) must NOT reproduce them, or the check would prove nothing."""
    import torch

    from recipe.checkpoint import load_full_state

    cfg = typed_config(["trainer.max_steps=4", "mtp=on"])
    with lone_world() as layout:
        whole = _trainer(cfg, layout)
        straight = [_comparable(whole.train_step().to_record()) for _ in range(4)]

        first = _trainer(cfg, layout)
        head = [_comparable(first.train_step().to_record()) for _ in range(2)]
        state = first.state_dict()
        assert state["manifest"]["step"] == 2 and state["manifest"]["run_id"] == first.run_id
        tail = [_comparable(first.train_step().to_record()) for _ in range(2)]
        assert head + tail == straight

        resumed = _trainer(cfg, layout)
        resumed.load_state_dict(state)
        assert resumed.run_id == first.run_id
        assert [_comparable(resumed.train_step().to_record()) for _ in range(2)] == tail
        assert resumed.step == 4 and resumed.steps.state_dict() == whole.steps.state_dict()
        now, expected = resumed.state_dict()["tensors"], first.state_dict()["tensors"]
        assert now.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(now[k], expected[k])] == []

        weights_only = _trainer(cfg, layout)
        load_full_state(state["tensors"], weights_only.model, 0, 1)  # moments left unused
        weights_only.step = 2
        wrong = [_comparable(weights_only.train_step().to_record()) for _ in range(2)]
        assert [r["lm_loss"] for r in wrong] != [r["lm_loss"] for r in tail]


def test_step_metrics_record_is_the_metrics_file_contract():
    from recipe.training.metrics import StepMetrics

    base = dict(step=3, lm_loss=2.0, loss=2.1, grad_norm=0.5, lr=1e-3, tokens=100)
    base.update(padded_tokens=104, micro_batches=2, step_time_s=0.1, tokens_per_s=1000.0)
    plain = StepMetrics(mtp_layer_losses=(), **base).to_record()
    assert tuple(plain) == REQUIRED
    one = StepMetrics(mtp_layer_losses=(1.5,), eval_lm_loss=2.5, **base).to_record()
    assert (one["mtp_loss"], one["eval_lm_loss"]) == (1.5, 2.5) and "mtp_loss_1" not in one
    two = StepMetrics(mtp_layer_losses=(1.0, None), **base).to_record()
    assert (two["mtp_loss"], two["mtp_loss_1"], two["mtp_loss_2"]) == (1.0, 1.0, None)


@pytest.mark.stack_dependent
def test_bf16_autocast_trains_with_fp32_master_weights_close_to_fp32():
    """trainer.precision=bf16 runs the forward in bf16 (so its losses are NOT bit-identical to
    fp32: otherwise autocast would be silently off) within 2e-2 of fp32, and keeps fp32
    parameters and optimizer state."""
    import torch

    fp32_cfg = typed_config(["trainer.max_steps=3", "trainer.precision=fp32"])
    bf16_cfg = typed_config(["trainer.max_steps=3", "trainer.precision=bf16"])
    with lone_world() as layout:
        reference = _trainer(fp32_cfg, layout)
        fp32 = [reference.train_step().lm_loss for _ in range(3)]
        mixed = _trainer(bf16_cfg, layout)
        assert mixed.precision == "bf16"
        bf16 = [mixed.train_step().lm_loss for _ in range(3)]
        assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
        moments = [s["exp_avg"] for s in mixed.engine.optimizer_state().values()]
        assert moments and all(m.dtype == torch.float32 for m in moments)
    assert bf16 != fp32
    for a, b in zip(fp32, bf16):
        assert b == pytest.approx(a, rel=2e-2)


@pytest.mark.parametrize(
    "backend,precision,cuda,fragment",
    [
        ("te", "bf16", False, "model.attention_backend=te needs CUDA"),
        ("te", "fp32", True, "use trainer.precision=bf16"),
    ],
)
def test_te_choices_that_cannot_run_are_refused(backend, precision, cuda, fragment):
    from recipe.errors import ConfigError
    from recipe.model.numerics import check_backend_and_precision

    with pytest.raises(ConfigError, match=fragment):
        check_backend_and_precision(backend, precision, cuda)
    check_backend_and_precision("te", "bf16", cuda=True)
    check_backend_and_precision("torch", "fp32", cuda=cuda)
