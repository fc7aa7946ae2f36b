"""Pack whole sequences into one THD stream with every per-token tensor built globally.

Positions, labels and the loss mask are computed once on the global stream; context parallelism
later selects each rank's tokens from all of them with a single index, which keeps them consistent
by construction. Each sequence is padded at its end to a multiple of the alignment; padding is
masked out of the loss and attends only causally after the real tokens, so it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from recipe.data.thd import cu_seqlens_from_lengths, length_of_each_slot, padded_lengths


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    """[T] token ids, T = cu_seqlens_padded[-1] (or T / cp after sharding)."""
    position_ids: torch.Tensor
    """[T] position within the sequence, restarting at 0 per sequence and counting on through
    padding (the positions RoPE derives from padded offsets)."""
    labels: torch.Tensor
    """[T] next token within the same sequence (pad id where there is none)."""
    loss_mask: torch.Tensor
    """[T] float, 1 where a label is predicted: 0 on each sequence's last real token and padding."""
    cu_seqlens: torch.Tensor
    """[n+1] int32 cumulative real lengths (global, also after sharding)."""
    cu_seqlens_padded: torch.Tensor
    """[n+1] int32 cumulative padded lengths (global, also after sharding)."""
    max_seqlen: int
    """Longest padded sequence (global)."""
    mtp_mask: torch.Tensor | None = None
    """[mtp layers, T] float: 1 where MTP layer k has a target in the same sequence (mtp=on)."""
    image_slot: torch.Tensor | None = None
    """[T] int64 (vision): -1 on text, else the token's index among the micro-batch's image
    tokens (whose embeddings replace the placeholder's). Sharded like every per-token tensor."""
    stream_image_slot: torch.Tensor | None = None
    """[T_global] the same for the whole unsharded stream: never sharded, so the model can compute
    3-D positions on the full stream on every rank."""
    images: torch.Tensor | None = None
    """[images, 3, H, W] float in [0, 1], in the order their tokens appear (not per token)."""
    image_grids: torch.Tensor | None = None
    """[images, 2] int64: each image's merged patch grid (h, w)."""

    PER_TOKEN = ("input_ids", "position_ids", "labels", "loss_mask", "mtp_mask", "image_slot")
    WHOLE = ("stream_image_slot", "images", "image_grids")
    """Tensors every CP rank keeps whole."""
    TOKEN_DIMS = {"mtp_mask": -1}

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def per_token(self) -> dict[str, torch.Tensor]:
        """Every per-token tensor present; CP shards all of them with one index."""
        return {n: getattr(self, n) for n in self.PER_TOKEN if getattr(self, n) is not None}

    def to(self, device) -> PackedBatch:
        """Every tensor on `device`: Transformer Engine's kernels want cu_seqlens there too."""
        moved = {k: v.to(device) for k, v in self.per_token().items()}
        moved.update(
            {n: getattr(self, n).to(device) for n in self.WHOLE if getattr(self, n) is not None}
        )
        return self.replace(
            **moved,
            cu_seqlens=self.cu_seqlens.to(device),
            cu_seqlens_padded=self.cu_seqlens_padded.to(device),
        )

    def tokens_per_sequence_length(self) -> torch.Tensor:
        """[T] the real length of the sequence each token slot belongs to."""
        return length_of_each_slot(self.cu_seqlens, self.cu_seqlens_padded)

    def replace(self, **changes) -> PackedBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return PackedBatch(**values)


def pack_sequences(sequences: list[list[int]], alignment: int, pad_id: int) -> PackedBatch:
    """Pack whole sequences into one padded THD stream."""
    if not sequences:
        raise ValueError("cannot pack an empty list of sequences")
    lengths_t = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    padded_t = padded_lengths(lengths_t, alignment)
    cu_padded = cu_seqlens_from_lengths(padded_t)
    total = int(cu_padded[-1])
    starts = cu_padded[:-1].to(torch.int64)

    seq_of_token = torch.repeat_interleave(torch.arange(len(sequences)), padded_t)
    position_ids = torch.arange(total) - starts[seq_of_token]
    is_real = position_ids < lengths_t[seq_of_token]

    input_ids = torch.full((total,), pad_id, dtype=torch.int64)
    input_ids[is_real] = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)

    has_label = position_ids < (lengths_t - 1)[seq_of_token]
    labels = torch.full((total,), pad_id, dtype=torch.int64)
    next_index = torch.arange(total) + 1
    labels[has_label] = input_ids[next_index[has_label]]

    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        loss_mask=has_label.to(torch.float32),
        cu_seqlens=cu_seqlens_from_lengths(lengths_t),
        cu_seqlens_padded=cu_padded,
        max_seqlen=int(padded_t.max()),
    )


class ImageSequence(list):
    """A token sequence (a list of ids) that carries its image: the ids hold one placeholder
    token per merged patch where the image goes."""

    def __init__(self, tokens, image):
        super().__init__(tokens)
        self.image = image
        """[H, W, 3] uint8."""


def attach_images(
    batch: PackedBatch,
    sequences: list[ImageSequence],
    image_token_id: int,
    grid: tuple[int, int],
) -> PackedBatch:
    """The global batch with its images: slots numbered over the placeholders in stream order,
    the images in that order, and no loss on a label that is a placeholder (nothing predicts an
    image token)."""
    is_image = batch.input_ids == image_token_id
    slot = torch.full_like(batch.input_ids, -1)
    slot[is_image] = torch.arange(int(is_image.sum()))
    per_image = grid[0] * grid[1]
    found = [sum(1 for t in s if t == image_token_id) for s in sequences]
    wrong = [i for i, n in enumerate(found) if n != per_image]
    if wrong:
        raise ValueError(
            f"sequence {wrong[0]} of the micro-batch holds {found[wrong[0]]} image tokens, but "
            f"its image has {per_image} ({grid[0]} x {grid[1]} merged patches): was it cut by "
            "data.max_seq_len?"
        )
    images = torch.from_numpy(np.stack([s.image for s in sequences])).permute(0, 3, 1, 2)
    return batch.replace(
        loss_mask=batch.loss_mask * (batch.labels != image_token_id),
        image_slot=slot,
        stream_image_slot=slot.clone(),
        images=images.to(torch.float32) / 255.0,
        image_grids=torch.tensor([grid] * len(sequences), dtype=torch.int64),
    )
