"""Tensor parallelism (and sequence parallelism) on real spawned gloo ranks trains the tp=1 model.

megatron-core's column/row-parallel linears, vocab-parallel embedding and cross entropy run on
gloo (in the session's launched worlds, tests/helpers/world.py); the recipe adds what its own
loop owns: the tensor-parallel gradient norm, the sum over tp ranks of the gradients of
sequence-parallel norms, and one vocabulary padding for every tp. Each case compares per-step
lm_loss, mtp_loss and grad_norm with an in-process tp=cp=1 run (the cp=1 reference of
test_mtp.py's two-layer MTP config, trained once per session); the negative control (verl's
pre-fix positions at tp=2 x cp=2) must miss the tolerance by far.
"""

from __future__ import annotations

import pytest
import torch

from recipe.config import ConfigError
from tests.helpers.config import SHORT_SEQUENCES, typed_config

RTOL = 1e-5
STEPS = 3
# Two MTP layers: the MTP block's projections are tensor-parallel too.
COMMON = [f"trainer.max_steps={STEPS}", *SHORT_SEQUENCES, "mtp=on", "mtp.num_layers=2"]
METRICS = ("lm_loss", "mtp_loss", "grad_norm")


def _worst(shared_runs, pe: str, layout: list[str]) -> dict[str, float]:
    """Against the tp=cp=1 run of the same config (shared with test_mtp.py's cp=1 reference)."""
    reference = shared_runs.history([*COMMON, f"model.position_embedding_type={pe}"])
    history = shared_runs.history([*COMMON, f"model.position_embedding_type={pe}", *layout])
    assert [h["tokens"] for h in history] == [h["tokens"] for h in reference]
    return {
        key: max(abs(b[key] - a[key]) / abs(a[key]) for a, b in zip(reference, history))
        for key in METRICS
    }


TP2 = ["parallel.tp=2"]
TP2_CP2 = ["parallel.tp=2", "cp=2"]
TP2_CP2_SP = ["parallel.tp=2", "cp=2", "parallel.sequence_parallel=true"]


@pytest.mark.stack_dependent
@pytest.mark.distributed
# tp2: megatron's parallel linears, vocab-parallel embedding and cross entropy; tp2xcp2: the
# 2*cp*tp alignment and CP attention over tp-sharded heads; -sp: sequence-parallel norms and their
# gradient sum. Both position types: rope's THD path and learned positions' embedding differ.
@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("layout", [TP2, TP2_CP2, TP2_CP2_SP], ids=["tp2", "tp2xcp2", "tp2xcp2-sp"])
def test_tensor_parallel_matches_tp1(shared_runs, pe, layout):
    worst = _worst(shared_runs, pe, layout)
    assert all(v <= RTOL for v in worst.values()), worst


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_negative_control_verl_legacy_fails_at_tp2_cp2(shared_runs):
    worst = _worst(shared_runs, "learned_absolute", [*TP2_CP2, "cp.preprocess=verl_legacy"])
    assert worst["lm_loss"] > 10 * RTOL, worst


def _sequence_parallel_facts(cfg) -> dict:
    """On every rank: how many tokens a norm sees under sequence parallelism, and whether the
    norms' gradients agree across tp ranks after the trainer's step (they must: each tp rank
    holds the same parameters)."""
    from tests.helpers.training import rank_trainer

    with rank_trainer(cfg, seed=0) as trainer:
        return _facts_of_one_step(trainer)


def _facts_of_one_step(trainer) -> dict:
    import torch.distributed as dist

    from recipe.parallel import collectives

    seen = []
    norm = trainer.model.decoder.layers[0].input_layernorm
    hook = norm.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    work = trainer._plan(next(trainer.steps))
    trainer.model.zero_grad(set_to_none=True)
    trainer.forward_backward_step(work)
    hook.remove()
    params = list(trainer.model.parameters())
    collectives.all_reduce_gradients(params, trainer.grad_group)
    collectives.all_reduce_sequence_parallel_gradients(params, trainer.tp_group)
    grad = norm.weight.grad.clone()
    other = grad.clone()
    dist.broadcast(other, src=dist.get_global_rank(trainer.tp_group, 0), group=trainer.tp_group)
    local_tokens = [b.input_ids.numel() for b in work.micro_batches]
    return {
        "norm_tokens": seen,
        "local_tokens": local_tokens,
        "marked": bool(getattr(norm.weight, "sequence_parallel", False)),
        "tp_ranks_agree": bool(torch.equal(grad, other)),
    }


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_sequence_parallel_splits_tokens_and_sums_norm_gradients(worlds):
    cfg = typed_config(COMMON + ["parallel.tp=2", "parallel.sequence_parallel=true"])
    facts = worlds.run(cfg.world_size, _sequence_parallel_facts, cfg)
    assert facts["marked"]
    assert facts["norm_tokens"] == [n // 2 for n in facts["local_tokens"]]
    assert facts["tp_ranks_agree"]


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (
            ["parallel.tp=2", "model.num_attention_heads=3", "model.hidden_size=48"],
            "num_attention_heads=3",
        ),
        (["parallel.tp=4", "model.num_query_groups=2"], "model.num_query_groups=2"),
        (["parallel.tp=2", "model.ffn_hidden_size=63"], "model.ffn_hidden_size=63"),
        (
            ["parallel.tp=2", "model.make_vocab_size_divisible_by=3"],
            "make_vocab_size_divisible_by=3",
        ),
        (["parallel.tp=3"], "parallel.tp=3 is not supported"),
        (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
        (
            ["trainer.engine=reference", "parallel.pp=2", "model.num_layers=2"],
            "parallel.pp=2: pipeline parallelism runs on megatron-core",
        ),
        (["parallel.pp=2"], "parallel.pp=2 splits model.num_layers=1 into equal stages"),
    ],
)
def test_impossible_tensor_parallel_layouts_fail_at_start(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        typed_config(overrides)


def test_vocabulary_is_padded_the_same_at_every_tp():
    from recipe.model.gpt import padded_vocab_size

    assert padded_vocab_size(259, 128) == 384
    assert padded_vocab_size(256, 128) == 256
    assert padded_vocab_size(259, 1) == 259
