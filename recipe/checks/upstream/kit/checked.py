"""What the checker asks of every checked upstream function, whatever its contract.

An adapter loads one function of one release and returns a `Checked`: the cases it draws, the
finding (with its impact class) on one case, a deliberately broken copy (the negative control the
checker must flag), the released file:line, and a standalone reproducer of a finding. The runner
(`recipe/checks/upstream/runner.py`) knows nothing else about a library, so a new contract (a
contiguous layout, a packer, attention spans) is a new `Checked`, not a new branch in the runner.

A reproducer is a Python script that needs only torch and the release's wheel: `python repro.py
[--wheel PATH]` loads the release's file from the wheel (fetched with `pip download --no-deps`
when no path is given; a release with no wheel, such as ColossalAI's, is read from its sdist),
runs the minimal case, prints what is wrong and exits 1, or exits 0 when the release no longer
shows it. It defines `release_outputs(wheel) -> outputs` and
`problems(outputs) -> list[str]`; `Checked.truth_outputs(finding)` gives the outputs the ground
truth has on the same case, which `problems` must accept (the tests run both).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from recipe.checks.assess import Impact, assess, micro_batches
from recipe.upstream import prelude
from recipe.upstream.releases import Library, ParallelStateStandIn

__all__ = ["Library"]  # the registry's entry type, defined where training reads it too


@dataclass(frozen=True)
class Finding:
    """One minimal failing case of a checked function."""

    case: dict  # JSON-able: what a reproducer needs to run it again (lengths, cp, tp, ...)
    options: tuple[tuple[str, object], ...]  # the function's options on this case
    impact: Impact
    what: str  # what the checker saw, the case included

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options) or "defaults"
        return f"[{self.impact.label}] options: {options}; {self.what}"


# An impact by the lower-case name shipped code reports it with (plain Python, which cannot
# import `Impact`): "unbalanced", "padding", "raises", "misplaced", "lost".
IMPACTS = {impact.name.lower(): impact for impact in Impact}


class CheckTarget(ABC):
    """A checked function as the registry lists it, before any release is loaded."""

    name: str  # as the CLI and the report name it
    file: str  # inside the wheel

    @abstractmethod
    def load(self, library: str, distribution: str, version: str | None) -> Checked:
        """This function from `version` (None: the installed release), ready to check. Raises
        `UpstreamUnavailable` (exit 2) when it cannot be had, or when its signature has an
        option the adapter does not know."""


@dataclass
class Checked(ABC):
    """One function of one release, loaded, with what the checker needs to check it."""

    library: str  # as the registry names it
    version: str
    name: str  # as the CLI and the report name it
    distribution: str  # on PyPI
    file: str  # inside the wheel
    drawn: dict[str, tuple] = field(default_factory=dict)  # option -> values drawn
    skipped: dict[str, str] = field(default_factory=dict)  # option -> why it is fixed
    notes: tuple[str, ...] = ()  # lines printed under the header (what else each case does)

    @property
    def label(self) -> str:
        return f"{self.library}@{self.version} {self.name}"

    @property
    @abstractmethod
    def line(self) -> int:
        """The line of the checked function's `def` in `file`, in the released wheel."""

    def cases(self, min_length: int = 1):
        """A hypothesis strategy of one case (by default: (lengths, cp, tp) micro-batches)."""
        return micro_batches(min_length=min_length)

    @abstractmethod
    def finding(self, case, options: dict) -> Finding | None:
        """The finding on this case with these options, or None when the ground truth holds."""

    @abstractmethod
    def broken_copy(self, part: str = "function") -> Checked:
        """The negative control: a copy with one deliberate bug, which the checker must flag."""

    def broken_as(self, part: str, **fields) -> Self:
        """A broken copy of this check: named by its broken `part`, `fields` (the broken module
        or modules) replaced, the release, options and notes the same."""
        return dataclasses.replace(self, name=f"{self.name} [broken copy: {part}]", **fields)

    def reproducer(self, finding: Finding) -> str | None:
        """A standalone script reproducing `finding` (module docstring), or None."""
        return None

    def reproducer_script(self, title: str, finding: Finding, body: str) -> str:
        """`reproducer_source` for this release: the script runs (or fetches) this version."""
        return reproducer_source(title, finding, body, self.distribution, self.version)

    def truth_outputs(self, finding: Finding):
        """What the reproducer's `release_outputs` gives when the function is right."""
        raise NotImplementedError(f"{self.label} has no reproducer")


def with_defaults(options: dict, defaults: dict) -> dict:
    """Every option of `defaults`, the case's value where it has one (None: the default)."""
    return {k: options[k] if options.get(k) is not None else v for k, v in defaults.items()}


def function_line(module, name: str) -> int:
    return inspect.getsourcelines(getattr(module, name))[1]


class ContractChecked(Checked):
    """A function with the zigzag contract (`recipe/parallel/cp/contract.py`): the subclass
    gives `contract_function(options)`; the finding and its impact come from `assess`."""

    @abstractmethod
    def contract_function(self, options: dict) -> Callable:
        """(sequences, cu_seqlens_padded, cp, rank, tp) -> this rank's fields."""

    def sequence_parallel(self, options: dict) -> bool:
        """Whether tp > 1 runs with sequence parallelism here (then each rank's slots must split
        evenly over the tp ranks); the recipe's way, and the default."""
        return True

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp_size, tp_size = case
        found = assess(self.contract_function(options), list(lengths), cp_size, tp_size,
                       self.sequence_parallel(options))  # fmt: skip
        if found is None:
            return None
        return case_finding(case, options, found.impact, found.what)


def case_finding(case, options: dict, impact: Impact, what: str) -> Finding:
    """A finding on a (lengths, cp, tp) micro-batch with these options."""
    lengths, cp_size, tp_size = case
    record = {"lengths": list(lengths), "cp": cp_size, "tp": tp_size}
    return Finding(record, tuple(sorted(options.items())), impact, what)


def reproducer_prelude() -> str:
    """The prelude every reproducer starts with: `recipe/upstream/prelude.py`'s source, less its
    docstring, and the one stand-in for megatron's parallel_state (`ParallelStateStandIn`, the
    class the checks and training use, so a script plays a rank exactly as the checker did)."""
    stand_in = inspect.getsource(ParallelStateStandIn)
    return shipped_module_source(prelude) + "\n\n" + stand_in


def shipped_module_source(module) -> str:
    """A module shipped whole into reproducers: its source, less its docstring."""
    source = inspect.getsource(module)
    return source[source.index('"""', 3) + 3 :].lstrip("\n")


def entry_points(outputs: str, problems: str) -> str:
    """The two functions a reproducer's body ends with, which the prelude's `main` calls:
    `release_outputs(wheel)` returning the expression `outputs`, and `problems(outputs)`
    returning `problems` (both over the script's globals: CASE, OPTIONS, the shipped parts)."""
    return (
        f"def release_outputs(wheel):\n    return {outputs}\n\n\n"
        f"def problems(outputs):\n    return {problems}\n"
    )


def script_body(
    parts: tuple = (),
    constants: dict | None = None,
    *,
    imports: tuple = (),
    after: str = "",
    entry: str = "",
) -> str:
    """A reproducer's body, the one way every plugin assembles it: `imports` (module names the
    prelude does not import), `constants` (name = repr(value)), the sources of `parts` (real
    functions and classes, by `inspect.getsource`), `after` (a module shipped whole, such as the
    layout reference) and `entry` (`entry_points`: the two functions the prelude's `main`
    calls)."""
    pieces = [
        "\n".join(f"import {name}" for name in imports),
        "".join(f"{name} = {value!r}\n" for name, value in (constants or {}).items()),
        "\n\n\n".join(inspect.getsource(part).strip() for part in parts),
        after,
        entry,
    ]
    return "\n\n\n".join(piece.strip() for piece in pieces if piece.strip()) + "\n"


def reproducer_source(title: str, finding: Finding, body: str, distribution: str,
                      version: str) -> str:  # fmt: skip
    """A whole reproducer: its docstring, the prelude, the case, `body` (which defines
    `release_outputs` and `problems`) and the entry point."""
    return (
        f'"""{title}\n\nImpact: {finding.impact.label}. {finding.what}\n\nRun: python '
        f'this_file.py [--wheel PATH]  (needs torch; exit 1 = reproduced)\n"""\n'
        f"{reproducer_prelude()}\n"
        f"CASE = {json.dumps(finding.case)}\n"
        f"OPTIONS = {dict(finding.options)!r}\n\n"
        f"{body.strip()}\n\n\n"
        f'if __name__ == "__main__":\n    sys.exit(main({distribution!r}, {version!r}))\n'
    )
