"""The checker's side of the functions training can call (`recipe/upstream/releases.py`): each
loaded release as a `ContractChecked` (the zigzag contract on every rank, then the round trip of a
per-token tensor through the library's own gathering function), its negative control, and its
standalone reproducer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts, zigzag_call
from recipe.checks.upstream.kit.checked import (
    CheckTarget,
    ContractChecked,
    Finding,
    function_line,
)
from recipe.checks.upstream.kit.layouts import GatherStandIn
from recipe.parallel.cp.contract import global_batch, index_preprocess
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


def released_library(library: str, own: tuple[CheckTarget, ...]) -> releases.Library:
    """`library` as training lists it (`releases.LIBRARIES`): the functions training can call,
    then the plugin's `own` targets."""
    listed = releases.LIBRARIES[library]
    targets = (*(ReleasedTarget(t) for t in listed.targets), *own)
    return releases.Library(listed.distribution, targets, listed.releases)


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
        fields = thd_fields if self.target.style == "thd" else bshd_fields
        body = zigzag_call.script(
            (nested, label_mask, padded_rows, fields),
            fields.__name__,
            {"STUBS": dict(self.target.stubs), "FILE": self.file, "FUNCTION": self.function_name},
        )
        title = (
            f"{self.label} ({self.file}:{self.line}): {finding.impact.label} on "
            f"{_case_text(finding.case)}"
        )
        return self.reproducer_script(title, finding, body)

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
