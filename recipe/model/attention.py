"""Core attention for packed (THD) sequences, with zigzag context parallelism.

megatron-core's local `DotProductAttention` refuses packed sequences and CP, so the `torch` backend
plugs this module into the layer spec instead. Each sequence attends causally to itself only. Under
CP a rank holds two zigzag chunks of every sequence: it all-gathers K and V over the CP group,
puts them back in global order with the same zigzag index the data was sharded with, and masks on
global positions. The trade-off is simplicity over memory: every rank holds the full K/V of the
micro-batch (fine for a correctness tool; Transformer Engine's ring attention is the `te` backend).
Which SDPA kernel each call takes can be recorded (`recording_attention_kernels`): the GPU check
reports it and fails a bf16 attention that fell back to the math kernel on CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from recipe.parallel.collectives import all_gather_with_sum_backward
from recipe.parallel.cp.zigzag import global_to_gathered_index, zigzag_index


def _sequence_bounds(packed_seq_params) -> torch.Tensor:
    """Global padded boundaries: the stream is laid out by them, and RoPE slices by them too."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        raise ValueError(
            "the torch attention backend only supports packed THD batches "
            "(packed_seq_params with qkv_format='thd')"
        )
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu


@dataclass(frozen=True)
class StreamLayout:
    """What every attention layer of one micro-batch needs to know about its packed stream."""

    bounds: list[int]
    """The global padded boundaries, on the host (the per-sequence slicing reads them)."""
    local_positions: torch.Tensor | None
    """cp > 1: the global position of each of this rank's tokens (the zigzag index)."""
    gathered_order: torch.Tensor | None
    """cp > 1: where each global token sits in the rank-major all-gather."""


def stream_layout(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> StreamLayout:
    """Computed from the boundaries; their copy to the host is a device synchronisation."""
    if cp_size == 1:
        return StreamLayout(cu_seqlens_padded.tolist(), None, None)
    return StreamLayout(
        cu_seqlens_padded.tolist(),
        zigzag_index(cu_seqlens_padded, cp_size, cp_rank).to(cu_seqlens_padded.device),
        global_to_gathered_index(cu_seqlens_padded, cp_size),
    )


_LAYOUT_ATTRIBUTE = "_recipe_stream_layouts"


def micro_batch_layout(packed_seq_params, cp_size: int, cp_rank: int) -> StreamLayout:
    """The stream layout of a micro-batch, computed by its first attention layer and kept on its
    PackedSeqParams, which megatron hands unchanged to every layer and MTP depth: the host copy
    and index arithmetic happen once per micro-batch instead of once per layer. Keyed by the
    boundary tensor itself, so a PackedSeqParams re-pointed at other boundaries recomputes."""
    cu = _sequence_bounds(packed_seq_params)
    cached = getattr(packed_seq_params, _LAYOUT_ATTRIBUTE, None)
    if cached is not None and cached[0] is cu and cached[1] == (cp_size, cp_rank):
        return cached[2]
    layout = stream_layout(cu, cp_size, cp_rank)
    setattr(packed_seq_params, _LAYOUT_ATTRIBUTE, (cu, (cp_size, cp_rank), layout))
    return layout


_OPEN_KERNEL_RECORDS: list[set[tuple[str, str]]] = []
"""The sets of the `recording_attention_kernels` contexts open now: empty in training, where the
kernel choice is then never asked for."""


@contextlib.contextmanager
def recording_attention_kernels():
    """Collect `(dtype, kernel)` of every attention call of this module made while open: the
    dtype SDPA computes in (autocast's where autocast is on) and the kernel torch's SDPA picks
    for those inputs (`sdpa_kernel_choice`). Contexts nest; each gets every call made inside it.
    Training pays nothing: outside such a context no choice is asked for."""
    seen: set[tuple[str, str]] = set()
    _OPEN_KERNEL_RECORDS.append(seen)
    try:
        yield seen
    finally:
        # by identity: two open contexts may hold equal sets
        _OPEN_KERNEL_RECORDS[:] = [s for s in _OPEN_KERNEL_RECORDS if s is not seen]


UNKNOWN_KERNEL = "unknown"
"""What `sdpa_kernel_choice` says when this torch cannot tell (no `torch._fused_sdp_choice`)."""


def _autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs SDPA in for this tensor's device (SDPA is on autocast's
    lower-precision list), or None when autocast is off there."""
    device_type = tensor.device.type
    try:
        if torch.is_autocast_enabled(device_type) and tensor.is_floating_point():
            return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # a torch without per-device queries
        return None
    return None


def sdpa_kernel_choice(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> str:
    """The kernel `F.scaled_dot_product_attention` dispatches these inputs to, by torch's own
    selection (`torch._fused_sdp_choice`, the function SDPA asks, so `sdpa_kernel` contexts and
    the device's limits count): "math", "flash_attention", "efficient_attention",
    "cudnn_attention", ... (`torch.nn.attention.SDPBackend`, lower case); UNKNOWN_KERNEL where
    this torch has no such function or it refuses the inputs."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return UNKNOWN_KERNEL
    dtype = _autocast_dtype(query)
    if dtype is not None:  # what SDPA itself will be given under autocast
        query, key, value = (t.to(dtype) for t in (query, key, value))
    try:
        from torch.nn.attention import SDPBackend

        chosen = choose(query, key, value, attn_mask, 0.0, is_causal, scale=scale)
        return SDPBackend(chosen).name.lower()
    except (ImportError, RuntimeError, TypeError, ValueError):
        return UNKNOWN_KERNEL


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, the kernel it takes recorded while a
    `recording_attention_kernels` context is open."""
    if _OPEN_KERNEL_RECORDS:
        dtype = _autocast_dtype(query) or query.dtype
        entry = (
            str(dtype).removeprefix("torch."),
            sdpa_kernel_choice(query, key, value, attn_mask, is_causal, scale),
        )
        for seen in _OPEN_KERNEL_RECORDS:
            seen.add(entry)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    softmax_scale: float | None = None,
    layout: StreamLayout | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed stream.

    query: this rank's tokens `[t_local, heads, dim]` (zigzag order when cp_size > 1);
    key/value: the FULL stream in global order `[t_global, groups, dim]`.
    Returns `[t_local, heads * dim]`. `layout`, when given, is `stream_layout` of the same
    boundaries (so that layers after the first do not synchronise to read them again).
    """
    heads, groups = query.shape[1], key.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} key/value groups")
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    layout = layout or stream_layout(cu_seqlens_padded, cp_size, cp_rank)
    bounds = layout.bounds
    if cp_size > 1:
        local_global_pos = layout.local_positions.to(query.device)
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_start, q_end = start // cp_size, end // cp_size
        if q_end == q_start:
            continue
        # SDPA as [batch=1, heads, tokens, dim]: CUDA's flash and memory-efficient kernels take
        # only 4-D input and send 3-D [heads, tokens, dim] to the math kernel without a word
        # (on the CPU 4-D takes the flash kernel; 3-D took it too on torch 2.14, the same bits,
        # and the math kernel on 2.11 and 2.13: test_attention_kernels).
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)
        k = key[start:end].transpose(0, 1).unsqueeze(0)
        v = value[start:end].transpose(0, 1).unsqueeze(0)
        if cp_size == 1:
            out = attend(q, k, v, is_causal=True, scale=softmax_scale)
        else:
            q_pos = local_global_pos[q_start:q_end] - start
            k_pos = torch.arange(end - start, device=query.device)
            mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            out = attend(q, k, v, attn_mask=mask, scale=softmax_scale)
        outputs.append(out.squeeze(0).transpose(0, 1))
    out = torch.cat(outputs, dim=0)
    return out.reshape(out.shape[0], -1)


def gather_global_stream(
    local: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_group,
    gathered_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather a per-token tensor over CP and undo the zigzag (differentiable).
    `gathered_order`: `global_to_gathered_index` of the boundaries, when already at hand."""
    if gathered_order is None:
        cp_size = torch.distributed.get_world_size(cp_group)
        gathered_order = global_to_gathered_index(cu_seqlens_padded, cp_size)
    gathered = all_gather_with_sum_backward(local, cp_group)  # rank-major concatenation
    return gathered.index_select(0, gathered_order.to(local.device))


class PackedCausalAttention(MegatronModule):
    """Drop-in `core_attention` for megatron-core's SelfAttention in THD mode (torch backend)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection=None,
        **_unused,
    ):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        cu_padded = _sequence_bounds(packed_seq_params)
        cp_size, cp_rank = 1, 0
        if self.cp_group is not None and torch.distributed.get_world_size(self.cp_group) > 1:
            cp_size = torch.distributed.get_world_size(self.cp_group)
            cp_rank = torch.distributed.get_rank(self.cp_group)
        layout = micro_batch_layout(packed_seq_params, cp_size, cp_rank)
        if cp_size > 1:
            key = gather_global_stream(key, cu_padded, self.cp_group, layout.gathered_order)
            value = gather_global_stream(value, cu_padded, self.cp_group, layout.gathered_order)
        return varlen_causal_attention(
            query, key, value, cu_padded, cp_size, cp_rank, self.softmax_scale, layout=layout
        )


class ImageAttention(MegatronModule):
    """Bidirectional core attention over the patches of each image (`sbhd`: [patches, images,
    heads, dim]) for the vision encoder, on CPU and GPU alike. Images are never split across CP
    ranks: every rank encodes the micro-batch's images whole."""

    def __init__(self, config, layer_number: int, softmax_scale: float | None = None, **_unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **_unused):
        heads, groups = query.shape[2], key.shape[2]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [images, heads, s, d]
        out = attend(q, k, v, scale=self.softmax_scale)
        patches, images = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(patches, images, -1)
