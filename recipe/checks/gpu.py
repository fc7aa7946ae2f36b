"""Check the GPU path on ONE GPU and write what was found: report.json and report.md.

    python scripts/gpu_check.py [--out DIR] [--quick] [--only PART,PART]

Parts (each reports pass / fail / skipped with the reason, never silently dropped, and says what
ran: backend, precision, ranks, versions):
  versions          python, torch, CUDA, cuDNN, NCCL, megatron-core, Transformer Engine, the GPU
  te_backends       which TE attention backend bf16/fp32 x THD x cp x determinism would select
  zigzag_vs_te      the recipe's zigzag index against TE's thd_get_partitioned_indices
  attention_vs_te   the recipe's varlen attention against TE's DotProductAttention (cp=1, bf16):
                    outputs and gradients
  model_te_vs_torch the whole model, te against torch backend at cp=1 on the same weights, in
                    training mode: per-token losses and every gradient, with and without MTP
  cp2_one_gpu       two ranks on the one GPU: cp=2 against cp=1 per token (torch backend; TE too
                    where NCCL lets two ranks share a GPU)
  host_syncs        device synchronisations of one training micro-batch, at 2 and 4 layers
  bf16_vs_fp32      training in bf16 against fp32: step 1 and the final loss
  mfu_1b            model FLOPs utilisation of model=gpt_1b on a 16k-token packed step
                    (non-deterministic kernels, TE where installed, median of >= 8 steps)
Determinism (megatron's deterministic_mode, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, cuBLAS) is set
before any CUDA work; only mfu_1b turns it off. On a machine without CUDA every part after
`versions` is skipped with "no CUDA" and the script exits 0: the report says honestly that
nothing ran. Exit 1 when any part that ran failed. `scripts/gpu_kit.sh run OUT` runs this on a
bare CUDA machine under a hard 8-minute limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

RTOL_BF16 = 2e-2
# Per-token |difference| of next-token losses (nats) that a bf16 forward may show between two
# implementations of the same model; the fp32 gate is the recipe's own (recipe.names).
TOKEN_ATOL_BF16 = 0.1
NCCL_SHARES_A_GPU_FROM = (2, 30)
"""NCCL lets several ranks use one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1) from 2.30; before that it
refuses the second rank ("Duplicate GPU detected")."""
MFU_WARMUP_STEPS = 2
MFU_TIMED_STEPS = 8

# A small model and corpus: each part runs in seconds, the 1B preset only where it is the point.
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=512",
    "data.max_seq_len=512",
    "data.markov.mean_doc_len=150",
    "data.markov.max_doc_len=500",
    "data.markov.num_train_docs=600",
    "data.markov.num_eval_docs=20",
    "batching.tokens_per_step=4096",
    "batching.max_tokens_per_rank=4096",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "logger.wandb.mode=disabled",
]


def _config(overrides: list[str], small: bool = True):
    from recipe.launch.compose import compose_typed

    base = SMALL if small else ["trainer.progress_bar=false", "logger.wandb.mode=disabled"]
    return compose_typed(base + overrides)


class Skip(Exception):
    """A part that cannot run here; the message says why."""


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip("no CUDA")


def _te_installed() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _need_te():
    _need_cuda()
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise Skip(f"Transformer Engine is not installed ({err})") from None
    return te


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def nccl_version() -> tuple[int, ...] | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a torch built without NCCL
        return None
    return tuple(version) if isinstance(version, tuple) else (version,)


def _dotted(version) -> str | None:
    return ".".join(map(str, version)) if version else None


def ran_with(**what) -> dict:
    """What a part ran with, always the same keys first: the report is read by people."""
    from recipe.megatron.versions import megatron_version, transformer_engine_version

    return {
        "torch": torch.__version__,
        "megatron_core": megatron_version(),
        "transformer_engine": _dotted(transformer_engine_version()),
        **what,
    }


def check_versions(quick: bool) -> dict:
    from recipe.megatron.versions import megatron_version, transformer_engine_version

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": _dotted(nccl_version()),
        "megatron_core": megatron_version(),
        "transformer_engine": _dotted(transformer_engine_version()),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "capability": _dotted(torch.cuda.get_device_capability(0)) if cuda else None,
    }


def te_selection(result: tuple) -> dict:
    """TE's `get_attention_backend` result, read by meaning rather than position.

    TE 2.x returns (use_flash, flash_backend, use_fused, fused_backend, use_unfused,
    available_backends); older releases had no flash_backend, and the docstring of 2.20 still
    lists five. The selection flags are the only bools in the tuple and come in the order
    flash, fused, unfused; the last item is the list of available backends."""
    flags = [item for item in result[:-1] if isinstance(item, bool)]
    available = result[-1]
    if len(flags) != 3 or not isinstance(available, (list, tuple)) or len(available) != 3:
        raise RuntimeError(
            f"Transformer Engine's get_attention_backend returned {len(result)} items "
            f"({[type(r).__name__ for r in result]}); scripts/gpu_check.py::te_selection reads "
            "three selection flags and a list of three available backends"
        )
    names = ("flash", "fused", "unfused")
    selected = next((n for n, flag in zip(names, flags) if flag), "none")
    return {"selected": selected, "available": [n for n, a in zip(names, available) if a]}


def check_te_backends(quick: bool) -> dict:
    """TE's own selection logic (attention/dot_product_attention/utils.py:get_attention_backend)
    for the recipe's THD layout: bf16 and fp32, cp 1 and 2, deterministic or not."""
    _need_te()
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    table = {}
    for dtype in (torch.bfloat16, torch.float32):
        for cp in (1, 2):
            for deterministic in (True, False):
                params = dpa_utils.AttentionParams(
                    qkv_type=torch.Tensor,
                    qkv_dtype=dtype,
                    qkv_layout="thd_thd_thd",
                    batch_size=4,
                    num_heads=8,
                    num_gqa_groups=2,
                    max_seqlen_q=2048,
                    max_seqlen_kv=2048,
                    head_dim_qk=64,
                    head_dim_v=64,
                    attn_mask_type="padding_causal",
                    context_parallel=cp > 1,
                    cp_size=cp,
                    deterministic=deterministic,
                )
                precision = str(dtype).removeprefix("torch.")
                key = f"{precision} thd cp={cp} deterministic={deterministic}"
                table[key] = te_selection(dpa_utils.get_attention_backend(params))
    bf16_ok = all(v["selected"] in ("flash", "fused") for k, v in table.items() if "bfloat" in k)
    return {"passed": bf16_ok, "ran": ran_with(), "selection": table}


def check_zigzag_vs_te(quick: bool) -> dict:
    _need_te()
    import transformer_engine_torch as tex

    from recipe.data.thd import cu_seqlens_from_lengths, padded_lengths
    from recipe.parallel.cp.zigzag import zigzag_index

    gen = torch.Generator().manual_seed(0)
    mismatches = 0
    cases = 0
    for cp in (2, 4, 8):
        lengths = torch.randint(1, 3000, (37,), generator=gen)
        cu = cu_seqlens_from_lengths(padded_lengths(lengths, 2 * cp)).cuda()
        total = int(cu[-1])
        for rank in range(cp):
            ours = zigzag_index(cu, cp, rank)
            theirs = tex.thd_get_partitioned_indices(cu, total, cp, rank).to(torch.int64)
            cases += 1
            mismatches += int(not torch.equal(ours, theirs))
    return {
        "passed": mismatches == 0,
        "ran": ran_with(cp_sizes=[2, 4, 8]),
        "cases": cases,
        "mismatching_ranks": mismatches,
    }


def _packed_qkv(lengths, heads, groups, dim, dtype):
    from recipe.data.thd import cu_seqlens_from_lengths

    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total, groups, dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total, groups, dim, device="cuda", dtype=dtype, generator=gen)
    cu = cu_seqlens_from_lengths(torch.tensor(lengths)).cuda()
    return [t.requires_grad_() for t in (q, k, v)], cu


def check_attention_vs_te(quick: bool) -> dict:
    te = _need_te()
    from recipe.model.attention import varlen_causal_attention

    heads, groups, dim = 8, 2, 64
    lengths = [512, 37, 1024, 128, 256]
    (q, k, v), cu = _packed_qkv(lengths, heads, groups, dim, torch.bfloat16)
    ours = varlen_causal_attention(q, k, v, cu)
    grads_ours = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
    attention = te.DotProductAttention(
        heads, dim, num_gqa_groups=groups, qkv_format="thd", attn_mask_type="padding_causal"
    )
    theirs = attention(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    ).reshape(ours.shape)
    grads_theirs = torch.autograd.grad(theirs.float().square().sum(), (q, k, v))
    out_rel = _rel(ours, theirs)
    grad_rel = max(_rel(a, b) for a, b in zip(grads_ours, grads_theirs))
    return {
        "passed": out_rel < RTOL_BF16 and grad_rel < RTOL_BF16,
        "ran": ran_with(precision="bf16", ranks=1, lengths=lengths),
        "output_rel_l2": out_rel,
        "grad_rel_l2_max": grad_rel,
        "tolerance": RTOL_BF16,
    }


def _te_to_local_name(name: str) -> str | None:
    """TE's layer spec fuses the norms into the following linear; the local spec does not."""
    if name.endswith("_extra_state"):
        return None
    name = name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
    return name.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")


def _training_pass(model, work, cfg, layout, device: torch.device, mtp_scales=None) -> dict:
    """The step's one training micro-batch through the trainer's own per-micro-batch work
    (`MicroBatchPass`: train mode, the config's precision, MTP scaled exactly, the per-token
    capture), then backward as the recipe's engine runs it: per-token losses (MTP depths too,
    in global token order) and every gradient."""
    from recipe.model.numerics import resolve_precision
    from recipe.training.micro_batch import MicroBatchPass
    from recipe.training.tokens import token_columns

    model.train()
    model.zero_grad(set_to_none=True)
    rows: list[torch.Tensor] = []
    precision = resolve_precision(cfg.trainer.precision, device)
    micro = MicroBatchPass(
        work, cfg, layout, precision, model, token_rows_out=rows, mtp_scales=mtp_scales
    )
    output, finish = micro.forward(0, model)
    loss_sum, _, _ = finish(output)
    (loss_sum / work.global_predicted_tokens).backward()
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
    overrides: list[str], backends: tuple[str, str], device: torch.device, rename=None
) -> tuple[dict, dict, dict[str, str]]:
    """Two models of the same config but the attention backend, the second given the first's
    weights (`rename` maps the second's parameter names to the first's), one training pass each
    on the same micro-batch. Returns (first's pass, second's pass, second's name -> first's)."""
    from recipe.launch.local import lone_world
    from recipe.model.mtp import MTPBackwardScales
    from recipe.training.step import plan_step
    from recipe.training.trainer import build_model

    rename = rename or (lambda name: name)
    with lone_world() as layout:
        scales = MTPBackwardScales().install()
        cfgs = [_config(overrides + [f"model.attention_backend={b}"]) for b in backends]
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
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (300, 37, 200)]
        passes = []
        for cfg, model in zip(cfgs, models):
            work = plan_step(seqs, cfg, layout, pad_id=258, device=device)
            if len(work.micro_batches) != 1:
                raise RuntimeError("the comparison wants one micro-batch")
            passes.append(_training_pass(model, work, cfg, layout, device, scales))
    return passes[0], passes[1], pairs


def compare_passes(reference: dict, candidate: dict, pairs: dict[str, str]) -> dict:
    """Per-token losses (largest |difference|) and gradients (largest relative L2 difference,
    and which parameter) of two training passes; `pairs` maps candidate to reference names."""
    token_abs = float((candidate["lm"] - reference["lm"]).abs().max())
    mtp_abs = [float((a - b).abs().max()) for a, b in zip(candidate["mtp"], reference["mtp"])]
    missing = sorted(n for n in pairs if n not in candidate["grads"])
    grad_rel = {
        name: _rel(candidate["grads"][name], reference["grads"][target])
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


def check_model_te_vs_torch(quick: bool) -> dict:
    _need_te()
    results = {}
    for mtp in (False, True):
        overrides = ["trainer.precision=bf16"] + (["mtp=on"] if mtp else [])
        reference, candidate, pairs = model_pair_passes(
            overrides, ("torch", "te"), torch.device("cuda"), _te_to_local_name
        )
        result = compare_passes(reference, candidate, pairs)
        result["passed"] = passes_within(result, TOKEN_ATOL_BF16, RTOL_BF16)
        results["mtp" if mtp else "plain"] = result
    return {
        "passed": all(r.pop("passed") for r in results.values()),
        "ran": ran_with(precision="bf16 autocast, fp32 weights", ranks=1, mode="train"),
        "token_atol": TOKEN_ATOL_BF16,
        "grad_rtol": RTOL_BF16,
        **results,
    }


def sharing_route(nccl: tuple[int, ...] | None) -> tuple[str, str]:
    """How two ranks share the GPU (RECIPE_GPU_SHARING) with this NCCL, and why."""
    if nccl is not None and tuple(nccl[:2]) >= NCCL_SHARES_A_GPU_FROM:
        return "nccl", f"NCCL {_dotted(nccl)} shares a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)"
    return "gloo", (
        f"NCCL {_dotted(nccl) or 'absent'} refuses two ranks on one GPU (it shares one from "
        f"{_dotted(NCCL_SHARES_A_GPU_FROM)}): gloo collectives, all-gathers through the host"
    )


@contextlib.contextmanager
def _environment(**values):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _train_recording(overrides: list[str], out: Path) -> list[dict]:
    from recipe.launch.local import launch_world
    from recipe.launch.rank import train

    cfg = _config(overrides)
    cfg.output_dir = str(out)
    return (launch_world(cfg) if cfg.world_size > 1 else train(cfg))["history"]


def cp2_against_cp1(overrides: list[str], token_atol: float, folder: Path, steps: int = 2) -> dict:
    """Train `steps` steps at cp=2 (two ranks) and cp=1, recording every token's loss at the
    first and last step, and compare them token by token (recipe.compare.tokens)."""
    from recipe.compare.tokens import compare_token_records

    common = [f"trainer.max_steps={steps}", f"trainer.record_tokens=[1,{steps}]"]
    history = {}
    for cp in (1, 2):
        history[cp] = _train_recording(common + overrides + [f"cp={cp}"], folder / f"cp{cp}")
    tokens = compare_token_records(folder / "cp2", folder / "cp1", token_atol, cp_size=2)
    return {
        "passed": tokens.passed,
        "token_atol": token_atol,
        "steps": steps,
        "tokens_compared": sum(s.tokens for s in tokens.steps),
        "token_max_abs": max((s.max_abs for s in tokens.steps), default=None),
        "tokens_flagged": sum(s.flagged for s in tokens.steps),
        "problems": tokens.problems,
        "step1_lm_loss_rel": _rel_diff(history[2][0]["lm_loss"], history[1][0]["lm_loss"]),
    }


def check_cp2_one_gpu(quick: bool) -> dict:
    """cp=2 on two ranks sharing the GPU against cp=1, per token: the recipe's all-gather
    attention (and TE's ring attention where NCCL allows) with real collectives on a GPU."""
    _need_cuda()
    from recipe.names import FP32_TOKEN_ATOL

    route, why = sharing_route(nccl_version())
    variants = {
        "torch fp32": (["model.attention_backend=torch", "trainer.precision=fp32"], FP32_TOKEN_ATOL)
    }
    skipped = {}
    if not _te_installed():
        skipped["te bf16"] = "Transformer Engine is not installed"
    elif route != "nccl":
        skipped["te bf16"] = "TE's CP attention exchanges K/V by NCCL send/recv: " + why
    else:
        variants["te bf16"] = (
            ["model.attention_backend=te", "trainer.precision=bf16"],
            TOKEN_ATOL_BF16,
        )
    results = {}
    with tempfile.TemporaryDirectory() as tmp, _environment(RECIPE_GPU_SHARING=route):
        for name, (overrides, atol) in variants.items():
            folder = Path(tmp) / name.replace(" ", "_")
            results[name] = cp2_against_cp1(overrides, atol, folder)
    return {
        "passed": all(r.pop("passed") for r in results.values()),
        "ran": ran_with(ranks=2, gpus=1, route=route, why=why),
        **results,
        "skipped": skipped,
    }


def _rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _count_syncs(num_layers: int) -> dict[str, int]:
    """Synchronising CUDA calls during one training micro-batch (torch's sync debug mode),
    split by whose code made them (the innermost recipe or megatron frame)."""
    from recipe.launch.local import lone_world
    from recipe.training.step import plan_step
    from recipe.training.trainer import build_model

    overrides = ["model.attention_backend=torch", "trainer.precision=bf16", "mtp=on"]
    cfg = _config(overrides + [f"model.num_layers={num_layers}"])
    with lone_world() as layout:
        model = build_model(cfg, 259, torch.device("cuda"))
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (300, 37, 200)]
        work = plan_step(seqs, cfg, layout, pad_id=258, device=torch.device("cuda"))
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _training_pass(model, work.micro_batches[0], work, cfg, torch.device("cuda"))
            finally:
                torch.cuda.set_sync_debug_mode("default")
    counts = {"recipe": 0, "megatron": 0, "other": 0}
    for warning in caught:
        if "synchroniz" not in str(warning.message):
            continue
        where = warning.filename
        key = "recipe" if "/recipe/" in where else "megatron" if "/megatron/" in where else "other"
        counts[key] += 1
    return counts


def check_host_syncs(quick: bool) -> dict:
    """The recipe's own synchronisations per micro-batch must not grow with depth (the torch
    backend reads the boundaries once per micro-batch); megatron's unfused THD RoPE reads them
    per layer, which is megatron's and shown, not gated."""
    _need_cuda()
    shallow, deep = _count_syncs(2), _count_syncs(4)
    return {
        "passed": deep["recipe"] == shallow["recipe"],
        "ran": ran_with(precision="bf16 autocast", ranks=1, backend="torch", mtp=True),
        "layers_2": shallow,
        "layers_4": deep,
    }


def bf16_verdict(fp32: list[float], bf16: list[float]) -> dict:
    """bf16 against fp32 at step 1 (the same weights, one forward apart) and at the end (the
    same training, rounding apart); the largest gap along the way is shown, not gated: a single
    step's noise can exceed it without the runs diverging."""
    first = _rel_diff(bf16[0], fp32[0])
    final = _rel_diff(bf16[-1], fp32[-1])
    along = max(_rel_diff(b, a) for a, b in zip(fp32, bf16))
    return {
        "passed": first < RTOL_BF16 and final < RTOL_BF16,
        "step1_rel": first,
        "final_rel": final,
        "max_rel_along_the_way": along,
        "tolerance": RTOL_BF16,
    }


def check_bf16_vs_fp32(quick: bool) -> dict:
    _need_cuda()
    from recipe.launch.rank import train

    steps = 10 if quick else 30
    common = [f"trainer.max_steps={steps}", "model.attention_backend=torch"]
    runs = {
        p: [h["lm_loss"] for h in train(_config(common + [f"trainer.precision={p}"]))["history"]]
        for p in ("fp32", "bf16")
    }
    return {
        **bf16_verdict(runs["fp32"], runs["bf16"]),
        "ran": ran_with(backend="torch", ranks=1, steps=steps),
        "final": {p: r[-1] for p, r in runs.items()},
    }


def check_mfu_1b(quick: bool) -> dict:
    _need_cuda()
    from recipe.launch.rank import train

    backend = "te" if _te_installed() else "torch"
    timed = 3 if quick else MFU_TIMED_STEPS
    overrides = [
        "model=gpt_1b",
        "trainer.precision=bf16",
        "trainer.deterministic=false",
        f"model.attention_backend={backend}",
        "data.max_seq_len=4096",
        "data.markov.max_doc_len=4000",
        "data.markov.mean_doc_len=2000",
        "batching.tokens_per_step=16384",
        "batching.max_tokens_per_rank=16384",
        f"trainer.max_steps={MFU_WARMUP_STEPS + timed}",
    ]
    torch.cuda.reset_peak_memory_stats()
    history = train(_config(overrides, small=False))["history"][MFU_WARMUP_STEPS:]
    mfu = [h.get("mfu") for h in history]
    if any(m is None for m in mfu):
        raise Skip("the GPU's peak is not in the table; pass trainer.peak_tflops to measure MFU")
    return {
        "passed": True,
        "ran": ran_with(
            backend=backend,
            precision="bf16 autocast, fp32 weights",
            deterministic=False,
            ranks=1,
            cudnn=torch.backends.cudnn.version(),
            nccl=_dotted(nccl_version()),
        ),
        "mfu_median": statistics.median(mfu),
        "mfu_min": min(mfu),
        "mfu_max": max(mfu),
        "tokens_per_s_median": statistics.median(h["tokens_per_s"] for h in history),
        "step_time_s_median": statistics.median(h["step_time_s"] for h in history),
        "steps_timed": len(history),
        "warmup_steps": MFU_WARMUP_STEPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


CHECKS = {
    "versions": check_versions,
    "te_backends": check_te_backends,
    "zigzag_vs_te": check_zigzag_vs_te,
    "attention_vs_te": check_attention_vs_te,
    "model_te_vs_torch": check_model_te_vs_torch,
    "cp2_one_gpu": check_cp2_one_gpu,
    "host_syncs": check_host_syncs,
    "bf16_vs_fp32": check_bf16_vs_fp32,
    "mfu_1b": check_mfu_1b,
}


def run_checks(quick: bool, only: list[str] | None = None) -> dict:
    from recipe.megatron.cpu_patches import install_cpu_patches
    from recipe.model.numerics import apply_determinism

    install_cpu_patches()
    # Before any CUDA work: megatron's TE layers refuse deterministic_mode unless
    # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 is already set when they are built.
    apply_determinism(True)
    report = {}
    for name, check in CHECKS.items():
        if only and name not in only and name != "versions":
            continue
        start = time.perf_counter()
        try:
            result = check(quick)
            status = "info" if name == "versions" else "pass" if result.pop("passed") else "fail"
            report[name] = {"status": status, **result}
        except Skip as why:
            report[name] = {"status": "skipped", "reason": str(why)}
        except Exception as err:  # a part that crashed is a failure, with its traceback
            report[name] = {
                "status": "fail",
                "reason": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=8),
            }
        finally:
            apply_determinism(True)  # mfu_1b turns it off; a later part must not inherit that
        report[name]["seconds"] = round(time.perf_counter() - start, 2)
    return report


def render_markdown(report: dict) -> str:
    lines = ["# GPU check", "", "| part | status | details |", "|---|---|---|"]
    for name, result in report.items():
        details = {k: v for k, v in result.items() if k not in ("status", "traceback")}
        lines.append(f"| {name} | {result['status']} | `{json.dumps(details)}` |")
    if not torch.cuda.is_available():
        lines += ["", "No CUDA on this machine: nothing but the versions was checked."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="folder for report.json, report.md")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    parser.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    args = parser.parse_args(argv)
    only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(CHECKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_checks(args.quick, only)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    markdown = render_markdown(report)
    (out / "report.md").write_text(markdown)
    print(markdown)
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    return 1 if any(r["status"] == "fail" for r in report.values()) else 0
