"""The independent torch references the GPU check parts compare against on the CPU, in place
of Transformer Engine's functions: `zigzag_reference` (TE's `thd_get_partitioned_indices`) and
`dense_causal_attention` (TE's DotProductAttention)."""

from __future__ import annotations

import math

import torch


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
