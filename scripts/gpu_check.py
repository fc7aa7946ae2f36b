#!/usr/bin/env python
"""Check the GPU path on ONE GPU and write what was found: report.json and report.md.

    python scripts/gpu_check.py [--out DIR] [--quick]

Parts (each reports pass / fail / skipped with the reason, never silently dropped):
  versions          python, torch, CUDA, megatron-core, Transformer Engine, the GPU
  te_backends       which TE attention backend fp32/bf16 x THD x cp would select
  zigzag_vs_te      the recipe's zigzag index against TE's thd_get_partitioned_indices
  attention_vs_te   the recipe's varlen attention against TE's DotProductAttention (cp=1, bf16):
                    outputs and gradients
  model_te_vs_torch the whole model with the te and the torch backend at cp=1 on the same
                    weights, with and without MTP
  bf16_vs_fp32      30 training steps in bf16 against fp32
  mfu_1b            model FLOPs utilisation of model=gpt_1b on a 16k-token packed step
On a machine without CUDA every part after `versions` is skipped with "no CUDA" and the script
exits 0: the report says honestly that nothing ran. Exit 1 when any part that ran failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

RTOL_BF16 = 2e-2
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

    return compose_typed((SMALL if small else ["trainer.progress_bar=false"]) + overrides)


class Skip(Exception):
    """A part that cannot run here; the message says why."""


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip("no CUDA")


def _need_te():
    _need_cuda()
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise Skip(f"Transformer Engine is not installed ({err})") from None
    return te


def check_versions(quick: bool) -> dict:
    from recipe.model.compat import megatron_version, transformer_engine_version

    te = transformer_engine_version()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": megatron_version(),
        "transformer_engine": ".".join(map(str, te)) if te else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def check_te_backends(quick: bool) -> dict:
    """TE's own selection logic (attention/dot_product_attention/utils.py:get_attention_backend)
    for the recipe's THD layout, fp32 and bf16, with and without CP."""
    _need_te()
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    selected = {}
    for dtype in (torch.float32, torch.bfloat16):
        for cp in (1, 2):
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
            )
            backend = dpa_utils.get_attention_backend(params)
            use_flash, use_fused, _, use_unfused = backend[0], backend[1], backend[2], backend[3]
            name = "flash" if use_flash else "fused" if use_fused else "unfused"
            if not (use_flash or use_fused or use_unfused):
                name = "none"
            selected[f"{str(dtype).removeprefix('torch.')} thd cp={cp}"] = name
    bf16_ok = all(v in ("flash", "fused") for k, v in selected.items() if "bfloat16" in k)
    return {"passed": bf16_ok, "selected": selected}


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
    return {"passed": mismatches == 0, "cases": cases, "mismatching_ranks": mismatches}


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

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))

    out_rel = rel(ours, theirs)
    grad_rel = max(rel(a, b) for a, b in zip(grads_ours, grads_theirs))
    return {
        "passed": out_rel < RTOL_BF16 and grad_rel < RTOL_BF16,
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


def check_model_te_vs_torch(quick: bool) -> dict:
    _need_te()
    from recipe.data.packing import pack_sequences
    from recipe.launch.local import lone_world
    from recipe.model.gpt import build_gpt_model
    from recipe.model.numerics import autocast
    from recipe.training.step import forward_step

    results = {}
    for mtp in (False, True):
        overrides = ["trainer.precision=bf16"] + (["mtp=on"] if mtp else [])
        losses = {}
        with lone_world():
            models = {}
            for backend in ("torch", "te"):
                cfg = _config(overrides + [f"model.attention_backend={backend}"])
                models[backend] = build_gpt_model(
                    cfg.model,
                    vocab_size=259,
                    max_sequence_length=256,
                    seed=0,
                    mtp_cfg=cfg.mtp,
                    device=torch.device("cuda"),
                )
            local = dict(models["torch"].named_parameters())
            copied = 0
            with torch.no_grad():
                for name, param in models["te"].named_parameters():
                    target = _te_to_local_name(name)
                    if target is None or target not in local:
                        raise RuntimeError(f"no torch-backend parameter for TE's {name}")
                    param.copy_(local[target])
                    copied += 1
            if copied != len(local):
                raise RuntimeError(f"copied {copied} of {len(local)} parameters")
            gen = torch.Generator().manual_seed(0)
            seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (100, 37, 200)]
            batch = pack_sequences(seqs, 1, 258)
            if mtp:
                from recipe.model.mtp import mtp_label_masks

                batch = batch.replace(
                    mtp_mask=mtp_label_masks(
                        batch.position_ids, batch.tokens_per_sequence_length(), 1
                    )
                )
            batch = batch.to(torch.device("cuda"))
            for backend, model in models.items():
                model.eval()
                with torch.no_grad(), autocast(torch.device("cuda"), "bf16"):
                    per_token = forward_step(batch, model).per_token_loss.float()
                losses[backend] = float((per_token * batch.loss_mask).sum() / batch.loss_mask.sum())
        gap = abs(losses["te"] - losses["torch"]) / abs(losses["torch"])
        results["mtp" if mtp else "plain"] = {"losses": losses, "rel": gap}
    passed = all(r["rel"] < RTOL_BF16 for r in results.values())
    return {"passed": passed, "tolerance": RTOL_BF16, **results}


def check_bf16_vs_fp32(quick: bool) -> dict:
    _need_cuda()
    from recipe.training.trainer import train

    steps = 10 if quick else 30
    common = [f"trainer.max_steps={steps}", "model.attention_backend=torch"]
    runs = {
        p: [h["lm_loss"] for h in train(_config(common + [f"trainer.precision={p}"]))["history"]]
        for p in ("fp32", "bf16")
    }
    worst = max(abs(a - b) / abs(a) for a, b in zip(runs["fp32"], runs["bf16"]))
    return {
        "passed": worst < RTOL_BF16,
        "steps": steps,
        "max_rel": worst,
        "final": {p: r[-1] for p, r in runs.items()},
    }


def check_mfu_1b(quick: bool) -> dict:
    _need_cuda()
    from recipe.training.trainer import train

    overrides = [
        "model=gpt_1b",
        "trainer.precision=bf16",
        "data.max_seq_len=4096",
        "data.markov.max_doc_len=4000",
        "data.markov.mean_doc_len=2000",
        "batching.tokens_per_step=16384",
        "batching.max_tokens_per_rank=16384",
        f"trainer.max_steps={3 if quick else 6}",
    ]
    history = train(_config(overrides + ["logger.wandb.mode=disabled"], small=False))["history"]
    timed = history[1:]  # the first step carries warm-up
    mfu = [h.get("mfu") for h in timed]
    if any(m is None for m in mfu):
        raise Skip("the GPU's peak is not in the table; pass trainer.peak_tflops to measure MFU")
    return {
        "passed": True,
        "mfu_mean": sum(mfu) / len(mfu),
        "tokens_per_s": sum(h["tokens_per_s"] for h in timed) / len(timed),
        "steps_timed": len(timed),
    }


CHECKS = {
    "versions": check_versions,
    "te_backends": check_te_backends,
    "zigzag_vs_te": check_zigzag_vs_te,
    "attention_vs_te": check_attention_vs_te,
    "model_te_vs_torch": check_model_te_vs_torch,
    "bf16_vs_fp32": check_bf16_vs_fp32,
    "mfu_1b": check_mfu_1b,
}


def run_checks(quick: bool) -> dict:
    from recipe.model.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    report = {}
    for name, check in CHECKS.items():
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
                "traceback": traceback.format_exc(limit=6),
            }
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
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_checks(args.quick)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    (out / "report.md").write_text(markdown)
    print(markdown)
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    return 1 if any(r["status"] == "fail" for r in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
