"""What a `cp.preprocess` string names, decided in one place.

Four kinds: `index` (the recipe's one zigzag index), a `reference` formula of verl's (verl_fixed,
verl_legacy), your `function` (`package.module:function`) and a released upstream function
(`release`: `LIBRARY@VERSION[/FUNCTION]`). `@` cannot appear in a module path, so a release is
told first. Only the spelling is checked here; whether the module imports or the release exists
is the start-up check's (`recipe/launch/preflight.py`), which loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipe.config.rules import one_of, require
from recipe.names import CP_PREPROCESS, VERL_VARIANTS

INDEX, REFERENCE, FUNCTION, RELEASE, UNKNOWN = (
    "index",
    "reference",
    "function",
    "release",
    "unknown",
)


@dataclass(frozen=True)
class PreprocessSpec:
    """A parsed `cp.preprocess`."""

    text: str

    @property
    def kind(self) -> str:
        if "@" in self.text:
            return RELEASE
        if ":" in self.text:
            return FUNCTION
        if self.text == INDEX:
            return INDEX
        return REFERENCE if self.text in VERL_VARIANTS else UNKNOWN

    @property
    def built_in(self) -> bool:
        """The recipe's own: the index path or one of verl's formulas."""
        return self.kind in (INDEX, REFERENCE)

    @property
    def loaded(self) -> bool:
        """Code from outside the recipe, loaded at start-up: your function or a release."""
        return self.kind in (FUNCTION, RELEASE)

    @property
    def module_and_function(self) -> tuple[str, str]:
        """`package.module:function` -> (package.module, function); empty parts when absent."""
        module, _, function = self.text.partition(":")
        return module, function

    @property
    def release(self) -> str:
        """`LIBRARY@VERSION` of a release spec (what `python -m recipe.check_upstream` takes)."""
        return self.text.partition("/")[0]


def parse_preprocess(text: str) -> PreprocessSpec:
    return PreprocessSpec(text)


def check_preprocess_spelling(text: str) -> None:
    """The config's check of `cp.preprocess`: a built-in name, or a well-formed
    `package.module:function` (a release is checked when the start-up check loads it)."""
    spec = parse_preprocess(text)
    if spec.kind == FUNCTION:
        module, function = spec.module_and_function
        require(
            bool(module) and bool(function) and ":" not in function,
            f"cp.preprocess={text}: write package.module:function",
        )
    elif spec.kind != RELEASE:
        one_of("cp.preprocess", text, CP_PREPROCESS)
