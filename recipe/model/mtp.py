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


def rolled_loss_masks(
    loss_mask: torch.Tensor, cu_seqlens_padded: torch.Tensor, num_layers: int
) -> torch.Tensor:
    """[num_layers, T] float: megatron's per-layer roll of the loss mask, on the global stream.

    MTP layer k reads the loss mask rolled k+1 steps left within each padded sequence (nothing
    rolls in from the next one), so a label the main loss skips (an image placeholder) is
    skipped at every depth too. For text this equals `mtp_label_masks`.
    """
    total = loss_mask.numel()
    cu = cu_seqlens_padded.to(torch.int64)
    seq_end = torch.repeat_interleave(cu[1:], cu.diff())
    masks = torch.zeros(num_layers, total, dtype=torch.float32)
    index = torch.arange(total)
    for k in range(num_layers):
        source = index + k + 1
        inside = source < seq_end
        masks[k, inside] = loss_mask[source[inside]].to(torch.float32)
    return masks


def predicted_token_counts(
    sequences: list[list[int]], num_layers: int, skip_id: int | None = None
) -> tuple[int, list[int]]:
    """(next-token targets, [targets of each MTP layer]) of a set of sequences: token t of a
    sequence is a target of the main loss when t >= 1 and of MTP layer k when t >= k + 2, unless
    it is `skip_id` (an image placeholder). Text: L-1 and L-2-k per sequence."""
    if skip_id is None:
        lengths = [len(s) for s in sequences]
        return sum(n - 1 for n in lengths), global_mtp_token_counts(lengths, num_layers)
    main, per_layer = 0, [0] * num_layers
    for seq in sequences:
        counted = [t != skip_id for t in seq]
        main += sum(counted[1:])
        for k in range(num_layers):
            per_layer[k] += sum(counted[k + 2 :])
    return main, per_layer
