"""One variable-length attention call per layer: the plan of which query rows attend to which keys.

The per-sequence path (`attention.varlen_causal_attention`) calls SDPA once per packed sequence,
a Python loop in every layer. A varlen kernel (`torch.nn.attention.varlen.varlen_attn`, flash
attention's `cu_seqlens` interface) takes every sequence in one call instead: queries and keys
packed entry after entry, with their cumulative lengths. Each entry here is one contiguous run of
this rank's query rows and the keys it attends to:

- cp = 1: one entry per sequence, its real rows against its real keys;
- cp > 1: one entry per zigzag chunk (rank r holds chunks r and 2*cp-1-r of every sequence), its
  real rows against its sequence's keys from the first up to the chunk's last real position.

The kernel's causal mask with fewer queries than keys aligns the last query with the last key
(flash attention's bottom-right convention, `window_size=(-1, 0)`), so query j of a chunk that
starts at position c0 sees keys 0..c0+j: exactly `k_pos <= q_pos`. Rows that no entry covers
(padding past a sequence's real length, under real offsets) output zero, as on the per-sequence
path. The plan is pure host arithmetic on the boundaries, computed once per micro-batch; on the
CPU (and in fp32) `attend_by_plan_reference` runs it one entry at a time through SDPA: the test
of the plan against the per-sequence path, and what a device without the kernel falls back to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class VarlenPlan:
    """What one varlen call needs for one micro-batch on one rank."""

    query_rows: torch.Tensor
    """int64: the local query rows fed to the kernel, entry after entry."""
    key_rows: torch.Tensor
    """int64: the rows of the global (all-gathered, global-order) K/V, entry after entry."""
    cu_seqlens_q: torch.Tensor
    """int32 [entries + 1]: where each entry's queries start in the packed queries."""
    cu_seqlens_k: torch.Tensor
    """int32 [entries + 1]: where each entry's keys start in the packed keys."""
    max_q: int
    max_k: int
    local_rows: int
    """Rows of this rank's output; those no entry covers are zero."""
    covers_every_row: bool
    """The query rows are 0..local_rows-1 in order: no gather, no scatter needed."""

    @property
    def entries(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def _chunks(length: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """(first position, end position) of this rank's chunks of one padded sequence, in the order
    its rows are stored locally: chunk r, then chunk 2*cp-1-r (`parallel/cp/zigzag.py`)."""
    if cp_size == 1:
        return [(0, length)]
    size = length // (2 * cp_size)
    front, back = cp_rank, 2 * cp_size - 1 - cp_rank
    return [(front * size, (front + 1) * size), (back * size, (back + 1) * size)]


def varlen_plan(
    bounds: list[int],
    cp_size: int = 1,
    cp_rank: int = 0,
    real_lengths: list[int] | None = None,
    device: torch.device | str | None = None,
) -> VarlenPlan:
    """The plan for a packed stream with global padded boundaries `bounds` (a host list) on rank
    `cp_rank` of `cp_size`; `real_lengths`: each sequence's real length where real offsets
    differ from the padded ones (`attention.StreamLayout.real_lengths`), else None."""
    query_rows: list[range] = []
    key_rows: list[range] = []
    q_lengths: list[int] = []
    k_lengths: list[int] = []
    local_start = 0
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        length = end - start
        if cp_size > 1 and length % (2 * cp_size):
            raise ValueError(
                f"padded length of sequence {i} is {length}, not a multiple of "
                f"2*cp_size={2 * cp_size}"
            )
        real = length if real_lengths is None else real_lengths[i]
        row = local_start
        for first, last in _chunks(length, cp_size, cp_rank):
            queries = min(last, real) - first
            if queries > 0:
                query_rows.append(range(row, row + queries))
                key_rows.append(range(start, start + first + queries))
                q_lengths.append(queries)
                k_lengths.append(first + queries)
            row += last - first
        local_start = row
    flat_q = [r for rows in query_rows for r in rows]
    as_index = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    cumulative = lambda lengths: torch.tensor(  # noqa: E731
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()] if lengths else [0],
        dtype=torch.int32,
        device=device,
    )
    return VarlenPlan(
        query_rows=as_index(flat_q),
        key_rows=as_index([r for rows in key_rows for r in rows]),
        cu_seqlens_q=cumulative(q_lengths),
        cu_seqlens_k=cumulative(k_lengths),
        max_q=max(q_lengths, default=0),
        max_k=max(k_lengths, default=0),
        local_rows=local_start,
        covers_every_row=flat_q == list(range(local_start)),
    )


def _scatter(packed: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
    """The packed outputs put back on this rank's rows, zero where no entry covers."""
    if plan.covers_every_row:
        return packed
    out = packed.new_zeros(plan.local_rows, *packed.shape[1:])
    return out.index_copy(0, plan.query_rows.to(packed.device), packed)


def _packed_inputs(query, key, value, plan: VarlenPlan):
    keys = plan.key_rows.to(key.device)
    q = query if plan.covers_every_row else query.index_select(0, plan.query_rows.to(query.device))
    return q, key.index_select(0, keys), value.index_select(0, keys)


def attend_by_plan_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: VarlenPlan,
    scale: float | None = None,
) -> torch.Tensor:
    """The plan run one entry at a time through SDPA with the bottom-right causal mask: what the
    varlen kernel computes, on any device and dtype. query `[t_local, heads, dim]`, key/value
    the global stream `[t_global, groups, dim]`; returns `[t_local, heads, dim]`."""
    heads, groups = query.shape[1], key.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} key/value groups")
    q, k, v = _packed_inputs(query, key, value, plan)
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
    outputs = []
    for e in range(plan.entries):
        qe = q[cu_q[e] : cu_q[e + 1]].transpose(0, 1).unsqueeze(0)
        ke = k[cu_k[e] : cu_k[e + 1]].transpose(0, 1).unsqueeze(0)
        ve = v[cu_k[e] : cu_k[e + 1]].transpose(0, 1).unsqueeze(0)
        nq, nk = qe.shape[2], ke.shape[2]
        if nq == nk:
            out = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale)
        else:  # the kernel's alignment: query j sees keys up to nk - nq + j
            mask = torch.ones(nq, nk, dtype=torch.bool, device=qe.device).tril(nk - nq)
            out = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask, scale=scale)
        outputs.append(out.squeeze(0).transpose(0, 1))
    if not outputs:
        return query.new_zeros(plan.local_rows, heads, value.shape[-1])
    return _scatter(torch.cat(outputs), plan)


def varlen_kernel():
    """torch's `varlen_attn` (flash attention's cu_seqlens interface), or None where this torch
    has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kernel_arguments(kernel, heads: int, groups: int) -> tuple[dict, bool]:
    """(the keyword arguments that make `kernel` causal and share K/V groups, whether K/V must
    be expanded to every head first), read from its signature: torch 2.14 takes
    `window_size=(-1, 0)` for causal (`is_causal = window_size == (-1, 0)` in its body; cuDNN is
    taken only for a full window, so a causal call always runs flash attention) and
    `enable_gqa`; a torch whose varlen_attn has `is_causal` and no `enable_gqa` gets those."""
    import inspect

    parameters = inspect.signature(kernel).parameters
    arguments = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    expand = heads != groups and "enable_gqa" not in parameters
    if heads != groups and not expand:
        arguments["enable_gqa"] = True
    return arguments, expand


def attend_by_plan(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: VarlenPlan,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    kernel=None,
) -> torch.Tensor:
    """The plan in ONE varlen kernel call: query `[t_local, heads, dim]`, key/value the global
    stream `[t_global, groups, dim]`, computed in `dtype` (autocast does not reach a custom op:
    the caller passes autocast's dtype); returns `[t_local, heads, dim]`."""
    kernel = kernel or varlen_kernel()
    heads, groups = query.shape[1], key.shape[1]
    arguments, expand = kernel_arguments(kernel, heads, groups)
    q, k, v = _packed_inputs(query, key, value, plan)
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if expand:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    if plan.entries == 0:
        return q.new_zeros(plan.local_rows, heads, value.shape[-1])
    out = kernel(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_q, plan.max_k,
                 scale=scale, **arguments)  # fmt: skip
    return _scatter(out, plan)
