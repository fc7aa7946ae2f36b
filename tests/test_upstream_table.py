"""docs/upstream.md's table is the output of `python -m recipe.check_upstream --all`: these tests
fail when the page, the JSON it was rendered from (docs/upstream.json) or the registry disagree.
The fix is to rerun the command the page names (`--all --cases 100 --write-docs`)."""

from __future__ import annotations

import json

import pytest

from recipe.checks.upstream import table as upstream_table
from recipe.checks.upstream.cli import main
from recipe.checks.upstream.table import (
    BEGIN,
    DOCS,
    END,
    generated_table,
    registered,
    registry_key,
    render_record,
    with_table,
)


def _record() -> dict:
    return json.loads((DOCS / "upstream.json").read_text())


def test_the_page_is_the_rendered_json():
    page = (DOCS / "upstream.md").read_text()
    assert generated_table(page) == render_record(_record()), (
        "docs/upstream.md's table is not docs/upstream.json rendered: run `python -m "
        "recipe.check_upstream --all --cases 100 --write-docs`"
    )


def test_the_json_covers_every_registered_function_and_release():
    rows = _record()["rows"]
    checked = {registry_key(r) for r in rows}
    checked -= {r for r in checked if r[0] == "megatron-core"}
    assert checked == set(registered()), "registry changed: regenerate docs/upstream.json"
    modes = {(r["library"], r["version"], r["function"], r["mode"]) for r in rows}
    assert len(modes) == len(rows), "a row twice"
    assert any(r["library"] == "megatron-core" for r in rows), "the roll_tensor rows are missing"


def test_the_rows_say_what_the_docs_claim():
    """The issue's example: verl 0.9.1's length bucket reported as real tokens lost."""
    rows = _record()["rows"]
    key = ("verl", "0.9.1", "preprocess_thd_engine")
    drawn = [r for r in rows if (r["library"], r["version"], r["function"]) == key]
    bucket = next(r for r in drawn if r["mode"] != "default options")
    assert bucket["verdict"] == "FAIL" and bucket["impact"] == "real tokens lost"
    classes = [f["impact"] for f in bucket["findings"]]
    assert classes[0] == "real tokens lost" and len(classes) == len(set(classes))


def test_render_and_the_markers():
    rows = [
        {"library": "lib", "version": "1", "function": "f", "file": "a.py", "line": 3,
         "mode": "default options", "verdict": "FAIL", "impact": "real tokens lost", "cases": 7,
         "seconds": 0.5, "findings": [{"impact": "real tokens lost", "options": {"k": 1},
                                       "case": {}, "what": "x | y"}]},
        {"library": "lib", "version": "2", "function": "f", "file": "a.py", "line": None,
         "mode": "-", "verdict": "CANNOT RUN", "impact": None, "cases": 0, "seconds": 0.0,
         "findings": [], "error": "no wheel"},
    ]  # fmt: skip
    table = render_record({"rows": rows, "cases": 7, "seed": 0, "seconds": 1})
    assert "| lib | 1 | `f` `a.py:3` | default options | **FAIL** | real tokens lost | " in table
    assert "**real tokens lost**: k=1; x \\| y" in table
    assert "| lib | 2 | `f` `a.py` | - | **CANNOT RUN** |  | no wheel |" in table
    page = with_table(f"head\n{BEGIN}\nold\n{END}\ntail\n", table)
    assert generated_table(page) == table and page.startswith("head") and page.endswith("tail\n")
    with pytest.raises(ValueError, match="lost its markers"):
        with_table("no markers", table)


@pytest.mark.launches  # pip fetches the wheel on a fresh machine
def test_all_writes_the_table(monkeypatch, tmp_path, capsys):
    """`--all` end to end on one small library (the roll's own runner is tests/test_upstream_roll)
    writing JSON and markdown; exit 0 when every row passes."""
    from recipe.checks.upstream import registry

    monkeypatch.setattr(upstream_table, "REGISTRY", {"ring-flash-attn":
                        registry.REGISTRY["ring-flash-attn"]})  # fmt: skip
    monkeypatch.setattr(upstream_table, "roll_results", lambda *a: iter(()))
    assert main(["--all", "--cases", "5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "upstream.json").read_text())
    assert [r["verdict"] for r in data["rows"]] == ["PASS", "PASS"]
    assert (tmp_path / "upstream.md").read_text() == render_record(data)
    assert "2 rows: 2 PASS, 0 FAIL, 0 CANNOT RUN" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--all", "verl"], [], ["verl", "--write-docs"], ["--all", "--function", "f"]],
)
def test_all_refuses_what_it_cannot_honour(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "--all" in capsys.readouterr().err


def test_the_registry_refuses_a_library_twice_and_anything_but_a_library():
    from recipe.checks.upstream.kit.registry import DuplicateLibrary, Registry
    from recipe.checks.upstream.registry import REGISTRY

    registry = Registry()
    registry.register("verl", REGISTRY["verl"])
    with pytest.raises(DuplicateLibrary, match="library 'verl' is registered twice"):
        registry.register("verl", REGISTRY["areal"])
    with pytest.raises(TypeError, match="x: register a Library, got dict"):
        registry.register("x", {})
    assert list(registry) == ["verl"] and registry["verl"] is REGISTRY["verl"]


def test_every_plugin_is_registered_once_in_one_line():
    """A plugin module under libraries/ that the registry never names would be silently left out
    of --all; each is registered in exactly one `REGISTRY.register(` line."""
    import re
    from pathlib import Path

    import recipe.checks.upstream.libraries as libraries
    from recipe.checks.upstream import registry

    source = Path(registry.__file__).read_text()
    used = set(re.findall(r"^REGISTRY\.register\(\"[^\"]+\", (\w+)\.", source, flags=re.M))
    folder = Path(libraries.__file__).parent
    plugins = {p.stem for p in folder.glob("*.py")}  # a plugin module, or a package of them
    plugins |= {p.parent.name for p in folder.glob("*/__init__.py")}
    helpers = {"__init__"}
    assert used == plugins - helpers
