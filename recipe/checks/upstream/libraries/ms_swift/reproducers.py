"""The reproducers of ms-swift's and mcore-bridge's findings, as real code: the functions below
are shipped into each standalone script by `inspect.getsource` (after the prelude, which
provides `Placeholder`, `fetch_wheel` and `load_from_wheel`), so they are linted and scanned like
the rest. They need torch and the wheels only: megatron imports are answered by placeholders (the
split path calls none of it but PackedSeqParams, a record), and the ground truth is written out
again (`split_problems`, `round_trip_problems`) rather than imported from the recipe.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys

import torch

from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.parallel.cp.contract import unique_sequences
from recipe.upstream.prelude import Placeholder, load_from_wheel
from recipe.upstream.releases import ParallelStateStandIn

# The script's own imports: the shipped classes below subclass importlib.abc at definition time.
SCRIPT_IMPORTS = ("contextlib", "importlib.abc", "os", "torch")


class PackedSeqParams:
    """megatron-core's PackedSeqParams as the split path uses it: a record of its fields."""

    def __init__(self, **fields):
        vars(self).update(fields)


class MegatronStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `megatron` import answered by a placeholder module."""

    def find_spec(self, name, path, target=None):
        if name == "megatron" or name.startswith("megatron."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = Placeholder(spec.name)
        module.__path__ = []
        if spec.name == "megatron.core":
            module.__version__ = "0.16.0"
        if spec.name == "megatron.core.packed_seq_params":
            module.PackedSeqParams = PackedSeqParams
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def megatron_stand_in():
    finder = MegatronStandIn()
    saved = {k: v for k, v in sys.modules.items() if k == "megatron" or k.startswith("megatron.")}
    for key in saved:
        del sys.modules[key]
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[key]
        sys.modules.update(saved)


class TEPartitionStandIn:
    """TransformerEngine's `thd_get_partitioned_indices` (a CUDA kernel), transcribed from
    `thd_partition_indices_kernel` (transformer_engine/common/fused_attn/context_parallel.cu):
    for each of rank's total/world slots, the global index of the token it holds, each sequence
    of `cu_seqlens` split in 2*world chunks of which the rank holds chunk rank and 2*world-1-rank.
    The kernel asserts every boundary is a multiple of 2*world."""

    @staticmethod
    def thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
        cu = torch.as_tensor(cu_seqlens).to(torch.int64).cpu()
        if bool((cu % (world_size * 2)).any()):
            raise AssertionError(
                f"thd_get_partitioned_indices: cu_seqlens {cu.tolist()} not a multiple of "
                f"2*world_size={2 * world_size} (the kernel's assert)"
            )
        cu_s = cu // world_size
        token = torch.arange(int(total_tokens) // world_size)
        # the kernel's binary_search(token, cu_s, batch + 1): the last i with cu_s[i] <= token,
        # searched in [0, batch - 1]
        seq = torch.searchsorted(cu_s[1:-1], token, right=True)
        seq_len = cu_s[seq + 1] - cu_s[seq]
        index = token - cu_s[seq]
        offset = torch.where(index < seq_len // 2, rank, (world_size - 1) * 2 - rank)
        return index + cu_s[seq] * world_size + seq_len // 2 * offset


def logger(*args, **kwargs):
    import logging

    return logging.getLogger("repro")


def expected_slots(layout, rows, width, cp, rank, mode):
    """The global slots rank `rank` must hold: zigzag chunks rank and 2*cp-1-rank of every
    sample (the tail's padding in segments of 2*cp), or block `rank` of every row."""
    if mode == "contiguous":
        local = width // cp
        return [b * width + rank * local + k for b in range(rows) for k in range(local)]
    cuts = list(layout)
    while cuts[-1] < rows * width:
        cuts.append(min(cuts[-1] + 2 * cp, rows * width))
    index = []
    for a, b in zip(cuts, cuts[1:]):
        chunk = (b - a) // (2 * cp)
        index += range(a + rank * chunk, a + (rank + 1) * chunk)
        index += range(a + (2 * cp - 1 - rank) * chunk, a + (2 * cp - rank) * chunk)
    return index


def split_problems(outputs, case, options):
    """Each rank's slots against the ground truth of the row the release laid out: a real
    token with its own position and next token as label, weight 1 where a next token exists,
    0 on padding."""
    found = []
    layout, rows, width = outputs["layout"], outputs["rows"], outputs["width"]
    seqs = unique_sequences(case["lengths"])
    total = rows * width
    token, position, label, weight = [0] * total, [None] * total, [None] * total, [0] * total
    owner = ["padding"] * total
    for i, tokens in enumerate(seqs):
        for p in range(layout[i + 1] - layout[i]):
            g = layout[i] + p
            if p < len(tokens):
                token[g], position[g], owner[g] = tokens[p], p, f"sequence {i} position {p}"
            if p + 1 < len(tokens):
                label[g], weight[g] = tokens[p + 1], 1
    mode = options.get("cp_partition_mode", "zigzag")
    for rank, got in enumerate(outputs["ranks"]):
        index = expected_slots(layout, rows, width, case["cp"], rank, mode)
        for name, values in got.items():
            if len(values) != len(index):
                found.append(f"rank {rank}: {name} holds {len(values)} slots, not {len(index)}")
        for slot, g in enumerate(index):
            want = {"loss_mask": weight[g]}
            if position[g] is not None:
                want.update(input_ids=token[g], position_ids=position[g])
            if weight[g]:
                want["labels"] = label[g]
            for name, value in want.items():
                if name in got and slot < len(got[name]) and got[name][slot] != value:
                    found.append(
                        f"rank {rank}, local slot {slot} (global slot {g}, {owner[g]}): "
                        f"{name} expected {value}, got {got[name][slot]}"
                    )
    if len(found) > 12:
        found = found[:12] + [f"... and {len(found) - 12} more"]
    return found


def split_outputs(wheel, case, o):
    """Each rank's split of the packed fields (tokens, positions, next-token labels, weights)."""
    with megatron_stand_in():
        bridge = load_from_wheel(
            wheel,
            "mcore_bridge/utils/megatron_utils.py",
            {"transformers": {}, "mcore_bridge.utils.logger": {"get_logger": logger}},
            package="mcore_bridge.utils",
        )
    cp, tp = case["cp"], case["tp"]
    seqs = unique_sequences(case["lengths"])
    unit = 2 * cp * tp
    padded = [-(-len(s) // unit) * unit for s in seqs]
    rows = len(seqs) if o["cu_seqlens"] == "rows" else 1
    width = max(padded) if rows > 1 else sum(padded)
    layout = [0]
    for n in padded:
        layout.append(layout[-1] + (width if rows > 1 else n))
    total = rows * width
    fields = {
        k: [v] * total
        for k, v in (("input_ids", 0), ("position_ids", 0), ("labels", -100), ("loss_mask", 0))
    }
    for i, tokens in enumerate(seqs):
        for p, token in enumerate(tokens):
            g = layout[i] + p
            fields["input_ids"][g], fields["position_ids"][g] = token, p
            if p + 1 < len(tokens):
                fields["labels"][g], fields["loss_mask"][g] = tokens[p + 1], 1
    shape, dim = o["dim"].split(":")
    cu = None if rows > 1 else torch.tensor(layout, dtype=torch.int32)
    kwargs = {} if o["cp_partition_mode"] == "zigzag" else {"cp_partition_mode": "contiguous"}
    outputs = {"layout": layout, "rows": rows, "width": width, "ranks": []}
    for rank in range(cp):
        bridge.mpu = ParallelStateStandIn(cp, rank, tp)
        got = {}
        for name, values in fields.items():
            x = torch.tensor(values).reshape(rows, width)
            if shape != "bs":
                x = torch.stack([x, x], dim=-1)
                x = x if shape == "bsh" else x.transpose(0, 1).contiguous()
            y = bridge.split_cp_inputs(x, cu, int(dim), **kwargs)
            if shape == "sbh":
                y = y.transpose(0, 1)
            got[name] = (y if shape == "bs" else y[..., 0]).reshape(-1).tolist()
        outputs["ranks"].append(got)
    return outputs


COMMON = (
    PackedSeqParams,
    MegatronStandIn,
    megatron_stand_in,
    TEPartitionStandIn,
    logger,
    unique_sequences,  # the contract's own tokens: plain Python, shipped as they are
)
SPLIT_TRUTH = (expected_slots, split_problems)


def script(parts: tuple, constants: dict, entry: str) -> str:
    """The body of a reproducer: the imports, `parts`' sources, `constants` and the entry
    functions (`release_outputs`, `problems`) calling the parts with CASE and OPTIONS."""
    return script_body(parts, constants, imports=SCRIPT_IMPORTS, entry=entry)


def split_body(defaults: dict) -> str:
    return script(
        (*COMMON, *SPLIT_TRUTH, split_outputs),
        {"DEFAULTS": defaults},
        entry_points(
            "split_outputs(wheel, CASE, {**DEFAULTS, **OPTIONS})",
            "split_problems(outputs, CASE, OPTIONS)",
        ),
    )
