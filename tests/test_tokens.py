"""Proof down to the token: per-token records at every layout agree on every token, the pre-fix
run's broken tokens are found exactly (in the chunks the bug lives in), and the first-divergence
search names the module where two runs part."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recipe.compare.__main__ import main as compare_main
from recipe.compare.tokens import compare_token_records, where
from recipe.data.packing import pack_sequences
from recipe.parallel.cp.contract import built_in, index_preprocess
from recipe.parallel.cp.zigzag import local_token_identity
from recipe.rundir.tokens import COLUMNS, read_token_records, write_token_records
from tests.helpers.config import typed_config

RECORDED = [
    "trainer.max_steps=2",
    "trainer.record_tokens=[1,2]",
    "trainer.trace_steps=[1]",
    "trainer.checkpoint_every=0",
    "model.position_embedding_type=learned_absolute",
    "mtp=on",  # the MTP block in every trace: its modules must agree too
]
ATOL = 1e-5


LAYOUTS = {
    "cp1": [],
    "cp2": ["cp=2"],
    "cp4": ["cp=4"],
    "dp2cp2": ["cp=2", "parallel.dp=2"],
    "prefix": ["cp=2", "cp.preprocess=verl_legacy"],
}


class _Runs:
    """Each layout's run with its records and traces, trained in the session's worlds the first
    time a test asks for it (the legacy stack's CI run trains only those its tests need)."""

    def __init__(self, shared_runs):
        self.shared_runs = shared_runs

    def __getitem__(self, name: str) -> Path:
        return self.shared_runs.run_dir([*RECORDED, *LAYOUTS[name]])


@pytest.fixture(scope="module")
def runs(shared_runs) -> _Runs:
    return _Runs(shared_runs)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, cp",
    [
        pytest.param("cp2", 2, marks=pytest.mark.stack_dependent),
        ("cp4", 4),  # the same megatron code paths as cp2: once, on the current stack
        ("dp2cp2", 2),
    ],
)
def test_every_layout_agrees_with_cp1_on_every_token(runs, layout, cp):
    result = compare_token_records(runs[layout], runs["cp1"], ATOL, cp)
    assert result.passed, result.problems or [(d.step, d.max_abs) for d in result.steps]
    assert [d.step for d in result.steps] == [1, 2]
    records = read_token_records(runs[layout])[1]
    assert set(records["cp_rank"].tolist()) == set(range(cp))
    assert set(records["chunk"].tolist()) == set(range(2 * cp)), "every zigzag chunk seen"
    if layout == "dp2cp2":
        assert set(records["dp_rank"].tolist()) == {0, 1}
    assert records["sample"].size == read_token_records(runs["cp1"])[1]["sample"].size


def _positions_verl_legacy_gets_wrong(length: int, cp: int) -> set[int]:
    """Real positions of one sequence whose pre-fix position_id differs from the index path's."""
    tokens = torch.arange(1, length + 1)
    cu = pack_sequences([tokens.tolist()], 2 * cp, 0).cu_seqlens_padded
    legacy = built_in("verl_legacy")
    wrong = set()
    for rank in range(cp):
        right = index_preprocess([tokens], cu, cp, rank)["position_ids"]
        got = legacy([tokens], cu, cp, rank)[1]
        _, position, _ = local_token_identity(cu, cp, rank)
        wrong |= {
            p
            for p, x, y in zip(position.tolist(), right.tolist(), got.tolist())
            if p < length and x != y
        }
    return wrong


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_the_prefix_runs_flagged_tokens_are_those_its_wrong_positions_reach(runs):
    """With learned positions a token with a wrong position_id gets a wrong position embedding
    (exactly those tokens: checked on the trace), and causal attention carries it to later
    tokens of its sequence, never to earlier ones. At step 1 (same weights) every flagged token
    lies at or after its sample's first wrong position, and nearly all such tokens are flagged
    (a few may land within 1e-5 by chance); all lie in back chunks. The MTP depth-1 loss of a
    token reads the next token's embedding, so it may also flag the token just before."""
    from recipe.rundir.traces import read_trace

    result = compare_token_records(runs["prefix"], runs["cp1"], ATOL, 2)
    step1 = result.steps[0]
    assert not result.passed and step1.flagged > 0
    assert set(step1.by_loss) == {"lm_loss", "mtp_loss_1"} and step1.by_loss["mtp_loss_1"] > ATOL
    base, prefix = read_token_records(runs["cp1"])[1], read_token_records(runs["prefix"])[1]
    flagged = np.abs(base["lm_loss"] - prefix["lm_loss"]) > ATOL
    assert (prefix["chunk"][flagged] >= 2).all(), "next-token losses off in back chunks only"
    mtp_flagged = ~(np.abs(base["mtp_loss_1"] - prefix["mtp_loss_1"]) <= ATOL)
    mtp_flagged &= ~(np.isnan(base["mtp_loss_1"]) & np.isnan(prefix["mtp_loss_1"]))
    embedded = [
        read_trace(runs[n], 1)[1]["modules"]["embedding.position_embeddings"]
        for n in ("cp1", "prefix")
    ]
    embedding_differs = (embedded[0]["values"] != embedded[1]["values"]).any(dim=1)
    reached_total = flagged_total = 0
    for sample in np.unique(base["sample"]):
        mine = base["sample"] == sample
        length = int(base["position"][mine].max()) + 2
        wrong = _positions_verl_legacy_gets_wrong(length, 2)
        rows = embedded[0]["sample"] == int(sample)
        assert set(embedded[0]["position"][rows & embedding_differs].tolist()) == wrong, (
            f"sample {sample}: the position embedding differs exactly where position_ids do"
        )
        first = min(wrong) if wrong else length
        reached = {p for p in base["position"][mine].tolist() if p >= first}
        hit = set(base["position"][mine & flagged].tolist())
        assert hit <= reached, f"sample {sample}: a token before the first wrong position"
        mtp_hit = set(base["position"][mine & mtp_flagged].tolist())
        assert all(p >= first - 1 for p in mtp_hit), f"sample {sample}: MTP reads one ahead"
        reached_total += len(reached)
        flagged_total += len(hit)
    assert reached_total > 0 and flagged_total >= 0.95 * reached_total


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_the_cli_gates_on_per_token_parity(runs, capsys):
    assert compare_main([str(runs["cp2"]), "--baseline", str(runs["cp1"]), "--per-token"]) == 0
    assert "| 1 | " in capsys.readouterr().out
    code = compare_main([str(runs["prefix"]), "--baseline", str(runs["cp1"]), "--per-token"])
    out = capsys.readouterr().out
    assert code == 1
    assert "mtp_loss_1" in out and "| 1 | 1 | front |" in out, "the table by rank and chunk"


# --- the pieces --------------------------------------------------------------------------------


def _write(run_dir: Path, step: int, losses: list[float], cp_rank=0, chunk=0) -> None:
    n = len(losses)
    rows = torch.tensor(
        [[i // 4, i % 4, loss, 0, cp_rank, chunk] for i, loss in enumerate(losses)],
        dtype=torch.float64,
    )
    assert rows.shape == (n, len(COLUMNS))
    # Given in reverse: the writer sorts into (sample, position) order.
    write_token_records(run_dir, step, [rows[n // 2 :], rows[: n // 2]])


def test_records_round_trip_in_global_order_and_differences_are_counted(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    _write(base, 1, losses)
    _write(run, 1, [*losses[:5], 6.5, 7.0, float("nan")], cp_rank=1, chunk=3)
    records = read_token_records(base)[1]
    assert records["sample"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert records["position"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    result = compare_token_records(run, base, 1e-3, cp_size=2)
    (step,) = result.steps
    assert step.flagged == 2, "one off by 0.5, one NaN"
    assert step.samples == [(1, 2, 1, 3)]
    assert where(step) == "back chunks only (rank 1 chunk 3)"
    assert not result.passed
    assert compare_token_records(base, base, 1e-3).passed


def test_missing_or_mismatched_records_fail_with_the_reason(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    _write(base, 1, [1.0] * 8)
    _write(other, 1, [1.0] * 4)
    missing = compare_token_records(tmp_path / "none", base, 1e-5)
    assert not missing.passed and "has no per-token records" in missing.problems[0]
    different = compare_token_records(other, base, 1e-5)
    assert not different.passed
    assert (
        "predicted different tokens (4 vs 8: 4 only in the baseline "
        "(the first sample 1 position 0))"
    ) in different.problems[0]
    # the same count of targets, at other positions (a loss mask moved): named, not "8 vs 8" alone
    moved = tmp_path / "moved"
    rows = torch.tensor([[i // 4, i % 4 + (i == 7), 1.0, 0, 0, 0] for i in range(8)],
                        dtype=torch.float64)  # fmt: skip
    write_token_records(moved, 1, [rows])
    (problem,) = compare_token_records(moved, base, 1e-5).problems
    assert (
        "(8 vs 8: 1 only in the run (the first sample 1 position 4); "
        "1 only in the baseline (the first sample 1 position 3))"
    ) in problem


# --- first divergence ---------------------------------------------------------------------------


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_runs_that_agree_part_nowhere(runs, capsys):
    from recipe.compare.diverge import main as diverge

    assert diverge([str(runs["cp2"]), str(runs["cp1"])]) == 0
    out = capsys.readouterr().out
    assert "no module's output differs beyond the tolerance" in out
    assert "no parameter's gradient differs" in out


@pytest.mark.distributed
def test_dp_and_cp_together_part_nowhere(runs):
    from recipe.compare.diverge import main as diverge

    assert diverge([str(runs["dp2cp2"]), str(runs["cp1"])]) == 0


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_the_prefix_run_parts_at_the_position_embedding(runs, capsys):
    from recipe.compare.diverge import main as diverge

    assert diverge([str(runs["prefix"]), str(runs["cp1"])]) == 1
    out = capsys.readouterr().out
    assert "first divergence: embedding.position_embeddings: relative" in out
    assert "| 0 | embedding.word_embeddings | 0 |" in out, "the module before it agrees exactly"


@pytest.mark.stack_dependent
def test_an_attention_mask_that_leaks_across_sequences_parts_at_core_attention(
    tmp_path, monkeypatch, capsys
):
    """A test-only fault: attention that ignores the packed sequences' boundaries (every token
    sees the earlier sequences of its micro-batch), the classic packing bug."""
    from recipe.compare.diverge import main as diverge
    from recipe.launch.rank import train
    from recipe.model import attention

    def run(run_dir):
        cfg = typed_config(
            ["trainer.max_steps=1", "trainer.trace_steps=[1]", "trainer.checkpoint_every=0"],
            output_dir=run_dir,
        )
        train(cfg)

    run(tmp_path / "right")
    correct = attention.varlen_causal_attention

    def leaky(query, key, value, cu_seqlens_padded, *args, layout=None, **kwargs):
        whole = cu_seqlens_padded[[0, -1]]  # and the layout of the real boundaries dropped
        return correct(query, key, value, whole, *args, **kwargs)

    monkeypatch.setattr(attention, "varlen_causal_attention", leaky)
    run(tmp_path / "leaky")
    assert diverge([str(tmp_path / "leaky"), str(tmp_path / "right")]) == 1
    out = capsys.readouterr().out
    assert "first divergence: decoder.layers.0.self_attention.core_attention: relative" in out
    assert "self_attention.linear_qkv | 0 |" in out, "its inputs agree exactly"


def test_a_vision_models_mtp_outputs_on_tokens_without_a_target_are_free():
    """A vision model holds its MTP block under `language_model.`: there too, an MTP layer's
    outputs on the tokens with no target at its depth (a sequence's last ones) reach no loss, so
    differing there is no divergence; a token with a target differing is (the control). Measured
    on `experiment=vision_cp mtp=on`, cp=2 against cp=1: 37 of 2029 tokens of
    `language_model.mtp.layers.0.enorm` differed (up to 4.65), every one without a target, and
    were reported as the first divergence before the depth was read under that prefix."""
    from recipe.compare.diverge import compare_traces, first_divergence

    name = "language_model.mtp.layers.0.enorm"

    def trace(values):
        module = {
            "sample": torch.zeros(3, dtype=torch.long),
            "position": torch.arange(3),
            "room": torch.tensor([2, 1, 0]),  # tokens left after each in its sequence
            "values": values,
        }
        return {"order": [name], "modules": {name: module}, "grads": {}}

    def parts(values):
        diffs = compare_traces(trace(values), trace(torch.ones(3, 4)), 1e-4)
        return first_divergence(diffs, 1e-4, "activation")

    assert parts(torch.ones(3, 4) + torch.tensor([[0.0], [1.0], [1.0]])) is None, "no target"
    found = parts(torch.ones(3, 4) + torch.tensor([[1.0], [0.0], [0.0]]))
    assert found is not None and found.name == name and found.tokens_off == 1


def test_a_missing_trace_is_a_clear_error(tmp_path, capsys):
    from recipe.compare.diverge import main as diverge

    assert diverge([str(tmp_path), str(tmp_path)]) == 2
    assert "has no trace (run it with trainer.trace_steps=[1])" in capsys.readouterr().err


def test_a_trace_at_tp2_is_refused():
    from recipe.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.trace_steps needs parallel.tp=1"):
        typed_config(["parallel.tp=2", "trainer.trace_steps=[1]"])
