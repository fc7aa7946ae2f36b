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

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from recipe.parallel.cp.contract import Impact, assess, micro_batches
from recipe.upstream.releases import Library

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

    def reproducer(self, finding: Finding) -> str | None:
        """A standalone script reproducing `finding` (module docstring), or None."""
        return None

    def truth_outputs(self, finding: Finding):
        """What the reproducer's `release_outputs` gives when the function is right."""
        raise NotImplementedError(f"{self.label} has no reproducer")


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
        return Finding(
            {"lengths": list(lengths), "cp": cp_size, "tp": tp_size},
            tuple(sorted(options.items())),
            found.impact,
            found.what,
        )


# The start of every reproducer: load one file of a release from its wheel without running the
# package's __init__, with the imports named in `stubs` replaced by inert placeholders.
REPRODUCER_PRELUDE = '''
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
import traceback
import types
import zipfile
from pathlib import Path


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def fetch_wheel(distribution, version):
    """The release's wheel, or its sdist (.tar.gz, not built) where it publishes no wheel."""
    folder = Path(tempfile.mkdtemp(prefix="repro-wheel-"))
    for binary, quiet in (("--only-binary=:all:", True), ("--no-binary=:all:", False)):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", binary,
                        "--ignore-requires-python", "--quiet", "--dest", str(folder),
                        f"{distribution}=={version}"], capture_output=quiet)
        found = [*folder.glob("*.whl"), *folder.glob("*.tar.gz")]
        if found:
            return found[0]
    sys.exit(f"pip cannot fetch {distribution}=={version}; pass --wheel PATH")


def extract(wheel, relative, folder):
    """`relative` from a wheel, or from an sdist below its top folder (NAME-VERSION/)."""
    if str(wheel).endswith(".tar.gz"):
        with tarfile.open(wheel, "r:gz") as archive:
            member = next(m for m in archive if m.name.partition("/")[2] == relative)
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(archive.extractfile(member).read())
    else:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(relative, folder)


def load_from_wheel(wheel, relative, stubs):
    """Execute `relative` from the wheel (or sdist) as a private module, `stubs` (name ->
    attributes) standing in for the imports it makes that the checked code never calls."""
    folder = Path(tempfile.mkdtemp(prefix="repro-src-"))
    extract(wheel, relative, folder)
    saved = {key: sys.modules.get(key) for key in stubs}
    for key, attributes in stubs.items():
        module = _Placeholder(key)
        module.__path__ = []
        for attribute, value in attributes.items():
            setattr(module, attribute, value)
        sys.modules[key] = module
    try:
        name = "released_" + Path(relative).stem
        loader = importlib.machinery.SourceFileLoader(name, str(folder / relative))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        loader.exec_module(module)
        return module
    finally:
        for key, before in saved.items():
            if before is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = before


def main(distribution, version):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wheel", help="the release's wheel or sdist (default: pip download it)")
    wheel = parser.parse_args().wheel or fetch_wheel(distribution, version)
    try:
        found = problems(release_outputs(wheel))
    except Exception as err:
        # the release raising on this valid input is the finding; a raise anywhere else is the
        # reproducer's own failure and must not read as one
        if not any("repro-src-" in frame.filename for frame in traceback.extract_tb(
                err.__traceback__)):
            raise
        traceback.print_exc()
        found = [f"the release raises {type(err).__name__}: {err}"]
    for line in found:
        print(line)
    print(f"{distribution} {version}: " + ("REPRODUCED" if found else "not reproduced: passes"))
    return 1 if found else 0
'''


def reproducer_source(title: str, finding: Finding, body: str, distribution: str,
                      version: str) -> str:  # fmt: skip
    """A whole reproducer: its docstring, the prelude, the case, `body` (which defines
    `release_outputs` and `problems`) and the entry point."""
    return (
        f'"""{title}\n\nImpact: {finding.impact.label}. {finding.what}\n\nRun: python '
        f'this_file.py [--wheel PATH]  (needs torch; exit 1 = reproduced)\n"""\n'
        f"{REPRODUCER_PRELUDE}\n"
        f"CASE = {json.dumps(finding.case)}\n"
        f"OPTIONS = {dict(finding.options)!r}\n\n"
        f"{body.strip()}\n\n\n"
        f'if __name__ == "__main__":\n    sys.exit(main({distribution!r}, {version!r}))\n'
    )
