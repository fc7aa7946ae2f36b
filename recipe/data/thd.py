"""Lengths and offsets of packed THD streams: the one home of alignment padding arithmetic.

A packed stream lays whole sequences end to end, each padded at its end to a multiple of the
alignment (2*cp*tp under context parallelism), and describes them by cumulative offsets with a
leading 0 (`cu_seqlens`). Batching counts budgets with `aligned_length`, packing and the CP index
math with the tensor forms, so all of them agree on where every sequence starts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def aligned_length(length: int, alignment: int) -> int:
    """One sequence's length rounded up to a multiple of ``alignment``."""
    return math.ceil(length / alignment) * alignment


def padded_lengths(lengths: Tensor, alignment: int) -> Tensor:
    """Round every length up to a multiple of ``alignment`` (2 * cp for zigzag CP)."""
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be non-negative, got min {int(lengths.min())}")
    return (lengths + alignment - 1) // alignment * alignment


def cu_seqlens_from_lengths(lengths: Tensor) -> Tensor:
    """Cumulative offsets with a leading 0; int32 because the attention kernels take int32."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1).to(torch.int64), dim=0, out=offsets[1:])
    if int(offsets[-1]) > torch.iinfo(torch.int32).max:
        raise ValueError(f"total length {int(offsets[-1])} does not fit in int32 cu_seqlens")
    return offsets.to(torch.int32)


def length_of_each_slot(cu_seqlens: Tensor, cu_seqlens_padded: Tensor) -> Tensor:
    """[T] the real length of the sequence each token slot of a padded stream belongs to."""
    return torch.repeat_interleave(cu_seqlens.diff(), cu_seqlens_padded.diff())
