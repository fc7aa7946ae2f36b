"""megatron's own engine on a CPU: every patch of recipe/model/megatron_engine_cpu.py is still
needed (and at the lines recorded for this release), and megatron's DDP + optimizer + schedule
+ finalize_model_grads train the recipe's tiny GPT to the recipe's own update on 2 gloo ranks."""

from __future__ import annotations

import functools

import pytest
import torch

from recipe.model import megatron_engine_cpu as engine
from recipe.model.compat import megatron_version

pytestmark = pytest.mark.stack_dependent

PATCH_NAMES = [p.name for p in engine.PATCHES]


def _patch(name: str) -> engine.Patch:
    return next(p for p in engine.PATCHES if p.name == name)


@pytest.mark.parametrize("name", PATCH_NAMES)
def test_each_patch_is_still_needed_at_its_recorded_lines(name):
    """Fails when megatron moves or drops a CUDA-only call: move the lines, or remove the patch
    for a release that no longer makes the call."""
    patch = _patch(name)
    version = megatron_version()
    assert version in patch.lines, f"{name}: no lines recorded for megatron-core {version}"
    expected = patch.lines[version]
    found = patch.found_lines()
    assert found == expected, (
        f"{name}: {patch.module} makes the call at {found}, recorded {expected} for {version}"
        + ("" if found else ": megatron no longer needs this patch on this release")
    )
    assert patch.still_needed() is bool(expected)


def test_the_current_stream_site_is_new_in_0_19():
    expected = {"0.16.1": False, "0.19.2": True}[megatron_version()]
    assert _patch("grad_buffer_current_stream").still_needed() is expected


def test_the_unpatched_calls_raise_without_cuda():
    """The premise of every patch: on this machine each neutralised call fails as written."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the patches are not applied")
    calls = {
        "zeros on cuda": lambda: torch.zeros([], dtype=torch.int, device="cuda"),
        "tensor on cuda": lambda: torch.tensor([1.0], device="cuda"),
        "cuda.synchronize": torch.cuda.synchronize,
        "cuda.current_stream": torch.cuda.current_stream,
        "Tensor.cuda": lambda: torch.zeros(1).cuda(),
    }
    for what, call in calls.items():
        with pytest.raises((RuntimeError, AssertionError)):
            call()
            pytest.fail(f"{what} ran without CUDA")
    assert torch.zeros(1).type() == "torch.FloatTensor"  # what the type-string checks refuse


def test_patches_apply_once_and_change_only_calls_that_would_raise():
    if torch.cuda.is_available():
        assert engine.apply_megatron_engine_cpu_compat() is False
        return
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    assert engine.apply_megatron_engine_cpu_compat() is True
    proxy = schedules.torch
    clip = optimizer.clip_grad_by_total_norm_fp32
    assert engine.apply_megatron_engine_cpu_compat() is True
    assert schedules.torch is proxy and optimizer.clip_grad_by_total_norm_fp32 is clip
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.zeros(2, device="meta").device.type == "meta"  # others untouched
    assert schedules.torch.Tensor is torch.Tensor and schedules.torch.int is torch.int
    p2p_communication.torch.cuda.synchronize()
    param_and_grad_buffer.torch.cuda.current_stream().wait_stream(torch.cpu.current_stream())
    assert clip_grads.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.zeros is not schedules.torch.zeros  # the real torch is left alone


def test_the_type_shim_lasts_only_for_the_call():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the patches are not applied")
    engine.apply_megatron_engine_cpu_compat()
    from megatron.core.optimizer import optimizer

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    optimizer.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert param.grad.tolist() == pytest.approx([0.5, 0.5, 0.5])  # 2 * 1 / (4 + 1e-6)
    assert "type" not in param.grad.__dict__
    assert param.grad.type() == "torch.FloatTensor"


# --- megatron's engine against the recipe's, on 2 gloo ranks -----------------------------------

STEPS = 2


def _megatron_forward_step(cfg, rank0_weight, data_iterator, model):
    """Megatron-LM's forward_step contract around the recipe's forward_step and loss_func."""
    from recipe.training.step import forward_step

    batch = next(data_iterator)
    output = forward_step(batch, model, cfg.passes_position_ids)
    weight = rank0_weight if torch.distributed.get_rank() == 0 else 1.0
    return output.per_token_loss, functools.partial(_megatron_loss_func, batch, weight)


def _megatron_loss_func(batch, weight, per_token_loss):
    """(loss_sum, num_tokens, {"lm loss": [sum, count]}): per-token loss, megatron divides.
    `weight` != 1 scales the loss sum the gradient comes from (not the report): the negative
    control's rank-dependent normalisation bug."""
    from recipe.training.step import LM, ForwardOutput, loss_func

    loss_sum, num_tokens, report = loss_func(batch, ForwardOutput(per_token_loss, None))
    return loss_sum * weight, num_tokens.to(torch.int), {"lm loss": report[LM]}


def _engines_on_rank(
    cfg, distributed_optimizer: bool, overlap_grad_reduce: bool, rank0_weight: float = 1.0
) -> dict:
    """The recipe's Trainer and megatron's engine, STEPS steps each from the same weights on
    the same data on this rank; rank 0's comparison."""
    import inspect

    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from recipe.data.batching import StepStream
    from recipe.data.corpus import load_corpus
    from recipe.model.cpu_compat import seed_model_parallel_rng
    from recipe.parallel import collectives, groups
    from recipe.training.optimizer import lr_at
    from recipe.training.step import plan_step
    from recipe.training.trainer import Trainer, build_model

    engine.apply_megatron_engine_cpu_compat()
    layout = groups.init_distributed(cfg.parallel_dims, timeout_s=120)
    seed_model_parallel_rng(cfg.trainer.seed)
    device = torch.device("cpu")
    corpus = load_corpus(cfg.data, cfg.image_grid)

    trainer = Trainer(cfg, layout, device, corpus)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    recipe_steps = [trainer.train_step() for _ in range(STEPS)]
    recipe_weights = dict(trainer.model.named_parameters())

    model = build_model(cfg, corpus.vocab_size, device)
    assert all(torch.equal(p, initial[n]) for n, p in model.named_parameters())
    # GPTModel's constructor ran the wrapped setup_embeddings_and_output_layer: it restored
    # Tensor.cuda (the pp > 1 branch that needs it is not reached at pp=1).
    assert torch.Tensor.cuda is not engine._stays_on_cpu
    config = model.config
    # Per-token loss is a TransformerConfig switch (the recipe sets it); DDP reads it there and
    # then sums over dp x cp instead of averaging. DistributedDataParallelConfig has no such field.
    assert config.calculate_per_token_loss
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=distributed_optimizer,
        ),
        module=model,
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    o = cfg.optim
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=o.grad_clip,
        use_distributed_optimizer=distributed_optimizer,
        params_dtype=torch.float32,
    )
    kwargs = {}
    if "use_gloo_process_groups" in inspect.signature(get_megatron_optimizer).parameters:
        kwargs["use_gloo_process_groups"] = False
    optimizer = get_megatron_optimizer(optimizer_config, [ddp], **kwargs)
    forward_backward = get_forward_backward_func()
    stream = StepStream(corpus.train, cfg.batching.tokens_per_step, cfg.data.seed)
    megatron_steps = []
    for step in range(1, STEPS + 1):
        work = plan_step(next(stream), cfg, layout, corpus.tokenizer.pad_id, device)
        lr = lr_at(step - 1, cfg)
        # What megatron's OptimizerParamScheduler does: lr, and weight decay times wd_mult
        # (0 for biases and norms, as the recipe's no-decay group).
        for group in optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = o.weight_decay * group.get("wd_mult", 1.0)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=functools.partial(_megatron_forward_step, cfg, rank0_weight),
            data_iterator=iter(work.micro_batches),
            model=[ddp],
            num_microbatches=len(work.micro_batches),
            seq_length=max(b.input_ids.numel() for b in work.micro_batches),
            micro_batch_size=1,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        totals = torch.stack([r["lm loss"] for r in reports]).sum(0)
        collectives.all_reduce_sum(totals, groups.gradient_group())
        megatron_steps.append((float(totals[0] / totals[1]), float(grad_norm)))

    weight_diff = max(
        float((p.detach() - recipe_weights[n].detach()).abs().max())
        for n, p in ddp.module.named_parameters()
    )
    moved = max(
        float((p.detach() - initial[n]).abs().max()) for n, p in ddp.module.named_parameters()
    )
    return {
        "recipe": [(s.lm_loss, s.grad_norm) for s in recipe_steps],
        "megatron": megatron_steps,
        "weight_diff": weight_diff,
        "moved": moved,
        "wd_mults": sorted({g.get("wd_mult", 1.0) for g in optimizer.param_groups}),
    }


def _check_engines(result: dict) -> None:
    print(result)
    for (recipe_loss, recipe_norm), (megatron_loss, megatron_norm) in zip(
        result["recipe"], result["megatron"], strict=True
    ):
        assert megatron_loss == pytest.approx(recipe_loss, rel=1e-6, abs=0)
        assert megatron_norm == pytest.approx(recipe_norm, rel=1e-5, abs=0)
    assert result["moved"] > 1e-3, "the weights did not move: nothing was compared"
    assert result["weight_diff"] < 1e-5


ENGINE_CONFIG = ["parallel.dp=2"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "distributed_optimizer,overlap",
    [(False, False), (True, True)],
    ids=["plain-optimizer", "distributed-optimizer-overlapped"],
)
def test_megatron_engine_matches_the_recipe_at_dp2(worlds, distributed_optimizer, overlap):
    """Measured (both stacks, 2 steps): lm_loss equal to the last digit, grad_norm within
    2e-7 relative, weights within 1.5e-7 (megatron divides by the token count after backward
    and the DP all-reduce, the recipe before backward)."""
    from tests.helpers.config import typed_config

    cfg = typed_config(ENGINE_CONFIG)
    result = worlds.run(cfg.world_size, _engines_on_rank, cfg, distributed_optimizer, overlap)
    _check_engines(result)


@pytest.mark.distributed
def test_negative_control_a_rank_weighted_loss_fails_the_engine_comparison(worlds):
    """Rank 0's tokens weigh twice in the gradient (the report stays honest), the kind of
    normalisation bug across DP ranks that Megatron-LM #7452 lists: the comparison must fail."""
    from tests.helpers.config import typed_config

    cfg = typed_config(ENGINE_CONFIG)
    result = worlds.run(cfg.world_size, _engines_on_rank, cfg, False, False, 2.0)
    with pytest.raises(AssertionError):
        _check_engines(result)
