"""Multi-token prediction bookkeeping: which tokens each MTP layer predicts, and its exact loss.

megatron-core's MTP layer k (0-based) predicts, at position t, the token at t+k+2 of the same
sequence: it rolls labels and the loss mask one step further per layer, within the padded
boundaries in `cu_seqlens_q`, exchanging chunk edges between CP ranks. The recipe computes the
same masks on the global stream (position t counts for layer k when t+k+2 < length) and shards
them with the tokens, which gives each rank its exact token counts. megatron only tracks the
per-micro-batch, per-rank MEAN of the MTP loss for logging; mean x local count, summed over ranks
and micro-batches and divided by the global count, is the exact global mean.
"""

from __future__ import annotations

import torch


def mtp_label_masks(
    position_ids: torch.Tensor, seq_lengths: torch.Tensor, num_layers: int
) -> torch.Tensor:
    """[num_layers, T] float masks: 1 where MTP layer k has a target inside the same sequence.

    `seq_lengths` gives, per token, the real length of the token's sequence.
    """
    depth = torch.arange(num_layers).unsqueeze(1)
    return (position_ids.unsqueeze(0) + depth + 2 < seq_lengths.unsqueeze(0)).to(torch.float32)


def global_mtp_token_counts(lengths: list[int], num_layers: int) -> list[int]:
    """Tokens each MTP layer predicts over a set of sequences: L-2-k per sequence."""
    return [sum(max(0, n - 2 - k) for n in lengths) for k in range(num_layers)]
