"""A function (or class) of one release's file, loaded as a module and called on every rank of a
packed stream: what the plugins that check such a thing share (fla-core's `get_cp_cu_seqlens`,
ring-flash-attn's `llama3_flash_attn_prepare_cu_seqlens`, axolotl-ringmaster's
`shard_collated_batch`, DeepSpeed's `UlyssesSPDataLoaderAdapter`).

A case is (lengths, size, *`case_rest`): the checker's micro-batches without tp (tp does not
enter; a plugin whose cases keep the (lengths, cp, tp) shape sets `case_rest = (1,)`), the size
named `size_name` in the finding's record and message ("world_size" unless the plugin says).
The plugin gives its function's problems on a case as (level, message) pairs, level an `Impact`'s
value; the finding is the first of the worst. Its reproducer ships real functions
(`inspect.getsource`) after the prelude: `released_outputs(wheel, case, options)` and
`released_problems(outputs, case, options)`, which the glue below calls with CASE and OPTIONS.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from recipe.checks.assess import Impact, micro_batches
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    Finding,
    entry_points,
    function_line,
    script_body,
    with_defaults,
)
from recipe.upstream.source import UpstreamUnavailable, source_file

# The reproducer's entry points: the shipped functions called on the script's case.
GLUE = entry_points(
    "released_outputs(wheel, CASE, OPTIONS)", "released_problems(outputs, CASE, OPTIONS)"
)


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


def each_rank(call, world_size):
    """`call(rank)` on every rank, JSON-able: what it returns, or what it raised."""
    outputs = []
    for rank in range(world_size):
        try:
            outputs.append(call(rank))
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is what is reported)
            outputs.append({"raises": f"{type(err).__name__}: {err}"})
    return outputs


def lost_tokens(tokens, present, stride):
    """[(4, message)] when a real token of `tokens` (document d's token p: 1 + stride * d + p)
    is not in `present` (the tokens the ranks hold), else []."""
    missing = sorted(tokens - present)
    if not missing:
        return []
    first = divmod(missing[0] - 1, stride)
    return [(4, f"{len(missing)} of {len(tokens)} real tokens are on no rank (first: document "
                f"{first[0]}, position {first[1]}): they never train")]  # fmt: skip


def slot_problems(got, slot, g, where, lengths, stride, tokens, first=0):
    """(level, message) per problem of local `slot` of `got` (a rank's input_ids, position_ids
    and shift_labels, lists), which holds slot `g` of a packed row: documents first, first + 1,
    .. of `lengths` back to back (document d's token p: 1 + stride * d + p), then padding.
    `tokens`: every real token of the case; `where` names the slot. Truth: the token, its
    position in its own document, its label the next token of its own document (the last
    token's: -100); a padding slot's label -100. Every problem is level 3 (misplaced)."""
    label = got["shift_labels"][slot]
    if g >= sum(lengths):
        return [] if label == -100 else [(3, f"{where} (padding): label {label}, not -100: "
                                             "padding trains")]  # fmt: skip
    i, start = 0, 0
    while start + lengths[i] <= g:
        start, i = start + lengths[i], i + 1
    d, p = first + i, g - start
    token = 1 + stride * d + p
    want = {"input_ids": token, "position_ids": p,
            "shift_labels": token + 1 if p + 1 < lengths[i] else -100}  # fmt: skip
    found = []
    for name, value in want.items():
        if got[name][slot] != value:
            other = divmod(got[name][slot] - 1, stride)
            crosses = name == "shift_labels" and other[0] != d and got[name][slot] in tokens
            note = (f" (document {other[0]}'s position {other[1]}: the label crosses into the "
                    "next document)" if crosses else "")  # fmt: skip
            shown = "label" if name == "shift_labels" else name
            what = f"{shown} expected {value}, got {got[name][slot]}{note}"
            found.append((3, f"{where} (document {d}, position {p}): {what}"))
    return found


# ---- the checker's side ----------------------------------------------------------------------


@dataclass
class ModuleChecked(Checked):
    """The function `function_name` of one release's module (or of its broken copy)."""

    module: object = None

    function_name: ClassVar[str]  # or a class's name, where `present` accepts classes
    size_name: ClassVar[str] = "world_size"  # the case's size, as its record and message name it
    case_rest: ClassVar[tuple] = ()  # what a case carries after (lengths, size)
    defaults: ClassVar[dict]  # option -> its default
    shipped: ClassVar[tuple]  # what the reproducer carries: functions, by their source
    title: ClassVar[str]  # the reproducer's, after the label

    @abstractmethod
    def case_problems(self, lengths: list, size: int, chosen: dict) -> tuple[list | None, list]:
        """(the cu_seqlens passed, None where the function takes none, [(level, message)]) of
        this function on the case."""

    @abstractmethod
    def broken_module(self):
        """The module with the negative control's one-line break."""

    @abstractmethod
    def shipped_constants(self) -> dict:
        """The module constants the shipped functions read, by name."""

    @staticmethod
    def present(value) -> bool:
        """Whether the module's `function_name` is the thing this check calls (a function)."""
        return callable(value)

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    @property
    def function(self):
        return getattr(self.module, self.function_name)

    def cases(self, min_length: int = 1):
        """(lengths, size, *case_rest): the checker's micro-batches without tp (tp does not
        change what the function returns)."""
        rest = self.case_rest
        return micro_batches(min_length=min_length).map(lambda case: (case[0], case[1], *rest))

    def chosen_options(self, options: dict) -> dict:
        return with_defaults(options, self.defaults)

    def finding(self, case, options: dict) -> Finding | None:
        lengths, size = list(case[0]), case[1]
        chosen = self.chosen_options(options)
        bounds, found = self.case_problems(lengths, size, chosen)
        if not found:
            return None
        level, what = max(found, key=lambda f: f[0])  # the first of the worst
        passed = "" if bounds is None else f" (cu_seqlens={bounds})"
        return Finding(
            {"lengths": lengths, self.size_name: size},
            tuple(sorted(chosen.items())),
            Impact(level),
            f"lengths={lengths} {self.size_name}={size}{passed}: {what}",
        )

    def broken_copy(self, part: str = "function") -> ModuleChecked:
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        return dataclasses.replace(
            self, drawn=dict(self.drawn), skipped=dict(self.skipped), module=self.broken_module()
        )

    def reproducer(self, finding: Finding) -> str:
        body = script_body(self.shipped, self.shipped_constants(), entry=GLUE)
        title = f"{self.label}: {self.title}"
        return self.reproducer_script(title, finding, body)


class ModuleTarget(CheckTarget):
    """A `ModuleChecked` function (or class) as the registry lists it. `load_file(path, library,
    version)` executes the release's file as a module with its stubs; `signature_options(function,
    label)` partitions the function's options into (drawn, fixed), an option not known refusing."""

    def __init__(self, name: str, file: str, checked: type[ModuleChecked], notes: tuple[str, ...],
                 load_file: Callable, signature_options: Callable) -> None:  # fmt: skip
        self.name, self.file, self.checked, self.notes = name, file, checked, notes
        self.load_file, self.signature_options = load_file, signature_options

    def load(self, library: str, distribution: str, version: str | None) -> ModuleChecked:
        path, version = source_file(distribution, version, self.file)
        module = self.load_file(path, library, version)
        function_name = self.checked.function_name
        label = f"{library}@{version} {self.name}"
        if not self.checked.present(getattr(module, function_name, None)):
            raise UpstreamUnavailable(f"{library}@{version} has no {function_name} in {self.file}")
        drawn, skipped = self.signature_options(getattr(module, function_name), label)
        return self.checked(library, version, self.name, distribution, self.file, drawn, skipped,
                            self.notes, module)  # fmt: skip
