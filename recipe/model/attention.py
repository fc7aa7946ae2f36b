"""Core attention for packed (THD) sequences, with zigzag context parallelism.

megatron-core's local `DotProductAttention` refuses packed sequences and CP, so the `torch` backend
plugs this module into the layer spec instead. Each sequence attends causally to itself only. Under
CP a rank holds two zigzag chunks of every sequence: it all-gathers K and V over the CP group,
puts them back in global order with the same zigzag index the data was sharded with, and masks on
global positions. The trade-off is simplicity over memory: every rank holds the full K/V of the
micro-batch (fine for a correctness tool; Transformer Engine's ring attention is the `te` backend).
Real offsets in cu_seqlens_q beside padded ones in cu_seqlens_q_padded (Megatron-Bridge's packed
SFT, Transformer Engine's THD convention) keep the padded layout and hide the padding: keys past a
sequence's real length are masked and its padded rows output zero. Which SDPA kernel each call
takes can be recorded (`recording_attention_kernels`): the GPU check reports it and fails a bf16
attention that fell back to the math kernel on CUDA. On CUDA in bf16/fp16 one varlen kernel call
per layer replaces the per-sequence loop (`varlen_plan.py`); fp32 and the CPU keep the loop, the
reference the plan is tested against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from recipe.model.varlen_plan import VarlenPlan, attend_by_plan, varlen_kernel, varlen_plan
from recipe.parallel.collectives import all_gather_with_sum_backward
from recipe.parallel.cp.zigzag import global_to_gathered_index, zigzag_index


def _sequence_bounds(packed_seq_params) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(padded, real) global boundaries. The stream is laid out by the padded ones (the zigzag
    index too), and megatron's RoPE slices it by them as well: it reads cu_seqlens_q_padded
    before cu_seqlens_q (megatron-core 0.19.2 transformer/attention.py:1484-1491, 0.16.1
    :1082-1089). `real` is cu_seqlens_q where it is another tensor than the padded field
    (Megatron-Bridge's packed SFT: real offsets in cu_seqlens_q, padded in *_padded, as
    Transformer Engine's THD attention takes them), else None: the padded path. Self-attention
    reads the q fields only; the kv ones hold the same offsets."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        raise ValueError(
            "the torch attention backend only supports packed THD batches "
            "(packed_seq_params with qkv_format='thd')"
        )
    cu, padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
    if padded is None or cu is None or cu is padded:
        return (cu if padded is None else padded), None
    return padded, cu


@dataclass(frozen=True)
class StreamLayout:
    """What every attention layer of one micro-batch needs to know about its packed stream."""

    bounds: list[int]
    """The global padded boundaries, on the host (the per-sequence slicing reads them)."""
    local_positions: torch.Tensor | None
    """cp > 1: the global position of each of this rank's tokens (the zigzag index)."""
    gathered_order: torch.Tensor | None
    """cp > 1: where each global token sits in the rank-major all-gather."""
    real_lengths: list[int] | None = None
    """Each sequence's real length, where real offsets were given and differ from the padded
    ones (then keys past it are hidden and rows past it output zero); None: the padded path."""


def _real_lengths(real_bounds: list[int], bounds: list[int]) -> list[int] | None:
    """The real length of each padded sequence (its real tokens open its padded slot range), or
    None where they are the padded lengths: nothing to mask, the padded path."""
    if len(real_bounds) != len(bounds):
        raise ValueError(
            f"cu_seqlens_q holds {len(real_bounds) - 1} sequences but cu_seqlens_q_padded "
            f"{len(bounds) - 1}: the real offsets must describe the same padded sequences"
        )
    real = [b - a for a, b in zip(real_bounds[:-1], real_bounds[1:])]
    padded = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    for i, (n, p) in enumerate(zip(real, padded)):
        if not 0 <= n <= p:
            raise ValueError(
                f"sequence {i} has real length {n} (cu_seqlens_q) for padded length {p} "
                "(cu_seqlens_q_padded): a real length is between 0 and the padded length"
            )
    return None if real == padded else real


def stream_layout(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    cu_seqlens: torch.Tensor | None = None,
) -> StreamLayout:
    """Computed from the boundaries; their copy to the host is a device synchronisation (two
    with real offsets `cu_seqlens`, once per micro-batch: `micro_batch_layout`)."""
    bounds = cu_seqlens_padded.tolist()
    real = None if cu_seqlens is None else _real_lengths(cu_seqlens.tolist(), bounds)
    if cp_size == 1:
        return StreamLayout(bounds, None, None, real)
    return StreamLayout(
        bounds,
        zigzag_index(cu_seqlens_padded, cp_size, cp_rank).to(cu_seqlens_padded.device),
        global_to_gathered_index(cu_seqlens_padded, cp_size),
        real,
    )


_LAYOUT_ATTRIBUTE = "_recipe_stream_layouts"


def micro_batch_layout(packed_seq_params, cp_size: int, cp_rank: int) -> StreamLayout:
    """The stream layout of a micro-batch, computed by its first attention layer and kept on its
    PackedSeqParams, which megatron hands unchanged to every layer and MTP depth: the host copy
    and index arithmetic happen once per micro-batch instead of once per layer. Keyed by both
    boundary tensors themselves (padded and real), so a PackedSeqParams re-pointed at other
    boundaries in either field recomputes."""
    cu_padded, cu_real = _sequence_bounds(packed_seq_params)
    cached = getattr(packed_seq_params, _LAYOUT_ATTRIBUTE, None)
    if (
        cached is not None
        and cached[0] is cu_padded
        and cached[1] is cu_real
        and cached[2] == (cp_size, cp_rank)
    ):
        return cached[3]
    layout = stream_layout(cu_padded, cp_size, cp_rank, cu_real)
    setattr(packed_seq_params, _LAYOUT_ATTRIBUTE, (cu_padded, cu_real, (cp_size, cp_rank), layout))
    return layout


_PLAN_ATTRIBUTE = "_recipe_varlen_plan"


def micro_batch_plan(packed_seq_params, layout: StreamLayout, cp_size: int, cp_rank: int,
                     device) -> VarlenPlan:  # fmt: skip
    """The varlen plan of a micro-batch, computed by its first attention layer from the layout
    (host lists: no device read) and kept beside it on the PackedSeqParams."""
    cached = getattr(packed_seq_params, _PLAN_ATTRIBUTE, None)
    if cached is not None and cached[0] is layout:
        return cached[1]
    plan = varlen_plan(layout.bounds, cp_size, cp_rank, layout.real_lengths, device)
    setattr(packed_seq_params, _PLAN_ATTRIBUTE, (layout, plan))
    return plan


VARLEN_KERNEL = "varlen_flash_attention"
"""How `recording_attention_kernels` names the one-call path (torch's varlen_attn)."""

_PER_SEQUENCE_FORCED: list[bool] = []


@contextlib.contextmanager
def per_sequence_attention():
    """Inside, the per-sequence SDPA path runs even where the varlen kernel could: what the GPU
    check measures the varlen path against."""
    _PER_SEQUENCE_FORCED.append(True)
    try:
        yield
    finally:
        _PER_SEQUENCE_FORCED.pop()


def uses_varlen_kernel(query: torch.Tensor) -> bool:
    """One varlen call per layer on CUDA in bf16/fp16 (autocast's dtype counts) where torch has
    the kernel and flash attention runs; fp32, the CPU and older GPUs keep the per-sequence
    path, the reference."""
    if _PER_SEQUENCE_FORCED or not query.is_cuda:
        return False
    dtype = _autocast_dtype(query) or query.dtype
    if dtype not in (torch.bfloat16, torch.float16) or varlen_kernel() is None:
        return False
    # flash attention's limits (SDPA falls back silently; varlen_attn would raise): an Ampere
    # or newer GPU and a head dimension of at most 256
    return torch.cuda.get_device_capability(query.device) >= (8, 0) and query.shape[-1] <= 256


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
        _record_kernel(dtype, sdpa_kernel_choice(query, key, value, attn_mask, is_causal, scale))
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )


def _record_kernel(dtype: torch.dtype, kernel: str) -> None:
    for seen in _OPEN_KERNEL_RECORDS:
        seen.add((str(dtype).removeprefix("torch."), kernel))


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    softmax_scale: float | None = None,
    layout: StreamLayout | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed stream.

    query: this rank's tokens `[t_local, heads, dim]` (zigzag order when cp_size > 1);
    key/value: the FULL stream in global order `[t_global, groups, dim]`.
    Returns `[t_local, heads * dim]`. `layout`, when given, is `stream_layout` of the same
    boundaries (so that layers after the first do not synchronise to read them again).

    `cu_seqlens`: real offsets, where they differ from the padded ones (Transformer Engine's
    THD convention, cu_seqlens_q beside cu_seqlens_q_padded). The stream stays laid out by the
    padded offsets, each sequence's real tokens first; keys past a sequence's real length are
    hidden and the rows past it output exactly zero, so padding contributes nothing. Real rows
    equal the padded path's (its causal mask already hides the padding that follows them).
    """
    heads, groups = query.shape[1], key.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} key/value groups")
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    layout = layout or stream_layout(cu_seqlens_padded, cp_size, cp_rank, cu_seqlens)
    bounds, real_lengths = layout.bounds, layout.real_lengths
    if cp_size > 1:
        local_global_pos = layout.local_positions.to(query.device)
    # what SDPA returns (autocast's dtype under autocast): zero rows must not promote the cat
    out_dtype = _autocast_dtype(query) or query.dtype
    outputs = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        q_start, q_end = start // cp_size, end // cp_size
        if q_end == q_start:
            continue
        real = end - start if real_lengths is None else real_lengths[i]
        if real == 0:  # padding only (Bridge's trailing pseudo-sequence): no key to attend to
            outputs.append(
                query.new_zeros(q_end - q_start, heads, value.shape[-1], dtype=out_dtype)
            )
            continue
        # SDPA as [batch=1, heads, tokens, dim]: CUDA's flash and memory-efficient kernels take
        # only 4-D input and send 3-D [heads, tokens, dim] to the math kernel without a word
        # (on the CPU 4-D takes the flash kernel; 3-D took it too on torch 2.14, the same bits,
        # and the math kernel on 2.11 and 2.13: test_attention_kernels).
        k = key[start : start + real].transpose(0, 1).unsqueeze(0)
        v = value[start : start + real].transpose(0, 1).unsqueeze(0)
        if cp_size == 1:
            # the real rows only: the padding after them is neither asked nor attended
            q = query[start : start + real].transpose(0, 1).unsqueeze(0)
            out = attend(q, k, v, is_causal=True, scale=softmax_scale).squeeze(0).transpose(0, 1)
            if real < end - start:
                out = torch.cat([out, out.new_zeros(end - start - real, *out.shape[1:])])
        else:
            q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)
            q_pos = local_global_pos[q_start:q_end] - start
            # Only the real keys: a padded row (q_pos >= real) sees all of them rather than none
            # (what SDPA makes of a fully masked row depends on the torch release and kernel:
            # NaN on some, 0 on torch 2.14's CPU kernels); the row is zeroed below.
            k_pos = torch.arange(real, device=query.device)
            mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            out = attend(q, k, v, attn_mask=mask, scale=softmax_scale).squeeze(0).transpose(0, 1)
            if real < end - start:
                out = torch.where((q_pos < real)[:, None, None], out, out.new_zeros(()))
        outputs.append(out)
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
        cu_padded, cu_real = _sequence_bounds(packed_seq_params)
        cp_size, cp_rank = 1, 0
        if self.cp_group is not None and torch.distributed.get_world_size(self.cp_group) > 1:
            cp_size = torch.distributed.get_world_size(self.cp_group)
            cp_rank = torch.distributed.get_rank(self.cp_group)
        layout = micro_batch_layout(packed_seq_params, cp_size, cp_rank)
        if cp_size > 1:
            key = gather_global_stream(key, cu_padded, self.cp_group, layout.gathered_order)
            value = gather_global_stream(value, cu_padded, self.cp_group, layout.gathered_order)
        if uses_varlen_kernel(query):
            plan = micro_batch_plan(packed_seq_params, layout, cp_size, cp_rank, query.device)
            dtype = _autocast_dtype(query) or query.dtype
            if _OPEN_KERNEL_RECORDS:
                _record_kernel(dtype, VARLEN_KERNEL)
            out = attend_by_plan(query, key, value, plan, self.softmax_scale, dtype)
            return out.reshape(out.shape[0], -1)
        return varlen_causal_attention(
            query,
            key,
            value,
            cu_padded,
            cp_size,
            cp_rank,
            self.softmax_scale,
            layout=layout,
            cu_seqlens=cu_real,
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
