"""Context parallelism on real spawned gloo ranks trains exactly the cp=1 model.

Each case trains in the session's launched world of its size (tests/helpers/world.py: real
gloo ranks, one spawn per world size for the whole session) and compares per-step lm_loss and
gradient norm with an in-process cp=1 run on the same data and weights, trained once per session
(tests/helpers/runs.py). The negative control proves the check can fail: verl's pre-PR-6267 position
formula with learned absolute positions must miss the tolerance by far.
"""

from __future__ import annotations

import pytest

from tests.helpers.config import SHORT_SEQUENCES

pytestmark = [pytest.mark.distributed, pytest.mark.stack_dependent]

RTOL = 1e-5
STEPS = 3
COMMON = [f"trainer.max_steps={STEPS}", *SHORT_SEQUENCES]


def _relative_gap(a: list[dict], b: list[dict], key: str) -> float:
    return max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b))


def _overrides(pe: str, overrides: list[str] = ()) -> list[str]:
    return [*COMMON, f"model.position_embedding_type={pe}", *overrides]


# cp2: the all-gather attention and zigzag index at two ranks; cp4: four chunks a rank pair and a
# larger alignment; dp2xcp2: the gradient sum over dp x cp and data split by dp rank only. rope
# takes its positions from cu_seqlens and the CP group, learned_absolute from position_ids (where
# a position bug shows): each layout with both, since each pair runs a different code path.
@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize(
    "layout", [["cp=2"], ["cp=4"], ["cp=2", "parallel.dp=2"]], ids=["cp2", "cp4", "dp2xcp2"]
)
def test_cp_matches_cp1(shared_runs, pe, layout):
    reference = shared_runs.history(_overrides(pe))
    history = shared_runs.history(_overrides(pe, layout))
    assert len(history) == STEPS
    assert [h["tokens"] for h in history] == [h["tokens"] for h in reference]
    assert _relative_gap(reference, history, "lm_loss") < RTOL
    assert _relative_gap(reference, history, "grad_norm") < RTOL
    assert history[-1]["eval_lm_loss"] == pytest.approx(reference[-1]["eval_lm_loss"], rel=RTOL)


def test_verl_fixed_matches_cp1_with_learned_positions(shared_runs):
    reference = shared_runs.history(_overrides("learned_absolute"))
    history = shared_runs.history(
        _overrides("learned_absolute", ["cp=2", "cp.preprocess=verl_fixed"])
    )
    assert _relative_gap(reference, history, "lm_loss") < RTOL


def test_negative_control_verl_legacy_fails_parity(shared_runs):
    reference = shared_runs.history(_overrides("learned_absolute"))
    legacy = _overrides("learned_absolute", ["cp=2", "cp.preprocess=verl_legacy"])
    gap = _relative_gap(reference, shared_runs.history(legacy), "lm_loss")
    assert gap > 100 * RTOL, f"the pre-fix formula should break parity, gap was {gap:.2e}"


@pytest.mark.parametrize(
    "engine",
    [
        [],  # megatron's: an idle rank joins finalize_model_grads without running the schedule
        [  # ... with the buckets' reductions it must issue itself, sharded over dp
            "trainer.megatron.use_distributed_optimizer=true",
            "trainer.megatron.overlap_grad_reduce=true",
        ],
        ["trainer.engine=reference"],
    ],
    ids=["megatron", "megatron-distributed-overlap", "reference"],
)
def test_data_parallel_ranks_without_sequences_keep_parity(shared_runs, engine):
    """Steps with fewer sequences than dp ranks leave a rank idle; the update must not change."""
    small_steps = [*COMMON, *engine, "batching.tokens_per_step=128", "trainer.max_steps=6"]
    reference = shared_runs.history(small_steps)
    history = shared_runs.history([*small_steps, "parallel.dp=4"])
    assert any(h["micro_batches"] < 4 for h in history), "some step must leave a rank idle"
    assert _relative_gap(reference, history, "lm_loss") < RTOL
    assert _relative_gap(reference, history, "grad_norm") < RTOL


def test_bf16_cp2_matches_cp1_within_bf16_tolerance(shared_runs):
    """Mixed precision keeps CP parity at bf16's tolerance (1e-2 relative on lm_loss per step)."""
    bf16 = [*COMMON, "trainer.precision=bf16"]
    reference = shared_runs.history(bf16)
    history = shared_runs.history([*bf16, "cp=2"])
    assert len(history) == len(reference) == STEPS
    assert _relative_gap(reference, history, "lm_loss") < 1e-2


# The released function itself (fetched from PyPI at start-up) in training, reading megatron's
# real CP rank: the last release before PR #6267 must fail as the recipe's verl_legacy does,
# the releases with the fix must match cp=1.
@pytest.mark.parametrize("version, correct", [("0.7.1", False), ("0.8.0", True), ("0.9.1", True)])
def test_released_verl_in_training(shared_runs, version, correct):
    reference = shared_runs.history(_overrides("learned_absolute"))
    released = ["cp=2", f"cp.preprocess=verl@{version}", "cp.check_steps=0"]
    gap = _relative_gap(
        reference, shared_runs.history(_overrides("learned_absolute", released)), "lm_loss"
    )
    if correct:
        assert gap < RTOL
    else:
        legacy = shared_runs.history(
            _overrides("learned_absolute", ["cp=2", "cp.preprocess=verl_legacy"])
        )
        assert gap > 100 * RTOL
        assert gap == _relative_gap(reference, legacy, "lm_loss")  # the same formula, to the bit
