"""Check the GPU path on ONE GPU and write what was found: report.json and report.md.

    python scripts/gpu_check.py [--out DIR] [--quick] [--only PART,PART]

Parts (each reports pass / fail / skipped with the reason, never silently dropped, and says what
ran: backend, precision, ranks, versions, the attention kernels):
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

Every part is a function `check_<part>(quick, device, progress, **options)`. The script runs it on
the GPU against the real thing (Transformer Engine's selection, partition and attention; torch's
sync debug mode); tests/test_gpu_check.py runs every part's body on the CPU (`device=cpu`, small
shapes, an independent torch reference where TE would be), so that a GPU run fails only on what
only a GPU can show. `run_part` wraps one part: the attention kernels it ran
(`recipe.model.attention.recording_attention_kernels`; on CUDA a bf16 attention that took torch's
math kernel fails the part), its peak memory, and an out-of-memory error reported with where the
part was (`PartProgress`: the step and the sequence lengths). `run_checks` rewrites report.json
and report.md after every part, so a part that hangs until the time cap leaves the earlier
parts' results (and itself marked "running").

Determinism (megatron's deterministic_mode, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, cuBLAS) is set
before any CUDA work; only mfu_1b turns it off. On a machine without CUDA every part after
`versions` is skipped with "no CUDA" and the script exits 0: the report says honestly that
nothing ran. Exit 1 when any part that ran failed. `scripts/gpu_kit.sh run OUT` runs this on a
bare CUDA machine under a hard 8-minute limit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import recipe
from recipe.model.attention import recording_attention_kernels, varlen_causal_attention
from recipe.training.micro_batch import MicroBatchPass, run_micro_batch

RTOL_BF16 = 2e-2
# Per-token |difference| of next-token losses (nats) that a bf16 forward may show between two
# implementations of the same model; the fp32 gate is the recipe's own (recipe.names).
TOKEN_ATOL_BF16 = 0.1
NCCL_SHARES_A_GPU_FROM = (2, 30)
"""NCCL lets several ranks use one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1) from 2.30; before that it
refuses the second rank ("Duplicate GPU detected")."""
MFU_WARMUP_STEPS = 2
MFU_TIMED_STEPS = 8
MATH_KERNEL = "math"
"""torch's reference SDPA kernel: the whole [L, L] score matrix in memory, many times slower
than the fused kernels; on CUDA in bf16 it means the attention was not given what they need."""
TE_KERNEL = "te"
"""The kernel recorded for attention that Transformer Engine ran (it picks its own)."""

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
ONE_B = [
    "model=gpt_1b",
    "data.max_seq_len=4096",
    "data.markov.max_doc_len=4000",
    "data.markov.mean_doc_len=2000",
    "batching.tokens_per_step=16384",
    "batching.max_tokens_per_rank=16384",
]
"""mfu_1b's model and step: the 1B preset on 16k-token packed steps."""
SAMPLE_LENGTHS = (300, 37, 200)
"""The sequences of the one micro-batch that model_te_vs_torch and host_syncs run."""


def _config(overrides: list[str], small: bool = True):
    from recipe.launch.compose import compose_typed

    base = SMALL if small else ["trainer.progress_bar=false", "logger.wandb.mode=disabled"]
    return compose_typed(base + overrides)


class Skip(Exception):
    """A part that cannot run here; the message says why."""


class StoppedBySignal(BaseException):
    """SIGTERM (gpu_kit.sh's time cap) arrived while a part ran: a BaseException, so that no
    part's own error handling takes it for a failure of the part."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@dataclass
class PartProgress:
    """Where a running part is, kept up to date by the part: what the report of an
    out-of-memory error says. Also the attention kernels this process's recording cannot see
    (Transformer Engine's, other ranks')."""

    doing: str = ""
    step: int | None = None
    """The training step under way (in-process training: `following_training_steps`)."""
    lengths: list[int] | None = None
    """The sequence lengths of the micro-batch or step under way."""
    kernels: set[tuple[str, str]] = field(default_factory=set)
    """(dtype, kernel) pairs to add to what `recording_attention_kernels` saw."""

    def at(self, doing: str, lengths=None, step: int | None = None) -> None:
        self.doing = doing
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.step = step


@contextlib.contextmanager
def following_training_steps(progress: PartProgress):
    """Keep `progress.step` and `.lengths` on the step in-process training is running.

    `train(cfg)` builds its Trainer inside, so the one seam to watch is the class's per-step
    forward/backward; wrapped here for the duration only, and it changes nothing it passes on."""
    from recipe.training.trainer import Trainer

    original = Trainer.forward_backward_step

    def followed(trainer, work, *args, **kwargs):
        progress.step = trainer.step
        progress.lengths = [int(n) for n in work.lengths]
        return original(trainer, work, *args, **kwargs)

    Trainer.forward_backward_step = followed
    try:
        yield progress
    finally:
        Trainer.forward_backward_step = original


def _te_installed() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _need_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise Skip(f"Transformer Engine is not installed ({err})") from None
    return te


def _training_runs_on(device: torch.device) -> None:
    """Parts that train call `train(cfg)`, which computes where the environment says (a GPU
    where CUDA is, else the CPU): `device` must say the same."""
    from recipe.environment import cuda_available

    where = "cuda" if cuda_available() else "cpu"
    if device.type != where:
        raise ValueError(f"train() computes on {where} here; this part cannot train on {device}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


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


# --- versions --------------------------------------------------------------------------------


def check_versions(quick: bool, device: torch.device, progress: PartProgress) -> dict:
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
        "device": str(device),
    }


# --- te_backends -----------------------------------------------------------------------------


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
            f"({[type(r).__name__ for r in result]}); recipe.checks.gpu.te_selection reads "
            "three selection flags and a list of three available backends"
        )
    names = ("flash", "fused", "unfused")
    selected = next((n for n, flag in zip(names, flags) if flag), "none")
    return {"selected": selected, "available": [n for n, a in zip(names, available) if a]}


def check_te_backends(
    quick: bool, device: torch.device, progress: PartProgress, selector=None
) -> dict:
    """TE's own selection logic for the recipe's THD layout: bf16 and fp32, cp 1 and 2,
    deterministic or not. `selector`: the module holding `AttentionParams` and
    `get_attention_backend` (TE's attention/dot_product_attention/utils.py, the default)."""
    if selector is None:
        _need_te()
        from transformer_engine.pytorch.attention.dot_product_attention import utils as selector

    table = {}
    for dtype in (torch.bfloat16, torch.float32):
        for cp in (1, 2):
            for deterministic in (True, False):
                precision = str(dtype).removeprefix("torch.")
                key = f"{precision} thd cp={cp} deterministic={deterministic}"
                progress.at(f"asking for {key}")
                params = selector.AttentionParams(
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
                table[key] = te_selection(selector.get_attention_backend(params))
    bf16_ok = all(v["selected"] in ("flash", "fused") for k, v in table.items() if "bfloat" in k)
    return {"passed": bf16_ok, "ran": ran_with(), "selection": table}


# --- zigzag_vs_te ----------------------------------------------------------------------------


def zigzag_reference(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """The zigzag split written out sequence by sequence (TE's `thd_get_partitioned_indices`
    signature): each sequence is cut into 2 * cp_size equal chunks and rank r holds chunk r,
    then chunk 2 * cp_size - 1 - r, sequence after sequence; the global positions of those
    tokens in that order. The CPU's stand-in for TE's function, independent of the recipe's
    vectorised `zigzag_index`."""
    bounds = cu_seqlens_padded.tolist()
    if bounds[-1] != total_tokens:
        raise ValueError(f"the boundaries end at {bounds[-1]}, not at {total_tokens} tokens")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        for which in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + which * chunk, start + (which + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def check_zigzag_vs_te(
    quick: bool, device: torch.device, progress: PartProgress, partition=None
) -> dict:
    """`partition(cu_seqlens_padded, total_tokens, cp_size, cp_rank)`: the indices compared
    against (TE's `thd_get_partitioned_indices`, the default)."""
    from recipe.data.thd import cu_seqlens_from_lengths, padded_lengths
    from recipe.parallel.cp.zigzag import zigzag_index

    if partition is None:
        _need_te()
        import transformer_engine_torch as tex

        partition = tex.thd_get_partitioned_indices
    gen = torch.Generator().manual_seed(0)
    mismatches = 0
    cases = 0
    for cp in (2, 4, 8):
        lengths = torch.randint(1, 3000, (37,), generator=gen)
        padded = padded_lengths(lengths, 2 * cp)
        progress.at(f"cp={cp}", padded.tolist())
        cu = cu_seqlens_from_lengths(padded).to(device)
        total = int(padded.sum())
        for rank in range(cp):
            ours = zigzag_index(cu, cp, rank)
            theirs = partition(cu, total, cp, rank).to(device=ours.device, dtype=torch.int64)
            cases += 1
            mismatches += int(not torch.equal(ours, theirs))
    return {
        "passed": mismatches == 0 and cases > 0,
        "ran": ran_with(cp_sizes=[2, 4, 8]),
        "cases": cases,
        "mismatching_ranks": mismatches,
    }


# --- attention_vs_te -------------------------------------------------------------------------


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Attention over a packed stream as one dense masked product, by hand and in fp32: token i
    attends to token j when both are in the same sequence and j <= i; query head h reads key /
    value group h // (heads / groups). [T, heads, dim] x [T, groups, dim] -> [T, heads * dim]
    in the query's dtype. The CPU's stand-in for TE's attention: no SDPA, no per-sequence loop."""
    total, heads, dim = query.shape
    groups = key.shape[1]
    group_of_head = torch.arange(heads, device=query.device) // (heads // groups)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(query.device)
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=query.device), lengths)
    position = torch.arange(total, device=query.device)
    allowed = (sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None])
    q, k, v = query.float(), key.float()[:, group_of_head], value.float()[:, group_of_head]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.reshape(total, heads * dim).to(query.dtype)


def te_attention(heads: int, groups: int, dim: int):
    """TE's DotProductAttention for the packed stream, as `dense_causal_attention` is called."""
    te = _need_te()
    attention = te.DotProductAttention(
        heads, dim, num_gqa_groups=groups, qkv_format="thd", attn_mask_type="padding_causal"
    )

    def run(query, key, value, cu_seqlens):
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = attention(
            query,
            key,
            value,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        return out.reshape(query.shape[0], -1)

    return run


def packed_qkv(lengths, heads: int, groups: int, dim: int, dtype, device: torch.device):
    """Random q, k, v (leaves that want gradients) of a packed stream, and its boundaries."""
    from recipe.data.thd import cu_seqlens_from_lengths

    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(total, groups, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(total, groups, dim, device=device, dtype=dtype, generator=gen)
    cu = cu_seqlens_from_lengths(torch.tensor(lengths)).to(device)
    return [t.requires_grad_() for t in (q, k, v)], cu


def check_attention_vs_te(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    reference=None,
    lengths: list[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """The recipe's varlen attention against `reference(q, k, v, cu_seqlens) -> [T, heads*dim]`
    (TE's DotProductAttention, the default), outputs and the gradients of q, k, v."""
    heads, groups, dim = 8, 2, 64
    lengths = list(lengths or [512, 37, 1024, 128, 256])
    precision = str(dtype).removeprefix("torch.")
    if reference is None:
        reference = te_attention(heads, groups, dim)
        progress.kernels.add((precision, TE_KERNEL))
    progress.at("attention forward and backward", lengths)
    (q, k, v), cu = packed_qkv(lengths, heads, groups, dim, dtype, device)
    ours = varlen_causal_attention(q, k, v, cu)
    grads_ours = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
    theirs = reference(q, k, v, cu).reshape(ours.shape)
    grads_theirs = torch.autograd.grad(theirs.float().square().sum(), (q, k, v))
    out_rel = _rel(ours, theirs)
    grad_rel = max(_rel(a, b) for a, b in zip(grads_ours, grads_theirs))
    return {
        "passed": out_rel < RTOL_BF16 and grad_rel < RTOL_BF16,
        "ran": ran_with(precision=precision, ranks=1, lengths=lengths),
        "output_rel_l2": out_rel,
        "grad_rel_l2_max": grad_rel,
        "tolerance": RTOL_BF16,
    }


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
        cfgs = [_config(overrides + [f"model.attention_backend={b}"]) for b in backends]
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


def check_model_te_vs_torch(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    backends: tuple[str, str] = ("torch", "te"),
) -> dict:
    """`backends`: the reference's and the candidate's attention backend (on the CPU, torch
    against torch: the machinery, at 0 difference)."""
    if "te" in backends:
        _need_te()
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


# --- cp2_one_gpu -----------------------------------------------------------------------------


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


def train_recording_kernels(cfg) -> dict:
    """`train(cfg)` on this rank with the attention kernels it ran: {"history", "kernels"}."""
    from recipe.launch.rank import train

    with recording_attention_kernels() as seen:
        history = train(cfg)["history"]
    return {"history": history, "kernels": sorted(seen)}


@record
def _launched_rank(cfg) -> dict:
    """A rank the recipe's launcher started for `train_on_local_ranks`."""
    from recipe.log import quiet_libraries

    quiet_libraries()
    return train_recording_kernels(cfg)


def train_on_local_ranks(world_size: int, cfg) -> dict:
    """`train_recording_kernels(cfg)` on `world_size` ranks the recipe's launcher starts on this
    machine (this process when 1); rank 0's result."""
    from recipe.launch.local import launch_world

    if world_size == 1:
        return train_recording_kernels(cfg)
    return launch_world(cfg, entrypoint=_launched_rank)


def cp2_against_cp1(
    overrides: list[str],
    token_atol: float,
    folder: Path,
    steps: int = 2,
    run_world: Callable[[int, object], dict] = train_on_local_ranks,
    progress: PartProgress | None = None,
) -> dict:
    """Train `steps` steps at cp=2 (two ranks) and cp=1, recording every token's loss at the
    first and last step, and compare them token by token (recipe.compare.tokens).
    `run_world(world_size, cfg)`: `train_recording_kernels(cfg)` on that many ranks, rank 0's
    result (`train_on_local_ranks`; the tests' pooled worlds)."""
    from recipe.compare.tokens import compare_token_records

    progress = progress or PartProgress()
    common = [f"trainer.max_steps={steps}", f"trainer.record_tokens=[1,{steps}]"]
    history = {}
    for cp in (1, 2):
        cfg = _config(common + overrides + [f"cp={cp}"])
        cfg.output_dir = str(folder / f"cp{cp}")
        progress.at(f"training {steps} steps at cp={cp} ({' '.join(overrides)})")
        with following_training_steps(progress):  # the cp=1 run is this process's
            result = run_world(cfg.world_size, cfg)
        history[cp] = result["history"]
        progress.kernels.update(tuple(pair) for pair in result["kernels"])
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


def check_cp2_one_gpu(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    run_world: Callable[[int, object], dict] = train_on_local_ranks,
) -> dict:
    """cp=2 on two ranks sharing the GPU against cp=1, per token: the recipe's all-gather
    attention (and TE's ring attention where NCCL allows) with real collectives on a GPU. On
    the CPU: two gloo ranks, the torch backend."""
    from recipe.names import FP32_TOKEN_ATOL

    _training_runs_on(device)
    cuda = device.type == "cuda"
    if cuda:
        route, why = sharing_route(nccl_version())
    else:
        route, why = "gloo", "CPU ranks: gloo collectives"
    variants = {
        "torch fp32": (["model.attention_backend=torch", "trainer.precision=fp32"], FP32_TOKEN_ATOL)
    }
    skipped = {}
    if not cuda:
        skipped["te bf16"] = "no CUDA"
    elif not _te_installed():
        skipped["te bf16"] = "Transformer Engine is not installed"
    elif route != "nccl":
        skipped["te bf16"] = "TE's CP attention exchanges K/V by NCCL send/recv: " + why
    else:
        variants["te bf16"] = (
            ["model.attention_backend=te", "trainer.precision=bf16"],
            TOKEN_ATOL_BF16,
        )
        progress.kernels.add(("bfloat16", TE_KERNEL))
    sharing = {"RECIPE_GPU_SHARING": route} if cuda else {}
    results = {}
    with tempfile.TemporaryDirectory() as tmp, _environment(**sharing):
        for name, (overrides, atol) in variants.items():
            folder = Path(tmp) / name.replace(" ", "_")
            results[name] = cp2_against_cp1(
                overrides, atol, folder, run_world=run_world, progress=progress
            )
    return {
        "passed": all(r.pop("passed") for r in results.values()),
        "ran": ran_with(ranks=2, gpus=1 if cuda else 0, route=route, why=why),
        **results,
        "skipped": skipped,
    }


# --- host_syncs ------------------------------------------------------------------------------


HOST_READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")
"""The tensor methods that copy a value to the host: on a GPU each waits for the queued work."""


RECIPE_SOURCES = str(Path(recipe.__file__).parent) + os.sep


def code_owner(filename: str) -> str:
    """Whose code a frame's file is: "recipe", "megatron" or "other"."""
    if filename.startswith(RECIPE_SOURCES):
        return "recipe"
    return "megatron" if f"{os.sep}megatron{os.sep}" in filename else "other"


@contextlib.contextmanager
def counting_host_reads():
    """Count the host reads of tensors (`HOST_READS`) made while open, by whose code made them
    (the direct caller's file: `code_owner`): on a GPU each is a synchronisation, so this is the
    CPU's count of what `counting_cuda_syncs` counts on a GPU. Yields the counts."""
    counts = {"recipe": 0, "megatron": 0, "other": 0}
    missing = object()
    own = {name: torch.Tensor.__dict__.get(name, missing) for name in HOST_READS}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts[code_owner(sys._getframe(1).f_code.co_filename)] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    try:
        yield counts
    finally:
        for name, attribute in own.items():
            if attribute is missing:
                delattr(torch.Tensor, name)  # inherited again from torch's C base
            else:
                setattr(torch.Tensor, name, attribute)


@contextlib.contextmanager
def counting_cuda_syncs():
    """Count the synchronising CUDA calls made while open (torch's sync debug mode), by whose
    code made them (the innermost Python frame: `code_owner`). The counts are filled in when
    the context closes."""
    counts = {"recipe": 0, "megatron": 0, "other": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            counts[code_owner(warning.filename)] += 1


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
    cfg = _config(overrides + [f"model.num_layers={num_layers}"])
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
        _need_te()
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


# --- bf16_vs_fp32 ----------------------------------------------------------------------------


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


def check_bf16_vs_fp32(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    steps: int | None = None,
    backend: str = "torch",
) -> dict:
    from recipe.launch.rank import train

    _training_runs_on(device)
    steps = steps or (10 if quick else 30)
    common = [f"trainer.max_steps={steps}", f"model.attention_backend={backend}"]
    runs = {}
    with following_training_steps(progress):
        for precision in ("fp32", "bf16"):
            progress.at(f"training {steps} steps in {precision}")
            cfg = _config(common + [f"trainer.precision={precision}"])
            runs[precision] = [h["lm_loss"] for h in train(cfg)["history"]]
    return {
        **bf16_verdict(runs["fp32"], runs["bf16"]),
        "ran": ran_with(backend=backend, ranks=1, steps=steps),
        "final": {p: r[-1] for p, r in runs.items()},
    }


# --- mfu_1b ----------------------------------------------------------------------------------


def check_mfu_1b(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    overrides: list[str] | None = None,
    warmup_steps: int = MFU_WARMUP_STEPS,
    timed_steps: int | None = None,
    backend: str | None = None,
) -> dict:
    """`overrides`: the model and step in place of the 1B preset's (`ONE_B`), on top of SMALL
    (the CPU's tiny run; pass trainer.peak_tflops where the GPU is not in the table)."""
    from recipe.launch.rank import train

    _training_runs_on(device)
    backend = backend or ("te" if _te_installed() else "torch")
    if backend == "te":
        progress.kernels.add(("bfloat16", TE_KERNEL))
    timed = timed_steps or (3 if quick else MFU_TIMED_STEPS)
    common = [
        "trainer.precision=bf16",
        "trainer.deterministic=false",
        f"model.attention_backend={backend}",
        f"trainer.max_steps={warmup_steps + timed}",
    ]
    if overrides is None:
        cfg = _config(ONE_B + common, small=False)
    else:
        cfg = _config(overrides + common)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    progress.at(f"training {warmup_steps} + {timed} steps")
    with following_training_steps(progress):
        history = train(cfg)["history"][warmup_steps:]
    mfu = [h.get("mfu") for h in history]
    if not mfu or any(m is None for m in mfu):
        raise Skip("the GPU's peak is not in the table; pass trainer.peak_tflops to measure MFU")
    return {
        "passed": True,
        "ran": ran_with(
            backend=backend,
            precision="bf16 autocast, fp32 weights",
            deterministic=False,
            ranks=1,
            layers=cfg.model.num_layers,
            hidden_size=cfg.model.hidden_size,
            cudnn=torch.backends.cudnn.version() if cuda else None,
            nccl=_dotted(nccl_version()),
        ),
        "mfu_median": statistics.median(mfu),
        "mfu_min": min(mfu),
        "mfu_max": max(mfu),
        "tokens_per_s_median": statistics.median(h["tokens_per_s"] for h in history),
        "step_time_s_median": statistics.median(h["step_time_s"] for h in history),
        "steps_timed": len(history),
        "warmup_steps": warmup_steps,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
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


# --- running the parts -----------------------------------------------------------------------


def kernel_table(seen) -> dict[str, list[str]]:
    """(dtype, kernel) pairs as {dtype: [kernels]}, sorted: how the report shows them."""
    table: dict[str, list[str]] = {}
    for dtype, kernel in sorted(set(seen)):
        table.setdefault(dtype, []).append(kernel)
    return table


def kernel_problem(kernels: dict[str, list[str]], device: torch.device) -> str | None:
    """On CUDA, bf16 attention must run in a fused kernel (flash, memory-efficient, cuDNN or
    TE's): torch's math kernel there means SDPA was given inputs the fused ones refuse (3-D
    tensors did exactly that, without a word). On the CPU the kernel is recorded, not gated."""
    if device.type == "cuda" and MATH_KERNEL in kernels.get("bfloat16", []):
        return (
            "bf16 attention took torch's math kernel on CUDA; the fused kernels refused the "
            "inputs (4-D [batch, heads, tokens, dim], head size, alignment, mask)"
        )
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def out_of_memory_report(progress: PartProgress, device: torch.device) -> dict:
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return {
        "device": str(device),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "doing": progress.doing,
        "step": progress.step,
        "lengths": progress.lengths,
    }


def run_part(name: str, part, device: torch.device, quick: bool = False, **options) -> dict:
    """One part, `part(quick, device, progress, **options)`, as the report shows it: status
    (info for a part without a verdict), its results, the attention kernels it ran, its time and
    (on CUDA) peak memory. A Skip is "skipped" with the reason; an out-of-memory error is a
    failure with the peak memory and where the part was; any other error a failure with its
    traceback; on CUDA a bf16 attention on the math kernel fails a part that passed."""
    progress = PartProgress()
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    out_of_memory = False
    with recording_attention_kernels() as seen:
        try:
            result = part(quick, device, progress, **options)
        except Skip as why:
            entry = {"status": "skipped", "reason": str(why)}
        except torch.OutOfMemoryError as err:  # torch.cuda.OutOfMemoryError is this class
            out_of_memory = True
            entry = {
                "status": "fail",
                "reason": f"out of memory: {_first_line(err)}",
                "out_of_memory": out_of_memory_report(progress, device),
                "traceback": traceback.format_exc(limit=-10),  # innermost: which operation asked
            }
        except Exception as err:  # a part that crashed is a failure, with its traceback
            entry = {
                "status": "fail",
                "reason": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=-10),  # the innermost frames
            }
        else:
            passed = result.pop("passed", None)
            status = "info" if passed is None else "pass" if passed else "fail"
            entry = {"status": status, **result}
    entry["attention_kernels"] = kernels = kernel_table(seen | progress.kernels)
    problem = kernel_problem(kernels, device)
    if problem:
        entry["kernel_problem"] = problem
        if entry["status"] in ("pass", "info"):
            entry["status"], entry["reason"] = "fail", problem
    if cuda:
        entry["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    entry["seconds"] = round(time.perf_counter() - start, 2)
    if out_of_memory:  # give the next part the memory the failed one held
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return entry


def write_report(out: Path, report: dict) -> None:
    """report.json and report.md, each replaced whole (a run stopped mid-write leaves the
    previous complete file)."""
    texts = {
        "report.json": json.dumps(report, indent=2, default=str) + "\n",
        "report.md": render_markdown(report),
    }
    for name, text in texts.items():
        unfinished = out / f"{name}.writing"
        unfinished.write_text(text)
        os.replace(unfinished, out / name)


def run_checks(
    quick: bool,
    only: list[str] | None = None,
    out: Path | None = None,
    device: torch.device | None = None,
    checks: dict | None = None,
) -> dict:
    """Every part of `checks` (CHECKS) or those named in `only` (versions always), on `device`
    (the GPU where CUDA is; without it every part after versions is skipped with "no CUDA").
    With `out`, the report is rewritten there before and after every part."""
    from recipe.megatron.cpu_patches import install_cpu_patches
    from recipe.model.numerics import apply_determinism

    checks = CHECKS if checks is None else checks
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    install_cpu_patches()
    # Before any CUDA work: megatron's TE layers refuse deterministic_mode unless
    # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 is already set when they are built.
    apply_determinism(True)
    names = [n for n in checks if not only or n in only or n == "versions"]
    report: dict[str, dict] = {name: {"status": "pending"} for name in names}

    def save():
        if out is not None:
            write_report(out, report)

    for name in names:
        if device is None and name != "versions":
            report[name] = {"status": "skipped", "reason": "no CUDA"}
            continue
        report[name] = {"status": "running", "since": time.strftime("%H:%M:%S")}
        save()
        where = device if device is not None else torch.device("cpu")  # versions, without CUDA
        try:
            # per part: torch elastic's launcher (cp2_one_gpu's ranks) installs its own handler
            with stopping_on_sigterm():
                report[name] = run_part(name, checks[name], where, quick)
        except StoppedBySignal as stop:
            report[name] = {"status": "fail", "reason": f"{stop} while this part ran"}
            save()
            raise
        finally:
            apply_determinism(True)  # mfu_1b turns it off; a later part must not inherit that
        save()
    save()
    return report


STATUS_NOTES = {
    "pending": "not reached: the run stopped before this part",
    "running": "still running when the report was last written: if the run is over, this part "
    "did not finish (stopped by the time limit, or the process died)",
}


def render_markdown(report: dict) -> str:
    lines = ["# GPU check", "", "| part | status | details |", "|---|---|---|"]
    for name, result in report.items():
        details = {k: v for k, v in result.items() if k not in ("status", "traceback")}
        if result["status"] in STATUS_NOTES:
            details["note"] = STATUS_NOTES[result["status"]]
        lines.append(f"| {name} | {result['status']} | `{json.dumps(details, default=str)}` |")
    if any(result.get("reason") == "no CUDA" for result in report.values()):
        lines += ["", "No CUDA on this machine: nothing but the versions was checked."]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def stopping_on_sigterm():
    """SIGTERM (the time cap's first signal) raises StoppedBySignal, so the part under way is
    reported as stopped before the process ends. Only the main thread can take signals: from
    another thread this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise StoppedBySignal(signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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
    try:
        report = run_checks(args.quick, only, out)
    except StoppedBySignal as stop:
        print(f"{stop}: the report so far is in {out / 'report.json'}", file=sys.stderr)
        return 128 + stop.signum
    print(render_markdown(report))
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    return 1 if any(r["status"] == "fail" for r in report.values()) else 0
