"""Dependencies point one way: no module imports from a layer above its own in the data flow
(data, parallel, model, training, launch, compare), lazy imports inside functions included. The
leaves (errors, names, environment, log) import no layer; the upstream checker's loading and
adapters sit with parallel (training shards with them), its launched MTP-roll check with launch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["leaf", "data", "parallel", "model", "training", "launch", "compare"]
LEAVES = {"recipe.errors", "recipe.names", "recipe.environment", "recipe.log"}
PLACED = {"recipe.upstream.mtp_roll": "launch", "recipe.upstream": "parallel"}


def layer_of(module: str) -> str | None:
    """The layer of a recipe module, or None for the entry points above every layer (config
    schema, the checkers' command lines, the package itself)."""
    if module in LEAVES:
        return "leaf"
    for prefix, layer in PLACED.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name.startswith("recipe.")]
    return found


def upward_imports(root: Path) -> list[str]:
    problems = []
    for path in sorted((root / "recipe").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        mine = layer_of(module)
        if mine is None:
            continue
        for name, line in imports(path):
            theirs = layer_of(name)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                problems.append(f"{module} ({mine}) imports {name} ({theirs}) at line {line}")
    return sorted(set(problems))


def test_no_module_imports_from_a_layer_above_it():
    assert upward_imports(ROOT) == []


def test_an_upward_import_is_found(tmp_path):
    """The check's negative control: a data module importing the trainer is reported."""
    (tmp_path / "recipe" / "data").mkdir(parents=True)
    (tmp_path / "recipe" / "data" / "bad.py").write_text(
        "def f():\n    from recipe.training.trainer import train\n"
    )
    assert upward_imports(tmp_path) == [
        "recipe.data.bad (data) imports recipe.training.trainer (training) at line 2",
        "recipe.data.bad (data) imports recipe.training.trainer.train (training) at line 2",
    ]


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_the_leaves_import_no_layer(leaf):
    path = ROOT / (leaf.replace(".", "/") + ".py")
    assert [n for n, _ in imports(path) if layer_of(n) not in (None, "leaf")] == []
