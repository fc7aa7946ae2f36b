"""Context parallelism on real spawned gloo ranks trains exactly the cp=1 model.

Each case launches its own world through the recipe's launcher (the path `python train.py cp=2`
takes) and compares per-step lm_loss and gradient norm with an in-process cp=1 run on the same
data and weights. The negative control proves the check can fail: verl's pre-PR-6267 position
formula with learned absolute positions must miss the tolerance by far.
"""

from __future__ import annotations

import pytest

from recipe.launch.local import launch_world
from recipe.training.trainer import train
from tests.helpers.config import SHORT_SEQUENCES, typed_config

pytestmark = pytest.mark.distributed

RTOL = 1e-5
STEPS = 3
COMMON = [f"trainer.max_steps={STEPS}", *SHORT_SEQUENCES]

_reference_cache: dict[str, list[dict]] = {}


def _reference(pe: str) -> list[dict]:
    if pe not in _reference_cache:
        cfg = typed_config(COMMON + [f"model.position_embedding_type={pe}"])
        _reference_cache[pe] = train(cfg)["history"]
    return _reference_cache[pe]


def _relative_gap(a: list[dict], b: list[dict], key: str) -> float:
    return max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b))


def _run(pe: str, overrides: list[str]) -> list[dict]:
    cfg = typed_config(COMMON + [f"model.position_embedding_type={pe}"] + overrides)
    return launch_world(cfg)["history"]


@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize(
    "layout", [["cp=2"], ["cp=4"], ["cp=2", "parallel.dp=2"]], ids=["cp2", "cp4", "dp2xcp2"]
)
def test_cp_matches_cp1(pe, layout):
    reference = _reference(pe)
    history = _run(pe, layout)
    assert len(history) == STEPS
    assert [h["tokens"] for h in history] == [h["tokens"] for h in reference]
    assert _relative_gap(reference, history, "lm_loss") < RTOL
    assert _relative_gap(reference, history, "grad_norm") < RTOL
    assert history[-1]["eval_lm_loss"] == pytest.approx(reference[-1]["eval_lm_loss"], rel=RTOL)


def test_verl_fixed_matches_cp1_with_learned_positions():
    history = _run("learned_absolute", ["cp=2", "cp.preprocess=verl_fixed"])
    assert _relative_gap(_reference("learned_absolute"), history, "lm_loss") < RTOL


def test_negative_control_verl_legacy_fails_parity():
    history = _run("learned_absolute", ["cp=2", "cp.preprocess=verl_legacy"])
    gap = _relative_gap(_reference("learned_absolute"), history, "lm_loss")
    assert gap > 100 * RTOL, f"the pre-fix formula should break parity, gap was {gap:.2e}"


def test_data_parallel_ranks_without_sequences_keep_parity():
    """Steps with fewer sequences than dp ranks leave a rank idle; the update must not change."""
    small_steps = [*COMMON, "batching.tokens_per_step=128", "trainer.max_steps=6"]
    reference = train(typed_config(small_steps))["history"]
    history = launch_world(typed_config([*small_steps, "parallel.dp=4"]))["history"]
    assert any(h["micro_batches"] < 4 for h in history), "some step must leave a rank idle"
    assert _relative_gap(reference, history, "lm_loss") < RTOL
    assert _relative_gap(reference, history, "grad_norm") < RTOL


def test_bf16_cp2_matches_cp1_within_bf16_tolerance():
    """Mixed precision keeps CP parity at bf16's tolerance (1e-2 relative on lm_loss per step)."""
    bf16 = [*COMMON, "trainer.precision=bf16"]
    reference = train(typed_config(bf16))["history"]
    history = launch_world(typed_config([*bf16, "cp=2"]))["history"]
    assert len(history) == len(reference) == STEPS
    assert _relative_gap(reference, history, "lm_loss") < 1e-2
