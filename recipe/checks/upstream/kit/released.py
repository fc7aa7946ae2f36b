"""The checker's side of the functions training can call (`recipe/upstream/releases.py`): each
loaded release as a `ContractChecked` (the zigzag contract on every rank, then the round trip of a
per-token tensor through the library's own gathering function), its negative control, and its
standalone reproducer."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    CheckTarget,
    ContractChecked,
    Finding,
    function_line,
    reproducer_source,
)
from recipe.checks.upstream.kit.layouts import GatherStandIn
from recipe.parallel.cp.contract import Impact, global_batch, index_preprocess
from recipe.upstream import releases
from recipe.upstream.releases import (
    ParallelStateStandIn,
    Released,
    bshd_fields,
    label_mask,
    nested,
    padded_rows,
    thd_fields,
)
from recipe.upstream.source import UpstreamUnavailable


@dataclass(frozen=True)
class ReleasedTarget(CheckTarget):
    """A function training can call (`releases.Target`), as the checker's registry lists it."""

    target: releases.Target

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def file(self) -> str:
        return self.target.file

    def load(self, library: str, distribution: str, version: str | None) -> Loaded:
        return load(library, version, self.target)


def released_targets(library: str) -> tuple[ReleasedTarget, ...]:
    return tuple(ReleasedTarget(t) for t in releases.LIBRARIES[library].targets)


def load(library: str, version: str | None, target: releases.Target) -> Loaded:
    """The function from `version` (None: the installed release), ready to check."""
    return Loaded.of(releases.load(library, version, target))


@dataclass
class Loaded(ContractChecked):
    """A target loaded from one release: its function and the options it draws."""

    released: Released | None = None

    @classmethod
    def of(cls, released: Released) -> Loaded:
        return cls(released.library, released.version, released.target.name,
                   released.distribution, released.target.file, released.drawn,
                   released.skipped, released.notes, released=released)  # fmt: skip

    @property
    def target(self) -> releases.Target:
        return self.released.target

    @property
    def module(self):
        return self.released.module

    @property
    def function_name(self) -> str:
        return self.released.function_name

    @property
    def inverse_name(self) -> str | None:
        return self.released.inverse_name

    @property
    def function(self) -> Callable:
        return getattr(self.module, self.function_name)

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    def finding(self, case, options: dict) -> Finding | None:
        """The zigzag contract on every rank, then the round trip through the inverse."""
        found = super().finding(case, options)
        if found is not None or self.inverse_name is None:
            return found
        lengths, cp_size, tp_size = case
        try:
            problem = self.round_trip_problem(lengths, cp_size, tp_size, options)
            impact = Impact.MISPLACED
        except Exception as err:  # noqa: BLE001 (an upstream function raising is the finding)
            problem = (
                f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: the round trip through "
                f"{self.inverse_name} raises {type(err).__name__}: {err}"
            )
            impact = Impact.RAISES
        if problem is None:
            return None
        return Finding(
            {"lengths": list(lengths), "cp": cp_size, "tp": tp_size, "round_trip": True},
            tuple(sorted(options.items())),
            impact,
            problem,
        )

    def reproducer(self, finding: Finding) -> str | None:
        if finding.case.get("round_trip"):
            return None  # the gather needs every rank's collective: not one standalone script
        helpers = [nested, label_mask, padded_rows]
        helpers.append(thd_fields if self.target.style == "thd" else bshd_fields)
        body = "\n\n".join(inspect.getsource(h) for h in helpers)
        body = body.replace("thd_fields" if self.target.style == "thd" else "bshd_fields", "fields")
        head = REPRODUCER_CALL.format(
            stubs=dict(self.target.stubs), file=self.file, function=self.function_name
        )
        title = (
            f"{self.label} ({self.file}:{self.line}): {finding.impact.label} on "
            f"{_case_text(finding.case)}"
        )
        return reproducer_source(title, finding, head + "\n\n" + body + "\n\n" +
                                 ZIGZAG_PROBLEMS, self.distribution, self.version)  # fmt: skip

    def truth_outputs(self, finding: Finding) -> list[dict]:
        """Every rank's fields from the ground truth (the recipe's index) on the case."""
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        stride = max(lengths) + 1
        sequences = [torch.arange(n) + 1 + stride * i for i, n in enumerate(lengths)]
        batch = global_batch([s.tolist() for s in sequences], cp, tp)
        outputs = []
        for rank in range(cp):
            got = index_preprocess(sequences, batch.cu_seqlens_padded, cp, rank, tp)
            outputs.append({k: v.tolist() for k, v in got.items()})
            outputs[-1]["cu_seqlens_padded"] = batch.cu_seqlens_padded.tolist()
        return outputs

    def round_trip_problem(self, lengths, cp_size: int, tp_size: int, options: dict) -> str | None:
        """Shard a per-token tensor on every rank, gather it back through the library's own
        postprocess function on every rank: where it differs from the original, or None."""
        if self.inverse_name is None:
            return None
        options = dict(options)
        side = options.pop("mask_side", "right")
        dtype = getattr(torch, options.pop("mask_dtype", "bool"))
        stride = max(lengths) + 1
        values = [
            torch.arange(n, dtype=torch.float64) + 1 + stride * i for i, n in enumerate(lengths)
        ]
        if self.target.style == "thd":
            given = nested(values)
            extra = {}
        else:
            given, mask = padded_rows(values, side)
            extra = {"attention_mask": mask.to(dtype)}
        shards, params = [], None
        for rank in range(cp_size):
            self.module.mpu = ParallelStateStandIn(cp_size, rank, tp_size)
            out = self.function(given, *extra.values(), pre_process=True, **options)
            shards.append(out[0])
            params = out[1]
        inverse = getattr(self.module, self.inverse_name)
        try:
            self.module.torch = GatherStandIn(shards)
            for rank in range(cp_size):
                self.module.mpu = ParallelStateStandIn(cp_size, rank, tp_size)
                if self.target.style == "thd":
                    back = inverse(shards[rank], params, given, len(lengths)).unbind()
                else:
                    rows = inverse(shards[rank], params, extra["attention_mask"], *given.shape)
                    back = [row[m] for row, m in zip(rows, extra["attention_mask"].bool())]
                for i, (want, got) in enumerate(zip(values, back)):
                    if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
                        return (
                            f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: rank {rank}: "
                            f"{self.inverse_name} gives sequence {i} back as "
                            f"{_head(got)}, sharded from {_head(want)}"
                        )
        finally:
            self.module.torch = torch
        return None

    @property
    def label(self) -> str:
        return f"{self.library}@{self.version} {self.target.name}"

    def contract_function(self, options: dict, parallel_state=None) -> Callable:
        return self.released.contract_function(options, parallel_state)

    def broken_copy(self, part: str = "function") -> Loaded:
        """The negative control: a copy with one deliberate off-by-one. part="function": the
        sharding function's back chunk starts one row late; part="inverse": the gathering
        function reads each sequence one row late (the round trip's own control)."""
        mutations = {
            "function": "remain_start = seqlen_padded_i - half_seqlen * (cp_rank + 1)",
            "inverse": "packed_start_idx = cu_padded_cpu[i] // cp_size",
        }
        names = {"function": self.function_name, "inverse": self.inverse_name}
        if names[part] is None:
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        line = mutations[part]
        present = tuple(name for name in names.values() if name is not None)
        broken = layouts.mutated_copy(
            self.module, present, names[part], line, line + " + 1", self.label
        )
        return dataclasses.replace(self, released=dataclasses.replace(self.released, module=broken))


def _head(values: torch.Tensor, shown: int = 6) -> str:
    listed = [int(v) if float(v).is_integer() else float(v) for v in values.flatten()[:shown]]
    return f"{listed}{' ...' if values.numel() > shown else ''} ({values.numel()} values)"


def _case_text(case: dict) -> str:
    return f"lengths={case['lengths']} cp={case['cp']} tp={case['tp']}"


# The reproducer's call of a zigzag-contract function: every rank played in one process, the
# function reading its rank from a stand-in for megatron's parallel_state, as in the checker.
REPRODUCER_CALL = """
import torch

STUBS = {stubs!r}
FILE = {file!r}
FUNCTION = {function!r}


def case_sequences():
    \"\"\"The case's sequences, token ids unique over the batch (0 is padding).\"\"\"
    stride = max(CASE["lengths"]) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(CASE["lengths"])]


def release_outputs(wheel):
    \"\"\"Every rank's input_ids, position_ids, labels, loss_mask and cu_seqlens_padded.\"\"\"
    module = load_from_wheel(wheel, FILE, STUBS)
    logger = getattr(module, "logger", None)
    if logger is not None and not hasattr(logger, "warning_once"):
        logger.warning_once = logger.debug  # the package's __init__ (not run) adds it
    function = getattr(module, FUNCTION)
    sequences = [torch.tensor(s) for s in case_sequences()]
    outputs = []
    for rank in range(CASE["cp"]):
        module.mpu = ParallelStateStandIn(CASE["cp"], rank, CASE["tp"])
        got = fields(function, sequences, dict(OPTIONS))
        outputs.append({{k: v.tolist() for k, v in got.items()}})
    return outputs
"""

# The reproducer's ground truth, written out on its own (it imports nothing of the recipe).
ZIGZAG_PROBLEMS = """
def problems(outputs):
    \"\"\"What differs from zigzag CP: every real token on exactly one rank, rank r holding
    chunks r and 2*cp-1-r of every sequence padded to a multiple of 2*cp, at its own slot, with
    its position, the next token of its own sequence as its label, and loss weight 1 where such a
    label exists; padding never weighted.\"\"\"
    cp = CASE["cp"]
    sequences = case_sequences()
    where = {t: (i, p) for i, s in enumerate(sequences) for p, t in enumerate(s)}
    found, seen = [], {}
    for rank, out in enumerate(outputs):
        for slot, token in enumerate(out["input_ids"]):
            if token not in where:
                if out.get("loss_mask") and out["loss_mask"][slot]:
                    found.append(f"rank {rank} slot {slot}: padding has loss mask 1")
                continue
            seen.setdefault(token, []).append((rank, slot))
            i, p = where[token]
            n = len(sequences[i])
            want = {"position_ids": p, "loss_mask": int(p + 1 < n)}
            if p + 1 < n:
                want["labels"] = sequences[i][p + 1]
            for name, value in want.items():
                if name in out and out[name][slot] != value:
                    found.append(f"rank {rank} slot {slot} (sequence {i}, position {p}): "
                                 f"{name} is {out[name][slot]}, should be {value}")
    cu = outputs[0]["cu_seqlens_padded"]
    for token, (i, p) in where.items():
        places = seen.get(token, [])
        if not places:
            found.append(f"sequence {i} position {p} (token {token}) is on no rank")
            continue
        if len(places) > 1:
            found.append(f"sequence {i} position {p} is on ranks {[r for r, _ in places]}")
        padded = cu[i + 1] - cu[i]
        if padded % (2 * cp):
            continue  # reported once per sequence below
        chunk = padded // (2 * cp)
        c = p // chunk
        rank = c if c < cp else 2 * cp - 1 - c
        slot = cu[i] // cp + p - c * chunk + (0 if c < cp else chunk)
        if places[0] != (rank, slot):
            found.append(f"sequence {i} position {p} is at rank {places[0][0]} slot "
                         f"{places[0][1]}, zigzag puts it at rank {rank} slot {slot}")
    for i in range(len(sequences)):
        padded = cu[i + 1] - cu[i]
        if padded % (2 * cp):
            found.append(f"sequence {i} is padded to {padded}, not a multiple of 2*cp={2 * cp}: "
                         "zigzag CP cannot split it into whole chunks")
    return found
"""
