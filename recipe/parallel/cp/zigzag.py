"""Zigzag context-parallel sharding of packed THD streams as pure index arithmetic.

Rank r keeps chunks r and 2*cp-1-r of every padded sequence; instead of slicing sequence by
sequence (verl's ``preprocess_thd``, kept as a reference in ``verl.py``), we turn 2*n per-chunk
offsets into the global index of every local token with one cumsum and gather all per-token
tensors with it, so the cost no longer grows with the number of sequences. The trade-off is that
per-token tensors are first built on the whole global stream, so each rank briefly holds T rather
than T/cp tokens of them; ranks and sizes are plain arguments (no torch.distributed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must satisfy 0 <= cp_rank < cp_size={cp_size}, got {cp_rank}")


def padded_seqlens(cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """Validated per-sequence padded lengths (int64)."""
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 1:
        shape = tuple(cu_seqlens_padded.shape)
        raise ValueError(f"cu_seqlens_padded must be a 1-D tensor [n+1], got shape {shape}")
    cu = cu_seqlens_padded.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0, got {int(cu[0])}")
    lengths = cu.diff()
    if bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0])
        raise ValueError(
            f"cu_seqlens_padded must be non-decreasing; sequence {i} has length {int(lengths[i])}"
        )
    if cp_size > 1:
        remainder = lengths % (2 * cp_size)
        if bool(remainder.any()):
            i = int(remainder.nonzero()[0])
            raise ValueError(
                f"padded length of sequence {i} is {int(lengths[i])}, not a multiple of "
                f"2*cp_size={2 * cp_size}"
            )
    return lengths


def _interleave(a: Tensor, b: Tensor) -> Tensor:
    return torch.stack((a, b), dim=1).reshape(-1)


def _arange_plus_segment_shift(shifts: Tensor, starts: Tensor, total: int) -> Tensor:
    """arange(total) + shifts[s] on segment s, where segment s begins at the sorted starts[s].

    Inside a CP chunk global and local offsets advance together, so either one is the other plus
    a per-chunk constant. Writing only the 2n changes of that constant and taking one cumsum
    touches each token twice (fill, cumsum), cheaper than repeat_interleave + arange + add.
    Empty segments share a start with the next one; their jumps telescope away in the sum.
    """
    # One spare slot absorbs the jumps of trailing empty segments, which start at ``total``.
    delta = torch.ones(total + 1, dtype=torch.int64, device=shifts.device)
    delta[0] = 0
    delta.index_add_(0, starts, torch.diff(shifts, prepend=shifts.new_zeros(1)))
    return delta[:total].cumsum_(0)


def zigzag_index(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Global indices of ``cp_rank``'s tokens in local order (int64, length total / cp_size)."""
    check_cp(cp_size, cp_rank)
    lengths = padded_seqlens(cu_seqlens_padded, cp_size)
    total = int(cu_seqlens_padded[-1])
    if cp_size == 1:
        return torch.arange(total, dtype=torch.int64, device=cu_seqlens_padded.device)

    chunk = lengths // (2 * cp_size)
    seq_start = cu_seqlens_padded[:-1].to(torch.int64)
    local_start = seq_start // cp_size
    front_shift = seq_start - local_start + cp_rank * chunk
    # The back chunk sits one chunk further along locally than chunk 2cp-1-r's global offset says.
    back_shift = seq_start - local_start + (2 * cp_size - 2 - cp_rank) * chunk
    return _arange_plus_segment_shift(
        _interleave(front_shift, back_shift),
        _interleave(local_start, local_start + chunk),
        total // cp_size,
    )


def shard_tensors(
    tensors: Mapping[str, Tensor],
    index: Tensor,
    token_dims: Mapping[str, int] | None = None,
) -> dict[str, Tensor]:
    """Gather every tensor along its token dimension with one shared ``index``.

    The token dimension is 0 unless ``token_dims`` names another one (e.g.
    ``{"position_ids": -1}`` for a [3, T] mrope tensor); it is explicit rather than guessed from
    sizes because a batch could legitimately have T equal to another dimension.
    """
    token_dims = token_dims or {}
    unknown = set(token_dims) - set(tensors)
    if unknown:
        raise ValueError(f"token_dims names tensors that are not given: {sorted(unknown)}")
    return {
        name: tensor.index_select(token_dims.get(name, 0), index)
        for name, tensor in tensors.items()
    }


def global_to_gathered_index(cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """For each global token, its position in the concatenation of all ranks' local streams."""
    lengths = padded_seqlens(cu_seqlens_padded, cp_size)
    total = int(cu_seqlens_padded[-1])
    local_total = total // cp_size
    chunk_len = lengths // (2 * cp_size)
    n_chunks = 2 * cp_size
    # Global chunk k of a sequence lives on rank k (front) for k < cp, else on rank 2cp-1-k (back).
    k = torch.arange(n_chunks, dtype=torch.int64, device=cu_seqlens_padded.device)
    owner = torch.where(k < cp_size, k, n_chunks - 1 - k)
    back = (k >= cp_size).to(torch.int64)
    seq_start = cu_seqlens_padded[:-1].to(torch.int64)
    dest_start = owner * local_total + (seq_start // cp_size)[:, None] + back * chunk_len[:, None]
    src_start = seq_start[:, None] + k * chunk_len[:, None]
    # Segments are the global chunks in global order, so their starts are sorted as required.
    return _arange_plus_segment_shift(
        (dest_start - src_start).reshape(-1), src_start.reshape(-1), total
    )


def unshard(
    local_tensors: Sequence[Tensor], cu_seqlens_padded: Tensor, cp_size: int, token_dim: int = 0
) -> Tensor:
    """Reassemble the global stream from every rank's local tensor (``local_tensors[r]``)."""
    check_cp(cp_size, 0)
    if len(local_tensors) != cp_size:
        raise ValueError(
            f"expected one local tensor per rank ({cp_size}), got {len(local_tensors)}"
        )
    total = int(cu_seqlens_padded[-1])
    local_total = total // cp_size
    for rank, tensor in enumerate(local_tensors):
        if tensor.size(token_dim) != local_total:
            raise ValueError(
                f"rank {rank} tensor has {tensor.size(token_dim)} tokens on dim {token_dim}, "
                f"expected total/cp_size = {local_total}"
            )
    if cp_size == 1:
        padded_seqlens(cu_seqlens_padded, cp_size)
        return local_tensors[0].clone()
    flat = torch.cat(list(local_tensors), dim=token_dim)
    return flat.index_select(token_dim, global_to_gathered_index(cu_seqlens_padded, cp_size))


def real_token_mask(
    cu_seqlens: Tensor, cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int
) -> Tensor:
    """True for ``cp_rank``'s local tokens that are real (not end-of-sequence padding)."""
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_padded "
            f"{tuple(cu_seqlens_padded.shape)} must have the same shape"
        )
    index = zigzag_index(cu_seqlens_padded, cp_size, cp_rank)
    padded = cu_seqlens_padded.to(torch.int64).diff()
    real = cu_seqlens.to(torch.int64).diff()
    too_long = (real > padded).nonzero()
    if too_long.numel():
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has real length {int(real[i])} > padded length {int(padded[i])}"
        )
    # A token is real when its global offset lies before the end of its sequence's real tokens.
    # Padding sits at the end, so "real end" per sequence is start + L, expanded per local token.
    local_lengths = padded // cp_size
    real_end = torch.repeat_interleave(
        cu_seqlens_padded[:-1].to(torch.int64) + real, local_lengths, output_size=index.numel()
    )
    return index < real_end


def index_preprocess(
    input_ids: Tensor, position_ids: Tensor, cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int
) -> tuple[Tensor, Tensor]:
    """The index path with verl_preprocess's interface: shard global (input_ids, position_ids).

    Unlike verl, padding tokens keep the values of the global stream (position_ids keep counting),
    so compare the two on real tokens only (see ``real_token_mask``).
    """
    index = zigzag_index(cu_seqlens_padded, cp_size, cp_rank)
    return input_ids.index_select(0, index), position_ids.index_select(0, index)


def local_token_identity(
    cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int
) -> tuple[Tensor, Tensor, Tensor]:
    """For each of `cp_rank`'s local slots: its sequence, its position in that (padded)
    sequence, and its zigzag chunk (0 .. 2*cp-1; at cp=1 every slot is chunk 0). Derived from the
    index, never from position_ids, so it stays right when a preprocessing function is wrong."""
    index = zigzag_index(cu_seqlens_padded, cp_size, cp_rank)
    cu = cu_seqlens_padded.to(torch.int64)
    sequence = torch.searchsorted(cu[1:], index, right=True)
    position = index - cu[sequence]
    chunk_len = (cu.diff() // (2 * cp_size)).clamp(min=1) if cp_size > 1 else cu.diff()
    chunk = position // chunk_len[sequence] if cp_size > 1 else torch.zeros_like(position)
    return sequence, position, chunk
