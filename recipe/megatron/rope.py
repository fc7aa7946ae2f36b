"""megatron-core's unfused THD RoPE without a host read per layer: one patch, on every device.

Without Transformer Engine megatron refuses `apply_rope_fusion` and takes its unfused
`_apply_rotary_pos_emb_thd` (megatron-core 0.19.2 `models/common/embeddings/rope_utils.py`,
lines 189-268): per call it reads the sequence lengths (`.tolist()`) and the total (`.item()`)
from the device, then loops over the sequences in Python (0.16.1 reads the lengths and compares
the total on the host, then concatenates per-sequence slices). It is called for the queries and
the keys of every layer, so a 2-layer model synchronised 4 times per micro-batch in RoPE alone,
and a deeper one more.

The replacement computes, once per micro-batch (per boundary tensor, which megatron hands
unchanged to every layer and MTP depth), the row of `freqs` each local token takes, by megatron's
own rules (`_get_thd_freqs_on_this_cp_rank`: a rank's front and back zigzag chunks; positions from
0 in every sequence, or from its offset where `freqs` covers the whole packed batch), and then
applies megatron's own `_apply_rotary_pos_emb_bshd` to all tokens at once. That function is
elementwise, so the result is megatron's bit for bit (tests/test_rope_patch.py). Any other call
shape (freqs that are not `[s, 1, 1, d]`) goes to megatron's function unchanged.

megatron code is not copied or edited: the module attribute megatron's `apply_rotary_pos_emb`
looks up at call time is replaced, once per process (`install_thd_rope`).
"""

from __future__ import annotations

import torch

ROPE_MODULE = "megatron.core.models.common.embeddings.rope_utils"
_CACHE_ATTRIBUTE = "_recipe_rope_rows"
_ORIGINAL: dict[str, object] = {}


def freq_rows(bounds: list[int], cp_size: int, cp_rank: int, packed: bool) -> list[int]:
    """The row of `freqs` for each of this rank's tokens, in local order, for sequences with
    global (padded) boundaries `bounds`: megatron's `_get_thd_freqs_on_this_cp_rank` per
    sequence (`packed`: `freqs` covers the whole batch, so each sequence starts at its offset)."""
    rows: list[int] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        local = (end - start) // cp_size  # the size of this rank's split of the sequence
        offset = start if packed else 0
        if cp_size == 1:
            rows.extend(range(offset, offset + local))
            continue
        segment, full = local // 2, cp_size * local
        rows.extend(range(offset + cp_rank * segment, offset + (cp_rank + 1) * segment))
        rows.extend(
            range(offset + full - (cp_rank + 1) * segment, offset + full - cp_rank * segment)
        )
    return rows


def _rows_for(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, freqs: torch.Tensor):
    """The rows tensor for this boundary tensor, computed on its first call (one host read)
    and kept on the tensor for the micro-batch's other layers; None where megatron's own rules
    would not index `freqs` this way."""
    cache = getattr(cu_seqlens, _CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = {}
        setattr(cu_seqlens, _CACHE_ATTRIBUTE, cache)
    bounds = cache.get("bounds")
    if bounds is None:
        bounds = cache["bounds"] = cu_seqlens.tolist()
    packed = freqs.size(0) == bounds[-1]
    key = (cp_size, cp_rank, packed, freqs.device)
    if key not in cache:
        cache[key] = torch.tensor(freq_rows(bounds, cp_size, cp_rank, packed), device=freqs.device)
    return cache[key]


def vectorised_thd_rope(t, cu_seqlens, freqs, rotary_interleaved=False, mscale=1.0,
                        cp_group=None, **interleaving):  # fmt: skip
    """megatron's `_apply_rotary_pos_emb_thd` with the same arguments and result, one
    elementwise pass over all tokens and no host read after a micro-batch's first call.
    `interleaving`: MLA's flag as this release names it (`mla_rotary_interleaved` in 0.19,
    `multi_latent_attention` in 0.16), handed to megatron's bshd function as given."""
    import importlib

    rope = importlib.import_module(ROPE_MODULE)
    if cp_group is None or freqs.dim() != 4 or freqs.size(1) != 1 or freqs.size(2) != 1:
        return _ORIGINAL["thd"](t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                                mscale=mscale, cp_group=cp_group, **interleaving)  # fmt: skip
    rows = _rows_for(cu_seqlens, cp_group.size(), cp_group.rank(), freqs)
    if rows.numel() != t.size(0):
        raise ValueError(
            f"THD RoPE: {t.size(0)} tokens on this rank, but cu_seqlens {cu_seqlens.tolist()} "
            f"at cp_size {cp_group.size()} describe {rows.numel()}"
        )
    return rope._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs.index_select(0, rows),
        rotary_interleaved=rotary_interleaved,
        mscale=mscale,
        **interleaving,
    ).squeeze(1)


def install_thd_rope() -> None:
    """Route megatron's THD RoPE through `vectorised_thd_rope`, once per process."""
    import importlib

    rope = importlib.import_module(ROPE_MODULE)
    if "thd" not in _ORIGINAL:
        _ORIGINAL["thd"] = rope._apply_rotary_pos_emb_thd
    rope._apply_rotary_pos_emb_thd = vectorised_thd_rope


def megatron_thd_rope():
    """megatron's own function (the reference of the tests), installed or not."""
    import importlib

    return _ORIGINAL.get("thd") or importlib.import_module(ROPE_MODULE)._apply_rotary_pos_emb_thd
