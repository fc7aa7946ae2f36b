"""Dependencies point one way, and a module's layer is its folder: no module imports from a
folder above its own in the data flow, lazy imports inside functions included, nor another
module's private names. The files at the top of `recipe/` are leaves (errors, names, environment,
log), except the `python -m` entry points kept for their spelling, which sit above everything.
`compare/` reads runs only through `rundir/`, and only `rundir/` spells the files of a run. No two
modules import each other, directly or around a longer circle (lazy imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    "leaf",  # the files at the top of recipe/: errors, names, environment, log
    "config",  # the schema: groups, cross-group rules, the parallel grid, the reference
    "megatron",  # versions and feature probes, the CPU patches, log filters
    "data",
    "parallel",
    "upstream",  # the released functions training can call, loaded from their wheels
    "model",
    "rundir",  # every file of a run directory
    "checkpoint",
    "training",
    "launch",
    "compare",  # reads run directories (through rundir/ alone)
    "checks",  # the proof tools' bodies
    "entry",  # `python -m recipe.check_*`: thin entry points above every layer
]
# What a folder may import besides itself, where the layer order alone would allow more.
ONLY_FROM = {"compare": {"leaf", "config", "rundir", "compare"}}
# The files of a run directory, as the string that names them: spelled in rundir/ alone.
RUN_FILES = {
    "metrics.jsonl",
    "summary.json",
    "manifest.json",
    "checkpoints",
    "set_aside",
    ".partial",
    ".lock",
    ".hydra",
    "train.log",
}


def module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def is_entry_point(path: Path) -> bool:
    """A `python -m` entry point: a module that runs under an `if __name__ == "__main__"`."""
    for node in ast.parse(path.read_text()).body:
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and isinstance(test, ast.Compare):
            if isinstance(test.left, ast.Name) and test.left.id == "__name__":
                return True
    return False


def layer_of(module: str, root: Path = ROOT) -> str:
    """The layer of a recipe module: its folder under recipe/ (a file at the top: a leaf, or an
    entry point)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "entry"  # the package itself
    path = root / "recipe" / f"{parts[1]}.py"
    if path.is_file():
        return "entry" if is_entry_point(path) else "leaf"
    return parts[1]


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


def recipe_modules(root: Path):
    for path in sorted((root / "recipe").rglob("*.py")):
        yield module_name(root, path), path


def upward_imports(root: Path) -> list[str]:
    problems = []
    for module, path in recipe_modules(root):
        mine = layer_of(module, root)
        if mine not in LAYERS:
            problems.append(f"{module}: folder {mine!r} has no layer; add it to LAYERS")
            continue
        for name, line in imports(path):
            theirs = layer_of(name, root)
            if theirs not in LAYERS:
                continue  # a submodule name of a package the first form already placed
            if LAYERS.index(theirs) > LAYERS.index(mine):
                problems.append(f"{module} ({mine}) imports {name} ({theirs}) at line {line}")
            elif theirs not in ONLY_FROM.get(mine, {theirs}):
                problems.append(
                    f"{module} ({mine}) imports {name} ({theirs}) at line {line}; {mine}/ may "
                    f"import only from {', '.join(sorted(ONLY_FROM[mine]))}"
                )
    return sorted(set(problems))


def private_imports(root: Path) -> list[str]:
    """`from recipe.a import _name` (or `recipe.a._name`) from outside module `recipe.a`."""
    problems = []
    for module, path in recipe_modules(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if not node.module.startswith("recipe") or node.module == module:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_"):
                        problems.append(f"{module} imports {node.module}.{alias.name}")
    return sorted(problems)


def run_file_names_outside_rundir(root: Path) -> list[str]:
    problems = []
    for module, path in recipe_modules(root):
        if layer_of(module, root) == "rundir":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in RUN_FILES:
                problems.append(f"{module} spells {node.value!r} at line {node.lineno}")
    return problems


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each recipe module's imported recipe modules (a name resolved to its longest prefix that is
    a module of the tree: `from recipe.a.b import f` is `recipe.a.b`)."""
    modules = dict(recipe_modules(root))
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name, _ in imports(path):
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        graph[module] = targets
    return graph


def import_circles(root: Path) -> list[list[str]]:
    """The modules of each import circle (a strongly connected component of more than one module
    of the import graph, by Tarjan's algorithm without recursion), each sorted."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return sorted(circles)


def test_no_import_circles():
    assert import_circles(ROOT) == []


def test_import_circles_are_found_direct_and_around_three_modules(tmp_path):
    """The check's negative control: a lazy two-module circle and a three-module one."""
    root = _tree(
        tmp_path,
        {
            "recipe/checks/a.py": "from recipe.checks.b import f\n",
            "recipe/checks/b.py": "def f():\n    from recipe.checks import a\n",
            "recipe/data/x.py": "from recipe.data.y import g\n",
            "recipe/data/y.py": "from recipe.data.z import h\n",
            "recipe/data/z.py": "import recipe.data.x\n",
            "recipe/data/w.py": "from recipe.data.x import k\n",
        },
    )
    assert import_circles(root) == [
        ["recipe.checks.a", "recipe.checks.b"],
        ["recipe.data.x", "recipe.data.y", "recipe.data.z"],
    ]


def test_no_module_imports_from_a_layer_above_it():
    assert upward_imports(ROOT) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(ROOT) == []


def test_only_rundir_spells_the_files_of_a_run():
    assert run_file_names_outside_rundir(ROOT) == []


def test_every_folder_of_recipe_has_a_layer():
    folders = {p.name for p in (ROOT / "recipe").iterdir() if p.is_dir() and p.name[0] != "_"}
    assert folders <= set(LAYERS)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_an_upward_import_is_found(tmp_path):
    """The check's negative control: a data module importing the trainer is reported."""
    root = _tree(
        tmp_path,
        {"recipe/data/bad.py": "def f():\n    from recipe.training.trainer import train\n"},
    )
    assert upward_imports(root) == [
        "recipe.data.bad (data) imports recipe.training.trainer (training) at line 2",
        "recipe.data.bad (data) imports recipe.training.trainer.train (training) at line 2",
    ]


def test_a_leaf_importing_a_layer_is_found_and_an_entry_point_may(tmp_path):
    root = _tree(
        tmp_path,
        {
            "recipe/names.py": "from recipe.config import TrainConfig\n",
            "recipe/check_x.py": (
                "from recipe.checks.x import main\nif __name__ == '__main__':\n    main()\n"
            ),
        },
    )
    assert upward_imports(root) == [
        "recipe.names (leaf) imports recipe.config (config) at line 1",
        "recipe.names (leaf) imports recipe.config.TrainConfig (config) at line 1",
    ]


def test_compare_reading_training_and_a_private_name_and_a_run_file_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "recipe/compare/bad.py": (
                "from recipe.checkpoint.resume import _newest\nNAME = 'metrics.jsonl'\n"
            ),
            "recipe/checkpoint/resume.py": "def _newest():\n    pass\n",
        },
    )
    assert upward_imports(root) == [
        "recipe.compare.bad (compare) imports recipe.checkpoint.resume (checkpoint) at line 1; "
        "compare/ may import only from compare, config, leaf, rundir",
        "recipe.compare.bad (compare) imports recipe.checkpoint.resume._newest (checkpoint) at "
        "line 1; compare/ may import only from compare, config, leaf, rundir",
    ]
    assert private_imports(root) == ["recipe.compare.bad imports recipe.checkpoint.resume._newest"]
    assert run_file_names_outside_rundir(root) == [
        "recipe.compare.bad spells 'metrics.jsonl' at line 2"
    ]


def test_a_folder_without_a_layer_is_refused(tmp_path):
    root = _tree(tmp_path, {"recipe/misc/x.py": "X = 1\n"})
    assert upward_imports(root) == ["recipe.misc.x: folder 'misc' has no layer; add it to LAYERS"]


@pytest.mark.parametrize(
    "leaf", ["recipe.errors", "recipe.names", "recipe.environment", "recipe.log"]
)
def test_the_leaves_import_no_layer(leaf):
    assert layer_of(leaf) == "leaf"
    path = ROOT / (leaf.replace(".", "/") + ".py")
    assert [n for n, _ in imports(path) if layer_of(n) != "leaf"] == []
