"""The configuration reference, generated from the typed schema: `python -m recipe.config.reference`
writes docs/configuration-reference.md (`--check` exits 1 when the page is stale).

The dataclasses in `recipe/config/` are the one home of every key, its default and its meaning
(the field's docstring, the string literal under it); this page is rendered from them, so the
docs cannot drift from the code. A field without a docstring is an error here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

from recipe.config import schema

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration-reference.md"

HEADER = """# Configuration reference

Generated from the dataclasses in `recipe/config/` by `python -m recipe.config.reference`
(a test fails when this page is stale): every key a run takes, its default, and what it means.
Set a key on the command line (`python train.py optim.lr=3e-3`) or pick a group's option
(`model=small`, `cp=2`, `mtp=on`); [Configuration](configuration.md) explains how they compose.
"""


def field_docs(cls) -> dict[str, str]:
    """{field name: its docstring} read from the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _show(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def rows(cls, prefix: str, missing: list[str]) -> list[tuple[str, str, str]]:
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = _default(f)
        if dataclasses.is_dataclass(value):
            out += rows(type(value), f"{key}.", missing)
            continue
        if f.name not in docs:
            missing.append(f"{cls.__name__}.{f.name}")
        out.append((key, _show(value), docs.get(f.name, "")))
    return out


def render() -> str:
    """The page's text."""
    missing: list[str] = []
    parts = [HEADER]
    for f in dataclasses.fields(schema.TrainConfig):
        group = _default(f)
        if not dataclasses.is_dataclass(group):
            continue
        cls = type(group)
        parts.append(f"\n## `{f.name}`\n\n{' '.join((cls.__doc__ or '').split())}\n\n")
        parts.append("| key | default | meaning |\n|---|---|---|\n")
        for key, default, doc in rows(cls, f"{f.name}.", missing):
            cell = doc.replace("|", r"\|")
            parts.append(f"| `{key}` | {default} | {cell} |\n")
    if missing:
        raise ValueError(
            "fields without a docstring (add the string literal under each in "
            "recipe/config/groups.py): " + ", ".join(missing)
        )
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.config.reference")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run `python -m recipe.config.reference`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
