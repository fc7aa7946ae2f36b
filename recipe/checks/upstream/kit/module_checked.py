"""A function of one release's file, loaded as a module and called on every rank of a packed
stream: what the plugins that check such a function share (fla-core's `get_cp_cu_seqlens`,
ring-flash-attn's `llama3_flash_attn_prepare_cu_seqlens`).

A case is (lengths, world size): the checker's micro-batches without tp (tp does not enter). The
plugin gives its function's problems on a case as (level, message) pairs, level an `Impact`'s
value; the finding is the first of the worst. Its reproducer ships real functions
(`inspect.getsource`) after the kit's prelude: `released_outputs(wheel, case, options)` and
`released_problems(outputs, case, options)`, which the glue below calls with CASE and OPTIONS.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    Finding,
    function_line,
    reproducer_source,
    with_defaults,
)
from recipe.parallel.cp.contract import Impact, micro_batches
from recipe.upstream.source import UpstreamUnavailable, source_file

# The reproducer's entry points: the shipped functions called on the script's case.
GLUE = """
def release_outputs(wheel):
    return released_outputs(wheel, CASE, OPTIONS)


def problems(outputs):
    return released_problems(outputs, CASE, OPTIONS)
"""


# ---- shipped into reproducers (inspect.getsource): plain Python, no module globals ---------


def packed_cu_seqlens(lengths, parts, padding):
    """The cu_seqlens a caller passes: `lengths` packed, the stream padded to a multiple of
    `parts`, the padding joining the last sequence ("last_sequence", OpenRLHF's way) or being
    a sequence of its own ("own_sequence")."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    pad = -bounds[-1] % parts
    if pad and padding == "own_sequence":
        bounds.append(bounds[-1] + pad)
    elif pad:
        bounds[-1] += pad
    return bounds


# ---- the checker's side ----------------------------------------------------------------------


def reproducer_body(shipped: tuple, constants: dict) -> str:
    """A reproducer's body: `constants` (name -> value, written with repr), the sources of
    `shipped` (which define `released_outputs` and `released_problems`) and the glue."""
    values = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    sources = "\n\n".join(inspect.getsource(part) for part in shipped)
    return f"{values}\n\n{sources}\n\n{GLUE.strip()}\n"


@dataclass
class ModuleChecked(Checked):
    """The function `function_name` of one release's module (or of its broken copy)."""

    module: object = None

    function_name: ClassVar[str]
    defaults: ClassVar[dict]  # option -> its default
    shipped: ClassVar[tuple]  # what the reproducer carries: functions, by their source
    title: ClassVar[str]  # the reproducer's, after the label

    @abstractmethod
    def case_problems(self, lengths: list, world_size: int, chosen: dict) -> tuple[list, list]:
        """(the cu_seqlens passed, [(level, message)]) of this function on the case."""

    @abstractmethod
    def broken_module(self):
        """The module with the negative control's one-line break."""

    @abstractmethod
    def shipped_constants(self) -> dict:
        """The module constants the shipped functions read, by name."""

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    @property
    def function(self):
        return getattr(self.module, self.function_name)

    def cases(self, min_length: int = 1):
        """(lengths, world size): the checker's micro-batches without tp (tp does not change
        what the function returns)."""
        return micro_batches(min_length=min_length).map(lambda case: (case[0], case[1]))

    def chosen_options(self, options: dict) -> dict:
        return with_defaults(options, self.defaults)

    def finding(self, case, options: dict) -> Finding | None:
        lengths, world_size = list(case[0]), case[1]
        chosen = self.chosen_options(options)
        bounds, found = self.case_problems(lengths, world_size, chosen)
        if not found:
            return None
        level, what = max(found, key=lambda f: f[0])  # the first of the worst
        return Finding(
            {"lengths": lengths, "world_size": world_size},
            tuple(sorted(chosen.items())),
            Impact(level),
            f"lengths={lengths} world_size={world_size} (cu_seqlens={bounds}): {what}",
        )

    def broken_copy(self, part: str = "function") -> ModuleChecked:
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        return dataclasses.replace(
            self, drawn=dict(self.drawn), skipped=dict(self.skipped), module=self.broken_module()
        )

    def reproducer(self, finding: Finding) -> str:
        body = reproducer_body(self.shipped, self.shipped_constants())
        title = f"{self.label}: {self.title}"
        return reproducer_source(title, finding, body, self.distribution, self.version)


class ModuleTarget(CheckTarget):
    """A `ModuleChecked` function as the registry lists it. `load_file(path, library, version)`
    executes the release's file as a module with its stubs; `signature_options(function, label)`
    partitions the function's options into (drawn, fixed), an option not known refusing."""

    def __init__(self, name: str, file: str, checked: type[ModuleChecked], notes: tuple[str, ...],
                 load_file: Callable, signature_options: Callable) -> None:  # fmt: skip
        self.name, self.file, self.checked, self.notes = name, file, checked, notes
        self.load_file, self.signature_options = load_file, signature_options

    def load(self, library: str, distribution: str, version: str | None) -> ModuleChecked:
        path, version = source_file(distribution, version, self.file)
        module = self.load_file(path, library, version)
        function_name = self.checked.function_name
        label = f"{library}@{version} {self.name}"
        if not callable(getattr(module, function_name, None)):
            raise UpstreamUnavailable(f"{library}@{version} has no {function_name} in {self.file}")
        drawn, skipped = self.signature_options(getattr(module, function_name), label)
        return self.checked(library, version, self.name, distribution, self.file, drawn, skipped,
                            self.notes, module)  # fmt: skip
