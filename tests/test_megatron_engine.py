"""trainer.engine=megatron: megatron-core's DDP, optimizer, scheduler, schedules (1F1B at pp > 1)
and finalize_model_grads train the recipe's model to the recipe's own numbers, at every layout
where megatron is exact; where megatron's own normalisation makes the model depend on the layout,
the comparison fails, and the recipe's option that restores the exact result passes it."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.errors import ConfigError
from tests.helpers.config import typed_config
from tests.helpers.training import without_timings

pytestmark = pytest.mark.stack_dependent

MEGATRON = ["trainer.engine=megatron"]  # the default, named: these tests are about it
REFERENCE = ["trainer.engine=reference"]
# Two layers (two stages at pp=2), two MTP layers on the last stage, learned positions (which the
# MTP block embeds again on the last stage), a short warmup so the cosine decay is reached.
PIPELINE_MODEL = [
    "model.num_layers=2",
    "mtp=on",
    "mtp.num_layers=2",
    "model.position_embedding_type=learned_absolute",
    "optim.warmup_steps=2",
    "trainer.max_steps=4",
]
RTOL = 1e-5  # compare.rtol's default
# Weights move up to ~2e-2 in 4 steps; Adam divides by sqrt(v), so on an element whose gradient is
# near 0 a rounding difference of the gradient moves the update by up to ~1e-6 (measured: 3.1e-6
# at most, engine against engine at cp=1; a 2x-weighted rank moves them by ~1e-3).
WEIGHT_ATOL = 1e-5


def _steps_and_weights(cfg, patch=None) -> dict:
    """Train cfg.trainer.max_steps steps on this rank; rank 0 returns the records and every
    parameter of the whole model by its whole-model name (stages and ranks gathered).
    `patch(trainer)` changes the trainer before it trains (a negative control) and returns
    what undoes the change."""
    from recipe.checkpoint import full_state
    from recipe.parallel import collectives, groups
    from tests.helpers.training import rank_trainer, train_records

    with rank_trainer(cfg) as trainer:
        undo = patch(trainer) if patch is not None else None
        try:
            records = train_records(trainer, cfg.trainer.max_steps)
        finally:
            if undo is not None:
                undo()  # the rank's process runs the session's later jobs too
        # what a checkpoint holds: tp shards joined, stage parameters under whole-model names
        tensors = full_state(trainer.model, {}, groups.tp_group(), trainer.whole_names)
        mine = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        parts = collectives.gather_to_main(mine)
    if parts is None:
        return {}
    weights = {}
    for part in parts:
        weights.update(part)
    return {"records": records, "weights": weights}


def _run(worlds, overrides: list[str], patch=None, run_dir=None) -> dict:
    cfg = typed_config(overrides, output_dir=run_dir)
    result = worlds.run(cfg.world_size, _steps_and_weights, cfg, patch)
    if run_dir is not None:
        from recipe.rundir.tokens import read_token_records

        result["tokens"] = read_token_records(run_dir)
    return result


RECORDED = "trainer.record_tokens=[2]"


def _assert_same_token_losses(result: dict, reference: dict) -> None:
    """Step 2's per-token records (every predicted token's loss and MTP losses, in global
    order) of two runs agree within the parity tolerance."""
    import numpy as np

    got, want = result["tokens"][2], reference["tokens"][2]
    assert len(want["lm_loss"]) > 100
    for column in ("sample", "position"):
        assert np.array_equal(got[column], want[column]), column
    for column in [c for c in want if c == "lm_loss" or c.startswith("mtp_loss_")]:
        assert np.allclose(got[column], want[column], rtol=RTOL, atol=0, equal_nan=True), column


def _assert_same_training(result: dict, reference: dict, rtol: float = RTOL) -> None:
    """Per step lm_loss, mtp_loss, grad_norm and eval within rtol; every weight at the end."""
    for got, want in zip(result["records"], reference["records"], strict=True):
        for key in ("lm_loss", "mtp_loss", "grad_norm", "eval_lm_loss", "lr"):
            if want.get(key) is not None:
                assert got[key] == pytest.approx(want[key], rel=rtol, abs=0), (key, got, want)
    assert result["weights"].keys() == reference["weights"].keys()
    for name, want in reference["weights"].items():
        got = result["weights"][name]
        assert torch.allclose(got, want, rtol=0, atol=WEIGHT_ATOL), (
            f"{name}: largest difference {float((got - want).abs().max()):.3g}"
        )


# --- megatron's scheduler gives the recipe's learning rates ------------------------------------


@settings(max_examples=40, deadline=None)
@given(warmup=st.integers(0, 12), total=st.integers(1, 30))
def test_megatron_scheduler_gives_the_recipes_learning_rate_at_every_step(warmup, total):
    from recipe.config import OptimConfig, TrainConfig, TrainerConfig
    from recipe.training.engines.megatron_core import build_scheduler, scheduler_steps
    from recipe.training.optimizer import lr_at

    cfg = TrainConfig(
        optim=OptimConfig(warmup_steps=warmup), trainer=TrainerConfig(max_steps=total)
    )
    optimizer = types.SimpleNamespace(param_groups=[{"wd_mult": 1.0}, {"wd_mult": 0.0}])
    scheduler = build_scheduler(optimizer, cfg)
    for step in range(1, total + 1):
        scheduler.step(increment=scheduler_steps(step, warmup) - scheduler.num_steps)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(step - 1, cfg), rel=1e-12)
        assert optimizer.param_groups[0]["weight_decay"] == cfg.optim.weight_decay
        assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_megatrons_own_warmup_would_start_at_zero():
    """Why `scheduler_steps` exists: megatron's scheduler at its own first position gives lr 0,
    the recipe's first step lr / warmup."""
    from recipe.training.engines.megatron_core import build_scheduler

    cfg = typed_config(["optim.warmup_steps=4"])
    optimizer = types.SimpleNamespace(param_groups=[{}])
    build_scheduler(optimizer, cfg)
    assert optimizer.param_groups[0]["lr"] == 0.0


# --- the engines against each other -------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_pp1(worlds, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    return _run(worlds, [*PIPELINE_MODEL, *REFERENCE, RECORDED], run_dir=run_dir)


@pytest.fixture(scope="module")
def megatron_pp1(worlds, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("megatron")
    return _run(worlds, [*PIPELINE_MODEL, *MEGATRON, RECORDED], run_dir=run_dir)


def test_megatron_engine_equals_the_reference_engine_at_cp1(reference_pp1, megatron_pp1):
    """Measured (0.19.2, 4 steps, exact MTP scaling on both engines): lm_loss equal to the last
    digit, mtp_loss within 2.1e-8, grad_norm within 7.3e-8, weights within 5e-7 but three
    elements (3.1e-6 at most, Adam on near-zero gradients)."""
    _assert_same_training(megatron_pp1, reference_pp1)
    _assert_same_token_losses(megatron_pp1, reference_pp1)


@pytest.mark.distributed
def test_megatron_engine_at_dp2_equals_the_reference_engine(worlds, reference_pp1):
    _assert_same_training(
        _run(worlds, [*PIPELINE_MODEL, *MEGATRON, "parallel.dp=2"]), reference_pp1
    )


def _weigh_rank0_twice(trainer):
    """A rank-dependent normalisation bug (Megatron-LM #7452's kind): rank 0's tokens weigh twice
    in the gradient, while the reported loss stays honest."""
    from recipe.training import micro_batch

    original = micro_batch.MicroBatchPass.loss

    def doubled(self, index, captured, output):
        loss_sum, num_tokens, report = original(self, index, captured, output)
        return loss_sum * 2, num_tokens, report

    def undo():
        micro_batch.MicroBatchPass.loss = original

    if trainer.layout.rank == 0:
        micro_batch.MicroBatchPass.loss = doubled
    return undo


@pytest.mark.distributed
def test_negative_control_a_rank_weighted_loss_fails_the_engine_comparison(worlds, reference_pp1):
    result = _run(worlds, [*PIPELINE_MODEL, *MEGATRON, "parallel.dp=2"], _weigh_rank0_twice)
    with pytest.raises(AssertionError):
        _assert_same_training(result, reference_pp1)


@pytest.mark.distributed
def test_pp2_cp2_dp2_with_the_distributed_optimizer_equals_pp_cp_dp_1(
    worlds, megatron_pp1, tmp_path
):
    """Eight ranks: two pipeline stages (1F1B, variable THD lengths, MTP and the embedding copies
    on the last stage), zigzag CP, and megatron's distributed optimizer over dp; the per-token
    records come from the last stage's ranks."""
    result = _run(
        worlds,
        [
            RECORDED,
            *PIPELINE_MODEL,
            *MEGATRON,
            "parallel.pp=2",
            "cp=2",
            "parallel.dp=2",
            "trainer.megatron.use_distributed_optimizer=true",
            "trainer.megatron.overlap_grad_reduce=true",
        ],
        run_dir=tmp_path,
    )
    _assert_same_training(result, megatron_pp1)
    _assert_same_token_losses(result, megatron_pp1)


@pytest.mark.distributed
def test_pp2_with_tied_embeddings_equals_pp1(worlds):
    tied = [*PIPELINE_MODEL, *MEGATRON, "model.tie_embeddings=true", "mtp=off"]
    _assert_same_training(_run(worlds, [*tied, "parallel.pp=2"]), _run(worlds, tied))


@pytest.mark.distributed
def test_pp4_equals_pp1(worlds):
    """Four stages of one layer each: the two middle stages hold neither embedding nor loss."""
    four = [*PIPELINE_MODEL, *MEGATRON, "model.num_layers=4", "trainer.max_steps=3"]
    _assert_same_training(_run(worlds, [*four, "parallel.pp=4"]), _run(worlds, four))


@pytest.mark.distributed
def test_tp2_x_pp2_equals_pp1(worlds, megatron_pp1):
    """Four ranks: tensor-parallel stages (vocab-parallel embedding and loss on both ends)."""
    result = _run(worlds, [*PIPELINE_MODEL, *MEGATRON, "parallel.pp=2", "parallel.tp=2"])
    _assert_same_training(result, megatron_pp1)


@pytest.mark.distributed
def test_a_trace_on_megatrons_engine_matches_the_reference_engines(shared_runs):
    """Activation traces and the summed gradients (megatron keeps them in main_grad: its
    optimizer hands them to .grad before the trace reads them) of megatron's engine at dp=2
    line up with the reference engine's at dp=1: no module diverges."""
    from recipe.compare.diverge import compare_traces, first_divergence
    from recipe.rundir.traces import read_trace

    traced = [*PIPELINE_MODEL, "trainer.trace_steps=[2]"]
    _, reference = read_trace(shared_runs.run_dir([*traced, *REFERENCE]), 2)
    _, megatron = read_trace(shared_runs.run_dir([*traced, *MEGATRON, "parallel.dp=2"]), 2)
    diffs = compare_traces(megatron, reference, rtol=RTOL)
    gradients = [d for d in diffs if d.kind == "gradient"]
    assert reference["grads"] and len(gradients) == len(reference["grads"])
    assert first_divergence(diffs, RTOL, "activation") is None
    assert first_divergence(diffs, RTOL, "gradient") is None


# --- what megatron's own normalisation does ----------------------------------------------------


@pytest.mark.distributed
def test_finding_released_megatron_trains_the_mtp_position_embedding_apart_at_pp2(
    worlds, megatron_pp1
):
    """megatron as released (sync_mtp_position_embeddings=false): the last stage's copy of the
    position embedding, which only its MTP block uses, is never summed with the first stage's
    (parallel_state.default_position_embedding_ranks holds the first stage only), so pp=2 trains
    another model than pp=1. The recipe's sum (the default) passes the same comparison above."""
    released = _run(
        worlds,
        [
            *PIPELINE_MODEL,
            *MEGATRON,
            "parallel.pp=2",
            "trainer.megatron.sync_mtp_position_embeddings=false",
        ],
    )
    with pytest.raises(AssertionError, match="position_embeddings|grad_norm|lm_loss|mtp_loss"):
        _assert_same_training(released, megatron_pp1)
    synced = _run(worlds, [*PIPELINE_MODEL, *MEGATRON, "parallel.pp=2"])
    _assert_same_training(synced, megatron_pp1)


@pytest.mark.distributed
def test_finding_per_micro_batch_mean_loss_depends_on_the_cp_layout(worlds):
    """calculate_per_token_loss=false: megatron divides each CP rank's loss by that rank's own
    token count (schedules.py forward_step_calc_loss) and DDP averages over dp x cp, so the
    tokens of the rank with fewer of them weigh more: cp=2 trains another model than cp=1. With
    per-token losses (true, the default) cp=2 equals cp=1."""
    mean = [*PIPELINE_MODEL, *MEGATRON, "trainer.megatron.calculate_per_token_loss=false"]
    with pytest.raises(AssertionError):
        _assert_same_training(_run(worlds, [*mean, "cp=2"]), _run(worlds, mean))
    per_token = [*PIPELINE_MODEL, *MEGATRON]
    _assert_same_training(_run(worlds, [*per_token, "cp=2"]), _run(worlds, per_token))


# --- start-up errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([*REFERENCE, "parallel.pp=2", "model.num_layers=2"], "the default is megatron"),
        ([*MEGATRON, "parallel.pp=2", "model.num_layers=3"], "multiple of 2"),
        (
            [*MEGATRON, "trainer.megatron.average_in_collective=true"],
            "average_in_collective=true averages",
        ),
        (
            [*MEGATRON, "parallel.pp=2", "model.num_layers=2", "trainer.trace_steps=[1]"],
            "trace_steps needs parallel.pp=1",
        ),
        (
            [
                *MEGATRON,
                "trainer.megatron.use_distributed_optimizer=true",
                "trainer.trace_steps=[1]",
            ],
            "use_distributed_optimizer=false",
        ),
        (["trainer.engine=deepspeed"], "trainer.engine"),
        (["trainer.engine=recipe"], "now named trainer.engine=reference"),
    ],
)
def test_unsupported_engine_settings_are_start_up_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        typed_config(overrides)


# --- checkpoints --------------------------------------------------------------------------------

CHECKPOINTED = [*PIPELINE_MODEL, *MEGATRON, "trainer.checkpoint_every=2", "trainer.eval_every=2"]


def _curve(run_dir) -> list[dict]:
    from recipe.rundir.metrics import read_metrics

    return without_timings(read_metrics(run_dir))


def _step2(run_dir) -> str:
    return f"trainer.resume={run_dir / 'checkpoints' / 'step_00000002'}"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.pp=2"],
        ["parallel.dp=2", "trainer.megatron.use_distributed_optimizer=true"],
    ],
    ids=["pp2", "dp2-distributed-optimizer"],
)
def test_a_resumed_megatron_run_continues_bit_for_bit(shared_runs, layout):
    """Weights and the optimizer state (the distributed optimizer's shards joined over dp, each
    stage's parameters under their whole-model names) written at step 2 and read back: steps 3
    and 4 are the uninterrupted run's to the last bit."""
    whole = shared_runs.run_dir([*CHECKPOINTED, *layout])
    resumed = shared_runs.run_dir([*CHECKPOINTED, *layout, _step2(whole)])
    assert len(_curve(whole)) == 4
    assert _curve(resumed) == _curve(whole)


@pytest.mark.distributed
def test_a_pp2_distributed_optimizer_checkpoint_resumes_at_pp1_and_on_the_reference_engine(
    shared_runs,
):
    """Checkpoints do not depend on the layout or the engine that wrote them: a pp=2, dp=2 run
    with the distributed optimizer resumes at pp=dp=1 with the plain optimizer, and on the
    reference engine, within the parity tolerance of the uninterrupted pp=1 run."""
    from recipe.compare.diff import compare
    from recipe.compare.runs import load_run

    written = [
        "parallel.pp=2",
        "parallel.dp=2",
        "trainer.megatron.use_distributed_optimizer=true",
    ]
    source = shared_runs.run_dir([*CHECKPOINTED, *written])
    reference = shared_runs.run_dir(CHECKPOINTED)
    for engine in ("megatron", "reference"):
        resumed = shared_runs.run_dir([*CHECKPOINTED, f"trainer.engine={engine}", _step2(source)])
        result = compare(load_run(resumed), load_run(reference), rtol=RTOL)
        assert result.passed, (engine, result)


def test_negative_control_a_resume_that_drops_the_optimizer_shards_is_not_bit_exact(
    shared_runs, monkeypatch, tmp_path
):
    """The distributed optimizer (at dp=1 it holds one shard of everything) resumed with its
    state left empty: the continued curve must differ, or the test above proves nothing."""
    from recipe.launch.rank import train
    from recipe.training.engines import megatron_core as megatron_engine

    layout = ["trainer.megatron.use_distributed_optimizer=true"]
    whole = shared_runs.run_dir([*CHECKPOINTED, *layout])
    assert _curve(shared_runs.run_dir([*CHECKPOINTED, *layout, _step2(whole)])) == _curve(whole)
    monkeypatch.setattr(megatron_engine, "_load_shard_state", lambda optimizer, moments: None)
    train(typed_config([*CHECKPOINTED, *layout, _step2(whole)], output_dir=tmp_path))
    broken, want = _curve(tmp_path), _curve(whole)
    assert broken[:2] == want[:2]  # the history up to the checkpoint is carried over
    assert broken[2:] != want[2:]


# --- the step guard on megatron's engine --------------------------------------------------------


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["plain", "distributed"])
def test_a_skipped_step_leaves_megatrons_weights_and_optimizer_state_untouched(
    distributed_optimizer,
):
    """trainer.on_nonfinite=skip_step: the guard judges megatron's gradient norm before the
    update, and a refused step applies nothing (megatron's optimizer.step() is split where its
    own step() splits it). The non-finite norm is injected at step 3."""
    from tests.helpers.training import rank_trainer

    cfg = typed_config(
        [
            *PIPELINE_MODEL,
            *MEGATRON,
            "trainer.on_nonfinite=skip_step",
            f"trainer.megatron.use_distributed_optimizer={str(distributed_optimizer).lower()}",
        ]
    )
    with rank_trainer(cfg) as trainer:
        for _ in range(2):
            trainer.train_step()
        measured = trainer.engine.gradient_norm
        trainer.engine.gradient_norm = lambda: float("nan")
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        state = {
            p: {k: v.clone() for k, v in s.items()}
            for p, s in trainer.engine.optimizer_state().items()
        }
        record = trainer.train_step().to_record()
        trainer.engine.gradient_norm = measured
        assert record["nonfinite"] == ["grad_norm"]  # logged as such, the step not applied
        for name, param in trainer.model.named_parameters():
            assert torch.equal(param, weights[name]), name
        after = trainer.engine.optimizer_state()
        assert state and all(
            torch.equal(value, after[p][k]) for p, s in state.items() for k, value in s.items()
        )
        record = trainer.train_step().to_record()  # the next step applies again
        assert not record.get("nonfinite")
        assert any(not torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
