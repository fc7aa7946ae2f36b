"""Multi-token prediction: exact loss accounting, no cross-sequence targets, parity under CP."""

from __future__ import annotations

import pytest
import torch

from recipe.config import ConfigError
from recipe.data.packing import pack_sequences
from recipe.launch.local import launch_world
from recipe.model.mtp import global_mtp_token_counts, mtp_label_masks
from recipe.training.trainer import train
from tests.helpers.config import SHORT_SEQUENCES, typed_config
from tests.helpers.world import lone_world

RTOL = 1e-5
STEPS = 3
COMMON = [f"trainer.max_steps={STEPS}", *SHORT_SEQUENCES]


def test_mtp_masks_stop_before_the_sequence_ends():
    batch = pack_sequences([[1] * 5, [2] * 1, [3] * 3], alignment=4, pad_id=0)
    lengths = torch.repeat_interleave(batch.cu_seqlens.diff(), batch.cu_seqlens_padded.diff())
    masks = mtp_label_masks(batch.position_ids, lengths, num_layers=2)
    # Sequence 1 (length 5, slots 0-7): layer 0 predicts t+2 for t = 0..2, layer 1 t+3 for t = 0..1.
    assert masks[0, :8].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert masks[1, :8].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert masks[:, 8:12].sum() == 0  # a one-token sequence predicts nothing
    assert masks[0, 12:16].tolist() == [1, 0, 0, 0]
    assert masks.sum(1).tolist() == global_mtp_token_counts([5, 1, 3], 2)


@pytest.fixture(scope="module")
def mtp_reference():
    cfg = typed_config(COMMON + ["mtp=on"])
    return train(cfg)["history"]


def test_mtp_metrics_and_objective(mtp_reference):
    for h in mtp_reference:
        assert h["mtp_loss"] > 0
        assert h["loss"] == pytest.approx(h["lm_loss"] + 0.1 * h["mtp_loss"], rel=1e-9)


def test_mtp_off_builds_no_mtp_and_logs_no_mtp_loss():
    from recipe.training.trainer import build_model

    cfg = typed_config(COMMON)
    with lone_world():
        model = build_model(cfg, 259)
    assert not any("mtp" in name for name, _ in model.named_parameters())
    history = train(cfg)["history"]
    assert all("mtp_loss" not in h for h in history)
    assert all(h["loss"] == h["lm_loss"] for h in history)


def _mtp_grad_total(scale: float) -> float:
    from recipe.model.mtp import set_mtp_backward_scale
    from recipe.training.step import forward_step, loss_func, plan_step
    from recipe.training.trainer import build_model

    with lone_world() as layout:
        cfg = typed_config(COMMON + ["mtp=on", f"mtp.loss_scaling_factor={scale}"])
        model = build_model(cfg, 259)
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (30, 17, 45)]
        work = plan_step(seqs, cfg, layout, pad_id=258, device=torch.device("cpu"))
        set_mtp_backward_scale(1.0 / work.global_mtp_tokens[0])
        for batch in work.micro_batches:
            lm_sum, _, _ = loss_func(batch, forward_step(batch, model, cfg.passes_position_ids))
            lm_sum.backward()
        mtp_grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.")]
        assert mtp_grads, "the model has an MTP block"
        return sum(float(g.abs().sum()) for g in mtp_grads if g is not None)


def test_mtp_loss_reaches_the_backward_pass():
    assert _mtp_grad_total(0.1) > 0
    assert _mtp_grad_total(0.0) == 0


def test_mtp_loss_equals_the_mean_over_sequences_run_alone():
    """Packing several sequences must give the same MTP loss as each alone: so the MTP roll never
    predicts across a boundary. Sequence B starts with a token that would be very costly to
    predict from A's tail, so a leak would move the result far beyond the tolerance."""
    from recipe.training.step import forward_step, loss_func, plan_step
    from recipe.training.trainer import build_model

    with lone_world() as layout:
        cfg = typed_config(COMMON + ["mtp=on", "model.position_embedding_type=learned_absolute"])
        model = build_model(cfg, 259)
        model.train()
        seqs = [[97] * 20, [255, 1, 2, 3, 4, 5, 6, 7, 8, 9], [98, 99] * 12]

        def mtp_sum(sequences):
            work = plan_step(sequences, cfg, layout, pad_id=258, device=torch.device("cpu"))
            with torch.no_grad():
                return sum(
                    float(
                        loss_func(b, forward_step(b, model, cfg.passes_position_ids))[2]["mtp_1"][0]
                    )
                    for b in work.micro_batches
                )

        together = mtp_sum(seqs)
        alone = sum(mtp_sum([s]) for s in seqs)
        assert together == pytest.approx(alone, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("cp", [2, 4])
def test_mtp_under_cp_matches_cp1(pe, cp):
    reference = train(typed_config(COMMON + ["mtp=on", f"model.position_embedding_type={pe}"]))
    cfg = typed_config(COMMON + ["mtp=on", f"cp={cp}", f"model.position_embedding_type={pe}"])
    history = launch_world(cfg)["history"]
    for a, b in zip(reference["history"], history):
        for key in ("lm_loss", "mtp_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=RTOL), key


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["mtp=on", "model.pass_position_ids=never"], "mtp=on needs position_ids"),
        (
            ["model.position_embedding_type=learned_absolute", "model.pass_position_ids=mtp_only"],
            "learned_absolute needs position_ids",
        ),
        (["mtp=on", "mtp.num_layers=0"], "mtp.num_layers"),
        (["model.pass_position_ids=sometimes"], "model.pass_position_ids"),
    ],
)
def test_impossible_mtp_and_position_combinations_fail_at_start(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        typed_config(overrides)


@pytest.mark.parametrize(
    "policy,mtp,pe,expected",
    [
        ("auto", False, "rope", False),
        ("auto", True, "rope", True),
        ("auto", False, "learned_absolute", True),
        ("mtp_only", True, "rope", True),
        ("mtp_only", False, "rope", False),
        ("not_vision", False, "rope", True),
        ("always", False, "rope", True),
        ("never", False, "rope", False),
    ],
)
def test_position_ids_policy(policy, mtp, pe, expected):
    overrides = [f"model.pass_position_ids={policy}", f"model.position_embedding_type={pe}"]
    cfg = typed_config(overrides + (["mtp=on"] if mtp else []))
    assert cfg.passes_position_ids is expected


def _mtp_against_gathered_logits(cfg):
    """On every rank: the recipe's MTP loss sum, and a reference computed by hand from the MTP
    head's logits gathered back into full sequences (target of position p: token p+2)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from recipe.model.cpu_compat import apply_cpu_compat, seed_model_parallel_rng
    from recipe.parallel import groups
    from recipe.parallel.cp.zigzag import unshard
    from recipe.training.step import forward_step, loss_func, plan_step
    from recipe.training.trainer import build_model

    apply_cpu_compat()
    layout = groups.init_distributed(cfg.parallel_dims)
    try:
        seed_model_parallel_rng(0)
        model = build_model(cfg, 259)
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (37, 5, 64, 2, 23)]
        work = plan_step(seqs, cfg, layout, pad_id=258, device=torch.device("cpu"))
        (batch,) = work.micro_batches
        logits = []
        # Clone: megatron's cross entropy works on the logits in place.
        hook = model.output_layer.register_forward_hook(
            lambda m, i, o: logits.append(o[0].detach().clone())
        )
        with torch.no_grad():
            _, _, report = loss_func(batch, forward_step(batch, model, cfg.passes_position_ids))
        mtp_sums = report["mtp_1"][:1].clone()
        hook.remove()
        mtp_logits = logits[0][:, 0]  # the MTP head runs before the main head: [t_local, vocab]
        cp, group = layout.cp_size, groups.cp_group()
        if cp > 1:
            parts = [torch.empty_like(mtp_logits) for _ in range(cp)]
            dist.all_gather(parts, mtp_logits.contiguous(), group=group)
            mtp_logits = unshard(parts, batch.cu_seqlens_padded, cp)
            dist.all_reduce(mtp_sums, group=group)
        reference = 0.0
        for seq, start in zip(seqs, batch.cu_seqlens_padded.tolist()):
            for p in range(len(seq) - 2):
                target = torch.tensor([seq[p + 2]])
                reference += float(F.cross_entropy(mtp_logits[start + p][None], target))
        return {"recipe": float(mtp_sums[0]), "reference": reference}
    finally:
        groups.shutdown_distributed()


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [1, 2])
def test_mtp_loss_equals_a_reference_on_the_gathered_full_sequences(cp):
    cfg = typed_config(
        [*COMMON, "mtp=on", f"cp={cp}", "model.position_embedding_type=learned_absolute"]
    )
    result = launch_world(cfg, entrypoint=_mtp_against_gathered_logits)
    assert result["reference"] > 0
    assert result["recipe"] == pytest.approx(result["reference"], rel=1e-5)
