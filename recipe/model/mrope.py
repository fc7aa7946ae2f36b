"""3-D rotary positions (Qwen2-VL's mrope) for packed streams with images, and the rope table
megatron's THD path reads.

Positions follow Qwen2-VL: a text token advances all three axes (t, row, col) by one; the merged
patches of an image that starts at position p get (p, p + row, p + col), and the text after it
continues at p + max(h, w); padding counts on like text; every packed sequence restarts at 0.
They are computed here on the FULL, unsharded stream, so they cannot depend on the CP layout.

megatron's `MultimodalRotaryEmbedding` turns ids into a table and then shards that table for CP
as if the stream were one BSHD sequence: right for BSHD, wrong for packed sequences, whose zigzag
chunks are per sequence. megatron's THD rope path instead slices each sequence's chunks itself when
it gets a table for the whole packed stream (length `cu_seqlens_padded[-1]`), so the recipe builds
that table unsharded and hands it over whole (`StreamRotaryEmbedding`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def image_token_grid(slots: Tensor, grids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For image-token indices `slots` (numbered over all images of a micro-batch in order), the
    image each belongs to and its (row, col) in that image's merged grid (row-major)."""
    sizes = grids[:, 0] * grids[:, 1]
    starts = torch.cumsum(sizes, 0) - sizes
    image = torch.searchsorted(starts, slots, right=True) - 1
    within = slots - starts[image]
    width = grids[image, 1]
    return image, within // width, within % width


def stream_mrope_positions(cu_seqlens_padded: Tensor, image_slot: Tensor, grids: Tensor) -> Tensor:
    """[3, T] int64 (t, row, col) ids of a packed stream.

    `image_slot` [T]: -1 on text and padding, else the token's index among all image tokens of
    the micro-batch; `grids` [images, 2]: each image's merged grid (h, w), in slot order.
    """
    total = image_slot.numel()
    cu = cu_seqlens_padded.to(torch.int64).to(image_slot.device)
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])}, the stream has {total} slots")
    is_image = image_slot >= 0
    image_tokens = int(is_image.sum())
    expected = int((grids[:, 0] * grids[:, 1]).sum()) if grids.numel() else 0
    if image_tokens and int(image_slot.max()) >= expected:
        raise ValueError(
            f"image tokens are numbered up to {int(image_slot.max())} but the image grids hold "
            f"{expected} patches"
        )
    image = torch.full_like(image_slot, -1)
    row = torch.zeros_like(image_slot)
    col = torch.zeros_like(image_slot)
    if image_tokens:
        image[is_image], row[is_image], col[is_image] = image_token_grid(
            image_slot[is_image], grids.to(image_slot.device)
        )
    seq_start = torch.zeros(total, dtype=torch.bool, device=image_slot.device)
    starts = cu[:-1][cu.diff() > 0]
    seq_start[starts] = True
    # The last token of an image's run (the next slot is another image, text, or a new sequence)
    # moves the counter past the image: by max(h, w). Text and padding move it by one.
    next_image = torch.cat([image[1:], image.new_full((1,), -1)])
    next_starts = torch.cat([seq_start[1:], seq_start.new_ones(1)])
    run_ends = is_image & ((next_image != image) | next_starts)
    extent = torch.zeros_like(image_slot)
    if image_tokens:
        extent[is_image] = grids.to(image_slot.device)[image[is_image]].max(dim=1).values
    advance = torch.where(is_image, torch.where(run_ends, extent, 0), 1)
    before = torch.cumsum(advance, 0) - advance  # exclusive cumsum over the whole stream
    sequence_of = torch.cumsum(seq_start.to(torch.int64), 0) - 1
    base = before - before[starts][sequence_of]
    return torch.stack([base, base + row, base + col])


class _WithoutCP:
    """A stand-in group of size 1: megatron's mrope table code then leaves the table whole."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def rope_table(rope, ids: Tensor, mrope_section: list[int], cp_group=None) -> Tensor:
    """[T, 1, 1, dim] table of `ids` [3, T] by megatron's own mrope code (`rope` a
    MultimodalRotaryEmbedding); sharded as megatron shards it only when `cp_group` is given."""
    stock = super(StreamRotaryEmbedding, rope) if isinstance(rope, StreamRotaryEmbedding) else rope
    group = cp_group if cp_group is not None else _WithoutCP()
    return stock.forward(ids.unsqueeze(1), mrope_section, cp_group=group)


def _multimodal_rotary_embedding():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    return MultimodalRotaryEmbedding


class StreamRotaryEmbedding(_multimodal_rotary_embedding()):
    """megatron's mrope module, given the whole stream's table before every forward.

    GPTModel calls it with whatever `position_ids` the model call carried: 1-D text ids (which
    the MTP block needs as a tensor on megatron-core 0.16, and which must never become 3-D
    positions) are ignored by design; 3-D ids from outside are refused, because pre-sharded ids
    are exactly what megatron's own module gets wrong under THD CP.
    """

    def __init__(self, stock) -> None:
        torch.nn.Module.__init__(self)
        self.rotary_interleaved = stock.rotary_interleaved
        self.seq_len_interpolation_factor = stock.seq_len_interpolation_factor
        self.inv_freq = stock.inv_freq
        self.cp_group = stock.cp_group
        self.table: Tensor | None = None
        """[T_global, 1, 1, dim], set by the vision-language model before each forward."""

    def forward(self, position_ids, mrope_section, cp_group=None) -> Tensor:
        if position_ids is not None and position_ids.dim() != 2:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} reached the mrope module: "
                "the vision-language model computes 3-D positions itself on the full stream; "
                "pass none, or 1-D text ids [b, s] (ignored here)"
            )
        if self.table is None:
            raise RuntimeError(
                "the mrope table was not set: call the VisionLanguageModel, not its language "
                "model directly"
            )
        return self.table
