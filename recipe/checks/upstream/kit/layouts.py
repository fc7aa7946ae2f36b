"""What the library plugins share: the stand-ins for the collectives and process groups their
functions call, the broken copy (one line of the release's source changed), the worst of
several findings, and the reproducers' own reference of the zigzag and contiguous layouts.

A reproducer must run with torch and the wheel alone, so it cannot call the recipe's ground truth;
`REFERENCE` is a second, independent statement of the two layouts in plain Python (slot by slot,
no index tensors) that each reproducer embeds, and `truth_outputs` builds what a correct function
returns from the recipe's own ground truth (`contract.global_batch` + `zigzag.zigzag_index`), so
`reference_problems(truth_outputs(...)) == []` checks the two against each other.
"""

from __future__ import annotations

import inspect
import textwrap

import torch

from recipe.checks.upstream.kit import reference
from recipe.checks.upstream.kit.checked import Finding, shipped_module_source
from recipe.parallel.cp.contract import global_batch, unique_sequences
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.source import UpstreamUnavailable

FIELDS = ("input_ids", "position_ids", "labels", "loss_mask")


def worst(*findings: Finding | None) -> Finding | None:
    """The finding with the worst impact (the first of equals), or None."""
    present = [f for f in findings if f is not None]
    return max(present, key=lambda f: f.impact) if present else None


def round_trip_values(lengths, width: int | None) -> list[torch.Tensor]:
    """A per-token float tensor to shard and gather back: unique per token (and per column when
    `width` gives the output a trailing dimension), exactly representable."""
    stride = max(lengths) + 1
    values = []
    for i, n in enumerate(lengths):
        column = torch.arange(n, dtype=torch.float64) + 1 + stride * i
        if width is not None:
            column = column[:, None] + 0.25 * torch.arange(width, dtype=torch.float64)
        values.append(column)
    return values


class DistributedStandIn:
    """torch.distributed as a postprocess function sees it while one process plays every rank:
    all_gather hands back every rank's shard as that rank's own preprocess call produced it."""

    def __init__(self, shards: list[torch.Tensor]):
        self._shards = shards

    def all_gather(self, outputs: list, tensor, group=None) -> None:
        if len(outputs) != len(self._shards):
            raise RuntimeError(f"all_gather into {len(outputs)} tensors over {len(self._shards)}")
        for out, shard in zip(outputs, self._shards, strict=True):
            out.copy_(shard)

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)


class GatherStandIn:
    """The module's `torch` with its collectives played (see DistributedStandIn)."""

    def __init__(self, shards: list[torch.Tensor]):
        self.distributed = DistributedStandIn(shards)

    def __getattr__(self, name: str):
        return getattr(torch, name)


class GroupStandIn:
    """A process group as Bridge's code asks it: its size and this rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Distributed:
    def __init__(self, owner: CollectivesStandIn):
        self._owner = owner

    def all_gather(self, outputs: list, tensor, group=None) -> None:
        self._owner.gather(outputs, tensor)

    def get_world_size(self, group=None) -> int:
        return group.size()

    def get_rank(self, group=None) -> int:
        return group.rank()

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)


class CollectivesStandIn:
    """`torch` as a loaded module sees it while one process plays every rank: `all_gather` of a
    tensor this rank produced hands back every rank's tensor of the same name, and
    `get_world_size`/`get_rank` answer from the group stand-in."""

    def __init__(self, per_rank: list[dict[str, torch.Tensor]] | None = None):
        self.distributed = _Distributed(self)
        self.per_rank = per_rank or []
        self.rank = 0

    def gather(self, outputs: list, tensor) -> None:
        mine = self.per_rank[self.rank]
        name = next((k for k, v in mine.items() if v.data_ptr() == tensor.data_ptr()), None)
        if name is None:
            raise RuntimeError(
                "all_gather of a tensor no rank produced: the stand-in cannot play it"
            )
        for out, theirs in zip(outputs, (ranks[name] for ranks in self.per_rank), strict=True):
            out.copy_(theirs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def mutated_source(function, line: str, replacement: str, label: str) -> str:
    """The released source of `function` with `line` (which must be in it exactly once) replaced
    by `replacement`: every plugin's negative control is this one-line change. Raises
    UpstreamUnavailable when the release no longer has the line once."""
    source = inspect.getsource(function)
    if source.count(line) != 1:
        raise UpstreamUnavailable(
            f"{label}: the negative control's line `{line}` is not once in this release's "
            f"{function.__name__}; its plugin must learn the function's new shape"
        )
    return source.replace(line, replacement)


def mutated_copy(module, names: tuple[str, ...], target: str | None, line: str, replacement: str,
                 label: str, overrides: dict | None = None):  # fmt: skip
    """A copy of `module` whose functions `names` are re-executed from their released source in
    the copy's namespace (after `overrides` are set in it), `line` of `target` replaced by
    `replacement` (`mutated_source`; target None changes no line). Executed in the copy's own
    namespace, so the stand-ins a plugin sets on the copy are what the functions read."""
    broken = type(module)(module.__name__ + "_broken")
    vars(broken).update({k: v for k, v in vars(module).items() if k != "__name__"})
    vars(broken).update(overrides or {})
    for name in names:
        function = getattr(module, name)
        if name == target:
            source = mutated_source(function, line, replacement, label)
        else:
            source = inspect.getsource(function)
        exec(source, vars(broken))  # noqa: S102 (the release's own source, or our one-line change)
    return broken


def mutated_function(function, line: str, replacement: str, label: str):
    """`function` with one line changed (`mutated_source`), executed in a copy of its module's
    namespace (the stand-ins set on the copy never reach the release); a method's source is
    dedented first, and the result is a plain function to set on a subclass."""
    namespace = dict(function.__globals__)
    source = textwrap.dedent(mutated_source(function, line, replacement, label))
    exec(source, namespace)  # noqa: S102
    return namespace[function.__name__]


def truth_outputs(lengths, cp: int, tp: int, fields=FIELDS, *, layout: str = "zigzag",
                  attention_mask: bool = False, width: int | None = None,
                  round_trip: bool = False) -> dict:  # fmt: skip
    """What a correct function gives in the reproducers' structure, from the recipe's ground
    truth: the sequences padded to 2*cp*tp, each rank's slots by the zigzag index (or the
    consecutive slice for the contiguous layout)."""
    batch = global_batch(unique_sequences(list(lengths)), cp, tp)
    cu = batch.cu_seqlens_padded
    ranks = []
    for rank in range(cp):
        if layout == "zigzag":
            index = zigzag_index(cu, cp, rank)
        else:
            width_of_rank = int(cu[-1]) // cp
            index = torch.arange(rank * width_of_rank, (rank + 1) * width_of_rank)
        got = {name: getattr(batch, name).index_select(0, index).tolist() for name in fields}
        if attention_mask:
            got["attention_mask"] = (batch.input_ids.index_select(0, index) != 0).int().tolist()
        ranks.append(got)
    return {
        "lengths": list(lengths),
        "cp": cp,
        "layout": layout,
        "cu_seqlens_padded": cu.tolist(),
        "ranks": ranks,
        "round_trip": [[v.tolist() for v in round_trip_values(lengths, width)] for _ in range(cp)]
        if round_trip
        else None,
        "width": width,
        "error": None,
    }


# The reproducers' reference: `reference_problems(outputs)` of what `truth_outputs` builds.
REFERENCE = shipped_module_source(reference)
