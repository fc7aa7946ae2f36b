"""CP preprocessing functions with the bugs people write, for the checker's negative controls.

Each follows the contract of recipe/parallel/cp/contract.py and starts from the correct index
path, then breaks one thing.
"""

from __future__ import annotations

import torch

from recipe.parallel.cp.contract import index_preprocess


def local_label_roll(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
    """Labels made by rolling this rank's own tokens: wrong wherever the next token of a
    sequence lives in another chunk (the local-roll MTP bug, here for the next-token label)."""
    out = index_preprocess(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size)
    out["labels"] = torch.roll(out["input_ids"], -1)
    return out


def swapped_chunks_on_last_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
    """The last rank lays out its back chunk before its front chunk."""
    out = index_preprocess(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size)
    if cp_rank != cp_size - 1:
        return out
    local = (cu_seqlens_padded.diff() // cp_size).tolist()
    starts = (cu_seqlens_padded[:-1] // cp_size).tolist()
    order = []
    for start, n in zip(starts, local):
        half = n // 2
        order += list(range(start + half, start + n)) + list(range(start, start + half))
    index = torch.tensor(order, dtype=torch.int64)
    return {name: value[index] for name, value in out.items()}


def padding_counted_as_real(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
    """Padding slots get loss_mask 1: they would be trained on and counted in the mean."""
    out = index_preprocess(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size)
    lengths = [len(s) for s in sequences]
    real = torch.repeat_interleave(torch.tensor(lengths), (cu_seqlens_padded.diff() // cp_size))
    out["loss_mask"] = torch.where(out["position_ids"] >= real, 1.0, out["loss_mask"])
    return out


def off_by_one_back_positions(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
    """The back chunk's positions start one too early."""
    out = index_preprocess(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size)
    local = (cu_seqlens_padded.diff() // cp_size).tolist()
    starts = (cu_seqlens_padded[:-1] // cp_size).tolist()
    positions = out["position_ids"].clone()
    for start, n in zip(starts, local):
        positions[start + n // 2 : start + n] -= 1
    return {"input_ids": out["input_ids"], "position_ids": positions}


def wrong_length(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
    """Returns the whole stream instead of this rank's part."""
    total = int(cu_seqlens_padded[-1])
    return torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64)


def raises_on_a_single_token(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
    """Correct except on a one-token sequence, where it raises (a user's own bug)."""
    if any(len(s) == 1 for s in sequences):
        raise RuntimeError("a one-token sequence")
    return index_preprocess(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size)


def takes_no_rank(sequences, cu_seqlens_padded):
    """Another shape than the contract's."""
    return index_preprocess(sequences, cu_seqlens_padded, 1, 0)
