"""The reproducer of the inverses' findings (a CP round trip through `reconstruct_tensor_cp`),
as real code shipped by `inspect.getsource` after the prelude and the shared parts of
`reproducers.py`. The inverses' undo is megatron-core's `_undo_attention_load_balancing`, so the
ms-swift utils and mcore-bridge scripts need megatron-core; TransformerEngine's partition kernel
is played by the checker's own transcription (`reproducers.TEPartitionStandIn`)."""

from __future__ import annotations

import types

import torch

from recipe.checks.upstream.kit.checked import entry_points
from recipe.checks.upstream.libraries.ms_swift.reproducers import (
    COMMON,
    PackedSeqParams,
    TEPartitionStandIn,
    logger,
    megatron_stand_in,
    script,
)
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import ParallelStateStandIn


class Collectives:
    """The module's torch, all_gather handing back every rank's shard."""

    def __init__(self, shards):
        self.shards = shards
        self.distributed = self

    def all_gather(self, outputs, tensor, group=None):
        for out, shard in zip(outputs, self.shards):
            out.copy_(shard)

    def __getattr__(self, name):
        return getattr(torch, name)


def load_inverse(wheel, spec):
    none = {}
    if spec["call"] == "trainer":  # calls no megatron code: placeholders for its imports
        packages = {"swift": none, "swift.megatron": none, "swift.megatron.utils": none}
        stubs = {
            **packages,
            "accelerate": none,
            "accelerate.utils": none,
            "swift.dataloader": none,
            "swift.utils": {"get_logger": logger},
        }
        with megatron_stand_in():
            return load_from_wheel(wheel, spec["relative"], stubs, package=spec["package"])
    try:  # its undo is megatron-core's _undo_attention_load_balancing: needs megatron-core
        import megatron.core  # noqa: F401
    except ImportError:
        print("this reproducer needs megatron-core (pip install megatron-core)")
        raise SystemExit(2) from None
    if spec["call"] == "bridge":
        stubs = {"transformers": none, "mcore_bridge.utils.logger": {"get_logger": logger}}
    else:
        stubs = {
            "transformers": none,
            "transformers.utils": {"is_torch_npu_available": lambda: False},
            "swift": none,
            "swift.tuners": none,
            "swift.utils": {"get_logger": logger},
        }
    module = load_from_wheel(wheel, spec["relative"], stubs, package=spec["package"])
    undo = module._undo_attention_load_balancing
    played = {"is_te_min_version": lambda *a, **k: True, "tex": TEPartitionStandIn}
    namespace = dict(undo.__globals__, **played)
    module._undo_attention_load_balancing = types.FunctionType(
        undo.__code__, namespace, undo.__name__, undo.__defaults__, undo.__closure__
    )
    return module


def original(spec):
    rows, width = spec["rows"], spec["width"]
    return torch.arange(1, rows * width + 1, dtype=torch.float64).reshape(rows, width)


def split(values, cp, rank, spec):
    """What each rank holds: zigzag chunks of every segment of cu (whole rows without one), or
    block `rank` of every row."""
    width = spec["width"]
    if spec["mode"] == "contiguous":
        local = width // cp
        return values[:, rank * local : (rank + 1) * local]
    cuts = spec["cu"] or [0, width]
    index = []
    for a, b in zip(cuts, cuts[1:]):
        chunk = (b - a) // (2 * cp)
        index += range(a + rank * chunk, a + (rank + 1) * chunk)
        index += range(a + (2 * cp - 1 - rank) * chunk, a + (2 * cp - rank) * chunk)
    return values[:, index]


def round_trip_outputs(wheel, case, spec):
    module = load_inverse(wheel, spec)
    cp, tp = case["cp"], case["tp"]
    shape, dim = spec["dim"].split(":")
    params = None
    if spec["cu"] is not None:
        cu = torch.tensor(spec["cu"], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
            seq_lens=torch.tensor(case["lengths"]),
        )
    shards = []
    for rank in range(cp):
        x = split(original(spec), cp, rank, spec)
        if shape != "bs":
            x = torch.stack([x * 2, x * 2 + 1], dim=-1)
            x = x if shape == "bsh" else x.transpose(0, 1).contiguous()
        shards.append(x)
    module.torch = Collectives(shards)
    outputs = {"ranks": []}
    for rank in range(cp):
        module.mpu = ParallelStateStandIn(cp, rank, tp)
        if spec["call"] == "trainer":
            got = module.reconstruct_tensor_cp(
                cp, shards[rank], params, len(case["lengths"]), spec["mode"]
            )
        else:
            got = module.reconstruct_tensor_cp(
                shards[rank], params, int(dim), cp_partition_mode=spec["mode"]
            )
        if shape == "sbh":
            got = got.transpose(0, 1)
        if shape != "bs":
            got = torch.div(got[..., 0], 2, rounding_mode="floor")
        outputs["ranks"].append(got.tolist())
    return outputs


def round_trip_problems(outputs, case, spec):
    """Each rank's result against the original: every real token's value back in its slot."""
    expected = original(spec)[:, : spec["expected_width"]]
    owner = {}
    for i, n in enumerate(case["lengths"]):
        for p in range(n):
            owner[spec["layout"][i] + p] = f"sequence {i} position {p}"
    found = []
    for rank, got in enumerate(outputs["ranks"]):
        got = torch.tensor(got, dtype=torch.float64)
        if got.shape != expected.shape:
            found.append(
                f"rank {rank}: shape {tuple(got.shape)}, the original {tuple(expected.shape)}"
            )
            continue
        for b in range(expected.shape[0]):
            for s in range(expected.shape[1]):
                g = b * spec["width"] + s
                if g in owner and got[b, s] != expected[b, s]:
                    have = owner.get(int(got[b, s]) - 1, "padding")
                    found.append(
                        f"rank {rank}: row {b} slot {s} ({owner[g]}) gets the value of {have}"
                    )
    if len(found) > 12:
        found = found[:12] + [f"... and {len(found) - 12} more"]
    return found


def round_trip_body(spec: dict) -> str:
    parts = (*COMMON, Collectives, load_inverse, original, split,
             round_trip_outputs, round_trip_problems)  # fmt: skip
    return script(
        parts,
        {"SPEC": spec},
        entry_points(
            "round_trip_outputs(wheel, CASE, SPEC)", "round_trip_problems(outputs, CASE, SPEC)"
        ),
    )
