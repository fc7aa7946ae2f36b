"""verl's per-rank CP preprocessing, written out as reference formulas (after and before PR #6267).

verl computes each rank's position_ids sequence by sequence from per-sequence bounds instead of
selecting them from the global stream. The fixed formula starts the back chunk at `remain_start`
and clamps at the real length; the pre-fix (`verl_legacy`) one numbers the back chunk backwards
from the padded end, which is only right on rank 0 of an unpadded sequence. Tests prove the
recipe's index equals `verl_fixed` on every real token and differs from `verl_legacy`; training
runs select them with `cp.preprocess` to show what the bug does to the loss.

One detail of verl matters at tp > 1: a sequence shorter than the alignment (2*cp*tp) is padded
to its padded length before the back chunk's end is clamped, so for such a sequence verl clamps
at the padded length, not the real one. With two or more slots per chunk (tp > 1) that moves the
pre-fix positions of real tokens (cp=2, tp=2, one sequence of 5 tokens, rank 1: [2, 3, 6, 7]
rather than [2, 3, 7, 0]); at tp=1 a chunk is one slot and only padding slots differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from recipe.names import VERL_VARIANTS
from recipe.parallel.cp.zigzag import check_cp, padded_seqlens


def _check_sequence_count(sequences: Sequence[Tensor], cu_seqlens_padded: Tensor) -> None:
    if len(sequences) != cu_seqlens_padded.numel() - 1:
        raise ValueError(
            f"got {len(sequences)} sequences but cu_seqlens_padded describes "
            f"{cu_seqlens_padded.numel() - 1}"
        )


def _data_length(padded_len: int, real_len: int, cp_size: int, tp_size: int) -> int:
    """The length of the tensor verl slices a sequence from: padded when the sequence is shorter
    than the alignment, its real length otherwise."""
    return padded_len if real_len < 2 * cp_size * tp_size else real_len


def _verl_bounds(
    padded_len: int, data_len: int, cp_size: int, cp_rank: int
) -> tuple[int, int, int]:
    """verl's per-sequence (half, remain_start, remain_end), kept verbatim from preprocess_thd."""
    half = padded_len // cp_size // 2
    remain_start = padded_len - half * (cp_rank + 1)
    remain_end = min(padded_len - half * cp_rank, data_len)
    return half, remain_start, remain_end


def _as_verl_data(seq: Tensor, data_len: int) -> Tensor:
    if data_len > seq.numel():
        return torch.cat([seq, seq.new_zeros(data_len - seq.numel())])
    return seq


def verl_shard_values(
    sequences: Sequence[Tensor],
    cu_seqlens_padded: Tensor,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
) -> Tensor:
    """Reference: verl's per-sequence slicing of real-token values (input_ids, labels, masks...).

    ``sequences[i]`` holds sequence i's real tokens; padding slots stay 0.
    """
    check_cp(cp_size, cp_rank)
    padded_seqlens(cu_seqlens_padded, cp_size)
    _check_sequence_count(sequences, cu_seqlens_padded)
    cu = cu_seqlens_padded.tolist()
    dtype = sequences[0].dtype if len(sequences) else torch.int64
    values = torch.zeros(cu[-1] // cp_size, dtype=dtype)
    for i, seq in enumerate(sequences):
        padded_len = cu[i + 1] - cu[i]
        start = cu[i] // cp_size
        data_len = _data_length(padded_len, len(seq), cp_size, tp_size)
        half, remain_start, remain_end = _verl_bounds(padded_len, data_len, cp_size, cp_rank)
        seq = _as_verl_data(seq, data_len)
        front = seq[half * cp_rank : half * (cp_rank + 1)]
        values[start : start + front.numel()] = front
        remain_len = remain_end - remain_start
        if remain_len > 0:
            values[start + half : start + half + remain_len] = seq[remain_start:remain_end]
    return values


def verl_preprocess(
    sequences: Sequence[Tensor],
    cu_seqlens_padded: Tensor,
    cp_size: int,
    cp_rank: int,
    variant: str = "verl_fixed",
    tp_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """Reference: verl's ``preprocess_thd`` for one rank, returning (input_ids, position_ids).

    ``verl_legacy`` is the formula before verl PR #6267: it numbers the back chunk's positions
    backwards from the padded end, which is only right on rank 0 of an unpadded sequence.
    """
    if variant not in VERL_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid variants: {', '.join(VERL_VARIANTS)}")
    check_cp(cp_size, cp_rank)
    padded_seqlens(cu_seqlens_padded, cp_size)
    _check_sequence_count(sequences, cu_seqlens_padded)
    cu = cu_seqlens_padded.tolist()
    local_total = cu[-1] // cp_size
    dtype = sequences[0].dtype if len(sequences) else torch.int64
    input_ids = torch.zeros(local_total, dtype=dtype)
    position_ids = torch.zeros(local_total, dtype=torch.int64)
    for i, seq in enumerate(sequences):
        padded_len = cu[i + 1] - cu[i]
        real_len = len(seq)
        start = cu[i] // cp_size
        data_len = _data_length(padded_len, real_len, cp_size, tp_size)
        half, remain_start, remain_end = _verl_bounds(padded_len, data_len, cp_size, cp_rank)
        seq = _as_verl_data(seq, data_len)
        front = seq[half * cp_rank : half * (cp_rank + 1)]
        input_ids[start : start + front.numel()] = front
        position_ids[start : start + half] = torch.arange(half * cp_rank, half * (cp_rank + 1))
        remain_len = remain_end - remain_start
        if remain_len <= 0:
            continue
        input_ids[start + half : start + half + remain_len] = seq[remain_start:remain_end]
        if variant == "verl_fixed":
            pos_end = min(remain_end, real_len)
            if pos_end - remain_start > 0:
                position_ids[start + half : start + half + pos_end - remain_start] = torch.arange(
                    remain_start, pos_end
                )
        else:
            position_ids[start + half : start + half + remain_len] = torch.arange(
                padded_len - remain_len, padded_len
            )
    return input_ids, position_ids
