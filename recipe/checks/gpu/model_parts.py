"""The GPU check parts that run one training micro-batch of the model through
`run_micro_batch`, as training does: model_te_vs_torch (the te backend against the torch
backend on the same weights: per-token losses and every gradient) and host_syncs (the device
synchronisations of one micro-batch at 2 and 4 layers)."""

from __future__ import annotations

import torch

from recipe.checks.gpu.shared import (
    RTOL_BF16,
    TE_KERNEL,
    TOKEN_ATOL_BF16,
    PartProgress,
    need_te,
    part_config,
    ran_with,
    rel_l2,
)
from recipe.checks.gpu.syncs import counting_cuda_syncs, counting_host_reads
from recipe.training.micro_batch import MicroBatchPass, run_micro_batch

SAMPLE_LENGTHS = (300, 37, 200)
"""The sequences of the one micro-batch that model_te_vs_torch and host_syncs run."""

# --- model_te_vs_torch -----------------------------------------------------------------------


def te_to_local_name(name: str) -> str | None:
    """TE's layer spec fuses the norms into the following linear; the local spec does not."""
    if name.endswith("_extra_state"):
        return None
    name = name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
    return name.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")


def sample_sequences(lengths=SAMPLE_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def losses_and_gradients(model, work, cfg, layout, device: torch.device, mtp_scales=None) -> dict:
    """The step's one micro-batch through `run_micro_batch` (what training runs: train mode, the
    config's precision, MTP scaled exactly, backward of the loss over the step's global token
    count) with its per-token rows captured: per-token losses (MTP depths too, in global token
    order) and every gradient."""
    from recipe.model.numerics import resolve_precision
    from recipe.training.tokens import token_columns

    model.train()
    model.zero_grad(set_to_none=True)
    rows: list[torch.Tensor] = []
    precision = resolve_precision(cfg.trainer.precision, device)
    micro = MicroBatchPass(
        work, cfg, layout, precision, model, token_rows_out=rows, mtp_scales=mtp_scales
    )
    run_micro_batch(micro, 0, model, backward=True)
    (table,) = rows
    names = token_columns(cfg.mtp.num_layers if cfg.mtp.enabled else 0)
    mtp = [table[:, i] for i, name in enumerate(names) if name.startswith("mtp_loss_")]
    return {
        "lm": table[:, names.index("lm_loss")].float(),
        "mtp": [column[~column.isnan()].float() for column in mtp],
        "grads": {
            n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None
        },
    }


def model_pair_passes(
    overrides: list[str],
    backends: tuple[str, str],
    device: torch.device,
    rename=None,
    progress: PartProgress | None = None,
) -> tuple[dict, dict, dict[str, str]]:
    """Two models of the same config but the attention backend, the second given the first's
    weights (`rename` maps the second's parameter names to the first's), one training pass each
    on the same micro-batch. Returns (first's pass, second's pass, second's name -> first's)."""
    from recipe.launch.local import lone_world
    from recipe.model.mtp import MTPBackwardScales
    from recipe.training.step import plan_step
    from recipe.training.trainer import build_model

    progress = progress or PartProgress()
    rename = rename or (lambda name: name)
    with lone_world() as layout:
        scales = MTPBackwardScales().install()
        cfgs = [part_config(overrides + [f"model.attention_backend={b}"]) for b in backends]
        progress.at(f"building the {' and '.join(backends)} models")
        models = [build_model(cfg, 259, device) for cfg in cfgs]
        reference = dict(models[0].named_parameters())
        pairs = {}
        with torch.no_grad():
            for name, param in models[1].named_parameters():
                target = rename(name)
                if target is None:
                    continue
                if target not in reference:
                    raise RuntimeError(f"no {backends[0]}-backend parameter for {name}")
                param.copy_(reference[target])
                pairs[name] = target
        if len(pairs) != len(reference):
            raise RuntimeError(f"copied {len(pairs)} of {len(reference)} parameters")
        seqs = sample_sequences()
        passes = []
        for backend, cfg, model in zip(backends, cfgs, models):
            progress.at(f"one training micro-batch, {backend} backend", SAMPLE_LENGTHS)
            work = plan_step(seqs, cfg, layout, pad_id=258, device=device)
            if len(work.micro_batches) != 1:
                raise RuntimeError("the comparison wants one micro-batch")
            passes.append(losses_and_gradients(model, work, cfg, layout, device, scales))
    return passes[0], passes[1], pairs


def compare_passes(reference: dict, candidate: dict, pairs: dict[str, str]) -> dict:
    """Per-token losses (largest |difference|) and gradients (largest relative L2 difference,
    and which parameter) of two training passes; `pairs` maps candidate to reference names."""
    token_abs = float((candidate["lm"] - reference["lm"]).abs().max())
    mtp_abs = [float((a - b).abs().max()) for a, b in zip(candidate["mtp"], reference["mtp"])]
    missing = sorted(n for n in pairs if n not in candidate["grads"])
    grad_rel = {
        name: rel_l2(candidate["grads"][name], reference["grads"][target])
        for name, target in pairs.items()
        if name in candidate["grads"]
    }
    worst = max(grad_rel, key=grad_rel.get)
    return {
        "tokens": int(reference["lm"].numel()),
        "token_max_abs": token_abs,
        "mtp_token_max_abs": max(mtp_abs) if mtp_abs else None,
        "mtp_depths_compared": len(mtp_abs),
        "grad_rel_l2_max": grad_rel[worst],
        "grad_worst": worst,
        "grads_compared": len(grad_rel),
        "grads_missing": missing,
    }


def passes_within(result: dict, token_atol: float, grad_rtol: float) -> bool:
    return (
        result["token_max_abs"] < token_atol
        and (result["mtp_token_max_abs"] or 0.0) < token_atol
        and result["grad_rel_l2_max"] < grad_rtol
        and not result["grads_missing"]
    )


def check_model_te_vs_torch(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    backends: tuple[str, str] = ("torch", "te"),
) -> dict:
    """`backends`: the reference's and the candidate's attention backend (on the CPU, torch
    against torch: the machinery, at 0 difference)."""
    if "te" in backends:
        need_te()
        progress.kernels.add(("bfloat16", TE_KERNEL))
    rename = te_to_local_name if backends[1] == "te" else None
    results = {}
    for mtp in (False, True):
        overrides = ["trainer.precision=bf16"] + (["mtp=on"] if mtp else [])
        reference, candidate, pairs = model_pair_passes(
            overrides, backends, device, rename, progress
        )
        result = compare_passes(reference, candidate, pairs)
        result["passed"] = passes_within(result, TOKEN_ATOL_BF16, RTOL_BF16)
        results["mtp" if mtp else "plain"] = result
    return {
        "passed": all(r.pop("passed") for r in results.values()),
        "ran": ran_with(
            precision="bf16 autocast, fp32 weights", ranks=1, mode="train", backends=list(backends)
        ),
        "token_atol": TOKEN_ATOL_BF16,
        "grad_rtol": RTOL_BF16,
        **results,
    }


# --- host_syncs ------------------------------------------------------------------------------


def count_micro_batch_syncs(
    num_layers: int,
    device: torch.device,
    counter,
    backend: str = "torch",
    progress: PartProgress | None = None,
) -> dict[str, int]:
    """`counter`'s counts during one training micro-batch as training runs it
    (`run_micro_batch`: MTP scaling, forward, loss, backward); the model built and the step
    planned before counting starts."""
    from recipe.launch.local import lone_world
    from recipe.model.numerics import resolve_precision
    from recipe.training.step import plan_step
    from recipe.training.trainer import build_model

    progress = progress or PartProgress()
    overrides = [f"model.attention_backend={backend}", "trainer.precision=bf16", "mtp=on"]
    cfg = part_config(overrides + [f"model.num_layers={num_layers}"])
    with lone_world() as layout:
        model = build_model(cfg, 259, device)
        work = plan_step(sample_sequences(), cfg, layout, pad_id=258, device=device)
        precision = resolve_precision(cfg.trainer.precision, device)
        micro = MicroBatchPass(work, cfg, layout, precision, model)
        progress.at(f"one training micro-batch, {num_layers} layers", SAMPLE_LENGTHS)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with counter() as counts:
            run_micro_batch(micro, 0, model, backward=True)
    return counts


def check_host_syncs(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    counter=None,
    backend: str = "torch",
) -> dict:
    """The recipe's own synchronisations per micro-batch must not grow with depth (the torch
    backend reads the boundaries once per micro-batch); megatron's unfused THD RoPE reads them
    per layer, which is megatron's and shown, not gated. `counter`: a context manager yielding
    {"recipe", "megatron", "other"} counts (default: `counting_cuda_syncs` on CUDA,
    `counting_host_reads` elsewhere)."""
    cuda = device.type == "cuda"
    if counter is None:
        counter = counting_cuda_syncs if cuda else counting_host_reads
    if backend == "te":
        need_te()
        progress.kernels.add(("bfloat16", TE_KERNEL))
    shallow = count_micro_batch_syncs(2, device, counter, backend, progress)
    deep = count_micro_batch_syncs(4, device, counter, backend, progress)
    counted = (
        "synchronising CUDA calls (torch's sync debug mode)"
        if counter is counting_cuda_syncs
        else "host reads of tensors (tolist, item, int, bool, float, index)"
        if counter is counting_host_reads
        else getattr(counter, "__name__", repr(counter))
    )
    return {
        "passed": deep["recipe"] == shallow["recipe"],
        "ran": ran_with(
            precision="bf16 autocast", ranks=1, backend=backend, mtp=True, counted=counted
        ),
        "layers_2": shallow,
        "layers_4": deep,
    }
