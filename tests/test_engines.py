"""The engines' seams: one protocol both engines keep, one reader of `trainer.engine`, and one
driver of a micro-batch (the model call, the loss and backward exist once; everything else calls
them), each rule with a planted violation that must be found."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from recipe.names import ENGINES
from recipe.training.engines import ENGINE_CLASSES, Engine, engine_class
from tests.helpers.config import typed_config

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path("recipe/training/micro_batch.py")
SCANNED = ("recipe", "benchmarks", "scripts", "train.py")


def _protocol_methods() -> list[str]:
    return [
        name
        for name, member in vars(Engine).items()
        if inspect.isfunction(member) and not name.startswith("_")
    ]


def test_every_engine_keeps_the_protocol_with_the_same_signatures():
    methods = _protocol_methods()
    assert len(methods) == 9
    for cls in ENGINE_CLASSES.values():
        for name in methods:
            expected = inspect.signature(getattr(Engine, name))
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(expected.parameters), (cls.__name__, name)
        assert isinstance(cls.name, str) and callable(cls.model_per_token_loss)


def test_the_engine_names_are_the_config_values_and_megatron_is_the_default():
    assert tuple(ENGINE_CLASSES) == ENGINES
    assert {cls.name for cls in ENGINE_CLASSES.values()} == set(ENGINES)
    cfg = typed_config()
    assert cfg.trainer.engine == "megatron"
    assert engine_class(cfg).name == "megatron"
    assert engine_class(typed_config(["trainer.engine=reference"])).name == "reference"


def _engine_readers(root: Path) -> list[str]:
    """Files that read `<...>.trainer.engine` outside the config (which defines and checks it),
    the engines package (which decides) and the checkpoint manifest (which records it)."""
    allowed = ("recipe/config/", "recipe/training/engines/__init__.py", "recipe/checkpoint/")
    found = []
    for path in sorted((root / "recipe").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "engine"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "trainer"
            ):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_the_engine_is_decided_in_one_place():
    assert _engine_readers(ROOT) == []


def test_negative_control_a_second_engine_decision_is_found(tmp_path):
    planted = tmp_path / "recipe" / "training" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f(cfg):\n    return cfg.trainer.engine == 'megatron'\n")
    assert _engine_readers(tmp_path) == ["recipe/training/planted.py:2"]


def _micro_batch_drivers(root: Path, scanned=SCANNED) -> list[str]:
    """Code that runs backward or builds a model call on a packed micro-batch (a call whose
    `packed_seq_params=` keyword builds them) outside the one driver."""
    found = []
    paths = []
    for name in scanned:
        target = root / name
        paths += [target] if target.is_file() else sorted(target.rglob("*.py"))
    for path in paths:
        rel = path.relative_to(root)
        if rel == DRIVER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            backward = isinstance(node.func, ast.Attribute) and node.func.attr == "backward"
            model_call = any(  # a model inside the model passes them on unbuilt
                k.arg == "packed_seq_params" and isinstance(k.value, ast.Call)
                for k in node.keywords
            )
            if backward or model_call:
                found.append(f"{rel.as_posix()}:{node.lineno}")
    return found


def test_one_driver_of_a_micro_batch():
    """The model call, the loss and backward of a micro-batch exist only in micro_batch.py: the
    engines, the GPU checks and the benchmarks call `run_micro_batch` (or, megatron's schedule,
    its forward), so none of them can drift from what training runs."""
    assert _micro_batch_drivers(ROOT) == []


def test_no_test_imports_a_second_driver():
    """Tests run micro-batches through the production path (`run_micro_batch`)."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        assert "forward_step(batch" not in text and "_training_pass" not in text, path


@pytest.mark.parametrize(
    "planted",
    [
        "def _pass(model, work):\n    (loss / work.n).backward()\n",
        "def _call(model, b):\n    return model(input_ids=b.x, packed_seq_params=p(b))\n",
    ],
)
def test_negative_control_a_second_driver_is_found(tmp_path, planted):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "checks.py").write_text(planted)
    assert _micro_batch_drivers(tmp_path, ("recipe",)) == ["recipe/checks.py:2"]
