"""The GPU check parts that hold the recipe's attention pieces against Transformer Engine's:
te_backends (TE's backend selection for the THD layout), zigzag_vs_te (the zigzag index against
TE's partition) and attention_vs_te (the varlen attention against TE's DotProductAttention);
and real_offsets (the torch backend given real offsets beside padded ones, as Megatron-Bridge's
packed SFT passes them, against a dense reference over the real tokens alone)."""

from __future__ import annotations

import torch

from recipe.checks.gpu.shared import (
    RTOL_BF16,
    TE_KERNEL,
    PartProgress,
    need_te,
    ran_with,
    rel_l2,
)
from recipe.model.attention import varlen_causal_attention

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
        need_te()
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


def check_zigzag_vs_te(
    quick: bool, device: torch.device, progress: PartProgress, partition=None
) -> dict:
    """`partition(cu_seqlens_padded, total_tokens, cp_size, cp_rank)`: the indices compared
    against (TE's `thd_get_partitioned_indices`, the default)."""
    from recipe.data.thd import cu_seqlens_from_lengths, padded_lengths
    from recipe.parallel.cp.zigzag import zigzag_index

    if partition is None:
        need_te()
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


def te_attention(heads: int, groups: int, dim: int):
    """TE's DotProductAttention for the packed stream, as `dense_causal_attention` is called."""
    te = need_te()
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
    out_rel = rel_l2(ours, theirs)
    grad_rel = max(rel_l2(a, b) for a, b in zip(grads_ours, grads_theirs))
    return {
        "passed": out_rel < RTOL_BF16 and grad_rel < RTOL_BF16,
        "ran": ran_with(precision=precision, ranks=1, lengths=lengths),
        "output_rel_l2": out_rel,
        "grad_rel_l2_max": grad_rel,
        "tolerance": RTOL_BF16,
    }


# --- real_offsets ----------------------------------------------------------------------------


def check_real_offsets(
    quick: bool,
    device: torch.device,
    progress: PartProgress,
    reference=None,
    lengths: list[int] | None = None,
    alignment: int = 8,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """The torch backend with real offsets in cu_seqlens_q and padded ones in cu_seqlens_q_padded
    (convention=bridge@0.6.2): each sequence's real rows against `reference(q, k, v, cu_seqlens)`
    over the real tokens alone (default: the dense fp32 product), outputs and gradients; its
    padded rows exactly zero and its padded keys without gradient (padding contributes
    nothing, as Transformer Engine's THD attention is documented to treat it)."""
    from recipe.checks.gpu.references import dense_causal_attention
    from recipe.data.thd import cu_seqlens_from_lengths, length_of_each_slot, padded_lengths

    heads, groups, dim = 8, 2, 64
    real = torch.tensor(list(lengths or [509, 37, 1021, 128, 250]))
    padded = padded_lengths(real, alignment)
    reference = reference or dense_causal_attention
    precision = str(dtype).removeprefix("torch.")
    progress.at("attention with real offsets, forward and backward", real.tolist())
    (q, k, v), cu_padded = packed_qkv(padded.tolist(), heads, groups, dim, dtype, device)
    cu_real = cu_seqlens_from_lengths(real).to(device)
    # the slots of the padded stream that hold a real token: each sequence's first `real` ones
    slot_in_sequence = torch.arange(int(padded.sum())) - torch.repeat_interleave(
        cu_padded.cpu()[:-1].long(), padded
    )
    is_real = (slot_in_sequence < length_of_each_slot(cu_real.cpu(), cu_padded.cpu())).to(device)
    ours = varlen_causal_attention(q, k, v, cu_padded, cu_seqlens=cu_real)
    grads_ours = torch.autograd.grad(ours[is_real].float().square().sum(), (q, k, v))
    rows = [t[is_real] for t in (q, k, v)]
    theirs = reference(*rows, cu_real)
    grads_theirs = torch.autograd.grad(theirs.float().square().sum(), (q, k, v))
    out_rel = rel_l2(ours[is_real], theirs)
    grad_rel = max(rel_l2(a[is_real], b[is_real]) for a, b in zip(grads_ours, grads_theirs))
    padded_rows_zero = bool((ours[~is_real] == 0).all())
    padded_keys_still = all(bool((g[~is_real] == 0).all()) for g in grads_ours[1:])
    return {
        "passed": out_rel < RTOL_BF16
        and grad_rel < RTOL_BF16
        and padded_rows_zero
        and padded_keys_still,
        "ran": ran_with(precision=precision, ranks=1, lengths=real.tolist()),
        "output_rel_l2": out_rel,
        "grad_rel_l2_max": grad_rel,
        "padded_rows_zero": padded_rows_zero,
        "padded_keys_without_gradient": padded_keys_still,
        "tolerance": RTOL_BF16,
    }
