"""The Megatron-Bridge reproducers, as real code: `reproducer_body` writes the script's body from
the sources (`inspect.getsource`) of `kit.layouts.GroupStandIn`, the shared parts
(`shipped.py`), the functions below and `kit.layouts.REFERENCE` (the ground truth's
`reference_problems`); the prelude (`load_from_wheel`, `main`) and the case (CASE, OPTIONS) come
before it (`reproducer_source`). Each target has its own `*_release_outputs(wheel)`, which the
script's entry point `release_outputs`, the name the prelude's `main` calls, calls.

The functions name the script's globals: CASE and OPTIONS (defined below only so that they are
module globals here too), the file constants `reproducer_body` writes, the shipped parts, the
prelude's `load_from_wheel` and `ParallelStateStandIn`, and REFERENCE's `reference_sequences`
(`kit/reference.py`).
"""

from __future__ import annotations

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.checks.upstream.kit.layouts import GroupStandIn
from recipe.checks.upstream.kit.reference import reference_sequences
from recipe.checks.upstream.libraries.megatron_bridge.shipped import (
    COMMON_UTILS,
    DSV4_STEP,
    GPT_STEP,
    KIMI,
    MCORE_SPLIT,
    PACKED_SEQ_UTILS,
    TorchWithGroups,
    TransformerEngineStandIn,
    contiguous_stubs,
    gpt_step_stubs,
    kimi_stubs,
    megatron_cp_split,
    packed_batch,
    slice_batch_stubs,
    split_fields,
)
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import ParallelStateStandIn

# The script's case, which `reproducer_source` writes before the body.
CASE: dict = {}
OPTIONS: dict = {}

# What the script's body starts with: the files, and the megatron-core functions re-executed.
CONSTANTS = {
    "PACKED_SEQ_UTILS": PACKED_SEQ_UTILS,
    "GPT_STEP": GPT_STEP,
    "COMMON_UTILS": COMMON_UTILS,
    "DSV4_STEP": DSV4_STEP,
    "KIMI": KIMI,
    "MCORE_SPLIT": MCORE_SPLIT,
}


def reproducer_outputs(per_rank, cu, layout="zigzag"):
    """The reproducer's structure: every rank's fields, the real sequences' boundaries."""
    return {"lengths": CASE["lengths"], "cp": CASE["cp"], "layout": layout, "width": None,
            "cu_seqlens_padded": cu, "round_trip": None, "error": None,
            "ranks": [{k: v.reshape(-1).tolist() for k, v in fields.items()}
                      for fields in per_rank]}  # fmt: skip


def released_packed_seq_utils(wheel):
    """The release's packed_seq_utils, its megatron-core split given TE's kernel on CPU."""
    module = load_from_wheel(wheel, PACKED_SEQ_UTILS, {})
    module.get_batch_on_this_cp_rank = megatron_cp_split(
        TransformerEngineStandIn(), TorchWithGroups(), MCORE_SPLIT
    )
    return module


def every_rank(split_rank):
    """split_rank(rank) -> (fields, cu) on every rank; a raise is the output."""
    per_rank, cu = [], None
    try:
        for rank in range(CASE["cp"]):
            fields, cu = split_rank(rank)
            per_rank.append(fields)
    except Exception as err:
        return {"error": f"rank {len(per_rank)}: {type(err).__name__}: {err}"}
    return per_rank, cu


def gpt_step_release_outputs(wheel):
    """gpt_step._partition_packed_batch_for_cp on every rank of the case."""
    module = load_from_wheel(wheel, GPT_STEP, gpt_step_stubs(released_packed_seq_utils(wheel)))
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]

    def split_rank(rank):
        batch, cu = packed_batch(reference_sequences(lengths), cp, tp, **OPTIONS)
        out = module._partition_packed_batch_for_cp(batch, GroupStandIn(cp, rank))
        return split_fields(out["tokens"], out["labels"], out["loss_mask"],
                            out["position_ids"]), cu  # fmt: skip

    done = every_rank(split_rank)
    return done if isinstance(done, dict) else reproducer_outputs(*done)


def slice_batch_release_outputs(wheel):
    """common_utils.slice_batch_for_context_parallel on every rank of the case, on the
    PackedSeqParams vlm_step builds."""
    import types

    import torch

    psu = released_packed_seq_utils(wheel)
    module = load_from_wheel(wheel, COMMON_UTILS, slice_batch_stubs(psu))
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]

    def split_rank(rank):
        batch, cu = packed_batch(reference_sequences(lengths), cp, tp, "in_batch")
        keys = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                "max_seqlen_q", "max_seqlen_kv")  # fmt: skip
        params = psu.get_packed_seq_params({k: batch[k] for k in keys})
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]
        embeds, labels, loss_mask, positions, _ = module.slice_batch_for_context_parallel(
            inputs_embeds=embeds, labels=batch["labels"], loss_mask=batch["loss_mask"],
            position_ids=batch["position_ids"], attention_mask=None, packed_seq_params=params,
            pg_collection=types.SimpleNamespace(cp=GroupStandIn(cp, rank)),
        )  # fmt: skip
        return split_fields(embeds[:, 0, 0], labels, loss_mask, positions), cu

    done = every_rank(split_rank)
    return done if isinstance(done, dict) else reproducer_outputs(*done)


def kimi_release_outputs(wheel):
    """kimi_k25_vl._split_on_cp_rank on every rank of the case, as KimiK25VLModel.forward
    splits a packed batch."""
    import torch

    module = load_from_wheel(wheel, KIMI, kimi_stubs())
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]
    split = module._split_on_cp_rank

    def split_rank(rank):
        batch, cu = packed_batch(reference_sequences(lengths), cp, tp, "in_batch")
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]
        return split_fields(
            split(embeds, cp, rank, seq_dim=0)[:, 0, 0],
            split(batch["labels"], cp, rank, seq_dim=1),
            split(batch["loss_mask"], cp, rank, seq_dim=1),
            split(batch["position_ids"], cp, rank, seq_dim=1),
        ), cu

    done = every_rank(split_rank)
    return done if isinstance(done, dict) else reproducer_outputs(*done)


def contiguous_release_outputs(wheel):
    """deepseek_v4_step._partition_packed_batch_contiguous on every rank of the case."""
    module = load_from_wheel(wheel, DSV4_STEP, contiguous_stubs())
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]

    def split_rank(rank):
        batch, cu = packed_batch(reference_sequences(lengths), cp, tp, **OPTIONS)
        module.parallel_state = ParallelStateStandIn(cp, rank, tp)
        out = module._partition_packed_batch_contiguous(batch, cp)
        return split_fields(out["tokens"], out["labels"], out["loss_mask"],
                            out["position_ids"]), cu  # fmt: skip

    done = every_rank(split_rank)
    return done if isinstance(done, dict) else reproducer_outputs(*done, layout="contiguous")


def reproducer_body(release_outputs, *parts) -> str:
    """A reproducer's body: the constants, the shared parts, `parts` (what `release_outputs`
    needs besides), `release_outputs`, the layout reference, and the entry points (the release
    run by `release_outputs`, judged by the reference's `reference_problems`)."""
    shared = (GroupStandIn, TransformerEngineStandIn, TorchWithGroups, megatron_cp_split,
              packed_batch, split_fields, reproducer_outputs, released_packed_seq_utils,
              every_rank)  # fmt: skip
    entry = entry_points(f"{release_outputs.__name__}(wheel)", "reference_problems(outputs)")
    parts = (*shared, *parts, release_outputs)
    return script_body(parts, CONSTANTS, after=layouts.REFERENCE, entry=entry)
