"""The checked targets: yunchang's three shard functions of one release, their options (drawn,
fixed, or a refusal), their negative controls and their reproducers.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    IMPACTS,
    Checked,
    CheckTarget,
    Finding,
    function_line,
)
from recipe.checks.upstream.libraries.yunchang.ranks import StandInMissing, run_ranks
from recipe.checks.upstream.libraries.yunchang.reproducer import script
from recipe.checks.upstream.libraries.yunchang.truth import (
    layout_problems,
    layout_unit,
    truth_outputs,
)
from recipe.upstream.prelude import swapped_modules
from recipe.upstream.releases import unknown_option
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

EXTRACT_FILE = "yunchang/comm/extract_local.py"
GLOBALS_FILE = "yunchang/globals.py"
LAYOUTS = {
    "zigzag_extract_local": "zigzag",
    "stripe_extract_local": "stripe",
    "basic_extract_local": "basic",
}
DEGREES = ((2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (3, 1), (1, 3), (2, 3), (3, 2), (2, 4), (4, 2))
FEATURES = ((), (1,), (2,), (4,), (2, 3), (4, 2))

# Parameters of the functions and of set_seq_parallel_pg the checker sets itself, and why.
FIXED = {
    "value": "the drawn [batch, seqlen, *features] tensor of unique ids",
    "rank": "each rank of one sequence-parallel group in turn (dp 1), as yunchang's test passes "
    "it; zigzag reads its ring and ulysses ranks from the groups instead",
    "world_size": "rd * ud, the sequence-parallel degree",
    "rd": "the case's ring degree",
    "ud": "the case's ulysses degree",
    "args": "nothing more is passed",
    "kwargs": "only rd and ud (basic takes them here and reads neither)",
}
PG_FIXED = {
    "sp_ulysses_degree": "the case's ulysses degree",
    "sp_ring_degree": "the case's ring degree",
    "rank": "the rank being played",
    "world_size": "rd * ud: dp 1, every dp group has the same layout",
}
DRAWN = {"use_ulysses_low": (True, False), "dim": (1, 2)}
# globals.py's optional kernel imports (globals.py:83-135), each in try/except ImportError:
# set_seq_parallel_pg uses none, and a found flashinfer makes the module set TORCH_CUDA_ARCH_LIST
# in this process's environment (globals.py:99-108), so they are made to fail while it loads.
OPTIONAL_KERNELS = (
    "flash_attn",
    "flash_attn_interface",
    "flashinfer",
    "aiter",
    "sageattention",
    "spas_sage_attn",
    "torch_npu",
)

# The broken copies (negative controls): one line of the release's own source, mutated.
MUTATIONS = {
    "zigzag_extract_local": (
        "value_chunks[2 * rd - r_rank - 1]",
        "value_chunks[2 * rd - r_rank - 2]",
    ),
    "stripe_extract_local": (
        "value = value.transpose(1, 2).reshape(batch_size, seqlen, -1).contiguous()",
        "value = value.reshape(batch_size, seqlen, -1).contiguous()",
    ),
    "basic_extract_local": (
        "value.chunk(world_size, dim=1)[rank]",
        "value.chunk(world_size, dim=1)[rank - 1]",
    ),
}


@dataclass
class ExtractChecked(Checked):
    """One of the three functions of one release."""

    module: object = None
    groups: object = None  # the release's globals.py, loaded by path
    function_name: str = ""
    layout: str = ""
    broken: bool = False

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    def cases(self, min_length: int = 1):
        from hypothesis import strategies as st

        layout = self.layout

        @st.composite
        def draw(draw):
            ring, ulysses = draw(st.sampled_from(DEGREES))
            unit = layout_unit(layout, ring, ulysses)
            length = st.one_of(
                st.integers(1, 6).map(lambda k: k * unit),
                st.tuples(st.integers(1, 6), st.sampled_from([-1, 1])).map(
                    lambda kd: kd[0] * unit + kd[1]
                ),
                st.integers(1, 64),
            )
            return {
                "batch": draw(st.sampled_from([1, 2])),
                "length": max(draw(length), min_length),
                "features": list(draw(st.sampled_from(FEATURES))),
                "ring": ring,
                "ulysses": ulysses,
            }

        return draw()

    def _options(self, options: dict) -> dict:
        unknown = set(options) - set(self.drawn)
        if unknown:
            raise UpstreamUnavailable(
                f"{self.label}: {', '.join(sorted(unknown))} is not an option of this function "
                f"(drawn: {', '.join(self.drawn)})"
            )
        return {k: v for k, v in options.items() if v is not None}

    def outputs(self, case: dict, options: dict) -> list[dict]:
        """Every rank's output of the release (or the broken copy) on this case."""
        try:
            return run_ranks(self.module, self.groups, self.function_name, case, options)
        except StandInMissing as err:
            raise UpstreamUnavailable(
                f"{self.label}: {err}; teach recipe/checks/upstream/libraries/yunchang/ranks.py "
                "what it does"
            ) from None

    def finding(self, case, options: dict) -> Finding | None:
        options = self._options(options)
        found = layout_problems(self.layout, case, options, self.outputs(case, options))
        if not found:
            return None
        kind, what = max(found, key=lambda kw: IMPACTS[kw[0]])
        return Finding(dict(case), tuple(sorted(options.items())), IMPACTS[kind], what)

    def broken_copy(self, part: str = "function") -> ExtractChecked:
        """The release's function with one line mutated (MUTATIONS): zigzag takes chunk
        2*rd-r-2 as its back chunk, stripe forgets the transpose that strides the positions,
        basic takes chunk rank-1."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break (only: function)")
        line, mutated = MUTATIONS[self.function_name]
        name = self.function_name
        broken = layouts.mutated_copy(self.module, (name,), name, line, mutated, self.label)
        return dataclasses.replace(self, module=broken, broken=True)

    def reproducer(self, finding: Finding) -> str | None:
        if self.broken:
            return None  # a reproducer runs the release from its wheel, not a mutated copy
        body = script(self.layout, self.function_name, GLOBALS_FILE, EXTRACT_FILE)
        title = f"{self.label}: {self.file}:{self.line}, the minimal case the checker found"
        return self.reproducer_script(title, finding, body)

    def truth_outputs(self, finding: Finding):
        return truth_outputs(self.layout, finding.case, dict(finding.options))


@dataclass(frozen=True)
class ExtractTarget(CheckTarget):
    name: str
    file: str = EXTRACT_FILE
    notes: tuple[str, ...] = field(default=())

    def load(self, library: str, distribution: str, version: str | None) -> ExtractChecked:
        path, version = source_file(distribution, version, self.file)
        groups_path, _ = source_file(distribution, version, GLOBALS_FILE)
        tag = f"{library}_{version}".replace(".", "_").replace("-", "_")
        with swapped_modules(dict.fromkeys(OPTIONAL_KERNELS)):  # None: their imports fail
            groups = load_module(groups_path, f"recipe_upstream_{tag}_globals", {})
        module = load_module(
            path,
            f"recipe_upstream_{tag}_extract_local",
            {"yunchang.globals": {"PROCESS_GROUP": getattr(groups, "PROCESS_GROUP", None)}},
        )
        layout = LAYOUTS[self.name]
        label = f"{library}@{version} {self.name}"
        function = getattr(module, self.name, None)
        make_groups = getattr(groups, "set_seq_parallel_pg", None)
        if not callable(function) or not callable(make_groups):
            raise UpstreamUnavailable(
                f"{label}: {self.file} has no {self.name} or {GLOBALS_FILE} no set_seq_parallel_pg"
            )
        drawn: dict[str, tuple] = {}
        skipped: dict[str, str] = {}
        for param in inspect.signature(function).parameters:
            if param in FIXED:
                skipped[param] = FIXED[param]
            elif param == "dim":
                drawn[param] = DRAWN[param]
            else:
                raise _unknown(label, self.name, param)
        for param in inspect.signature(make_groups).parameters:
            if param == "use_ulysses_low":
                drawn[param] = DRAWN[param]
            elif param in PG_FIXED:
                skipped[f"set_seq_parallel_pg.{param}"] = PG_FIXED[param]
            else:
                raise _unknown(label, "set_seq_parallel_pg", param)
        notes = (
            "every case plays each rank of one ring x ulysses group (dp 1) on a [batch, seqlen, "
            "*features] tensor of unique ids; each shard is compared with the "
            f"{layout} layout yunchang's attention reads (the ring layout over the ring ranks, "
            "cut in order among the ulysses ranks); a length it cannot split is judged against "
            "the sequence padded at its tail",
        )
        return ExtractChecked(library, version, self.name, distribution, self.file, drawn,
                              skipped, notes, module, groups, self.name, layout)  # fmt: skip


def _unknown(label: str, where: str, param: str) -> UpstreamUnavailable:
    return unknown_option(f"{label}: {where}", param, __name__)
