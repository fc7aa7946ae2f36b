"""The contract every checker plugin keeps, proved once for every registered function
(`recipe/checks/upstream/registry.py`) at its library's newest release, so a new library is
tested here the moment its registry line exists:

- its negative control (`broken_copy()`, one line of the released source changed) is flagged by
  the checker's own search on a case where the release itself passes;
- the reproducer of that finding is a standalone script (no recipe import) that accepts the
  ground truth's outputs and judges the released file as the checker does: it passes there;
- where docs/upstream.json has the newest release FAIL, the checker's own draw finds a case the
  release fails, and that finding's reproducer flags the released code (its `problems` is not
  empty) and accepts the ground truth: a reproducer that never reports would pass the others;
- an option the checker does not know is refused (exit 2, the option named), never ignored.

Each plugin's own tests (tests/test_upstream_NAME.py) keep what only it has: its findings on the
releases, pinned twice, its other control parts and its signature refusals. The wheels come from
pip into the cache once: marked `launches`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from recipe.check_upstream import main
from recipe.checks.upstream.registry import REGISTRY
from recipe.checks.upstream.runner import options_strategy
from recipe.checks.upstream.table import registry_key
from recipe.upstream.prelude import installed_release
from recipe.upstream.source import cache_root

pytestmark = pytest.mark.launches

FUNCTIONS = [
    (name, target.name) for name, library in REGISTRY.items() for target in library.targets
]
CASES = 200  # the draws allowed; each stops at its first case


def _release(name: str) -> str:
    return REGISTRY[name].releases[-1]


@pytest.fixture(scope="module")
def loaded():
    """(library, function) -> the newest release's function, loaded once."""
    cache: dict = {}

    def load(name: str, function: str):
        if (name, function) not in cache:
            library = REGISTRY[name]
            target = next(t for t in library.targets if t.name == function)
            cache[name, function] = target.load(name, library.distribution, _release(name))
        return cache[name, function]

    return load


class _Found(Exception):
    """Ends the draw at the first case that answers."""


def first_case(strategy, answer, cases: int):
    """The first of `cases` draws of `strategy` (seed 0) for which `answer` gives a value, and
    that value; (None, cases) when none does. Not shrunk: the control needs a case, not the
    smallest one, and shrinking would run the functions again and again."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    ran = 0

    @seed(0)
    @settings(max_examples=cases, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(strategy)
    def draw(case):
        nonlocal ran
        ran += 1
        found = answer(case)
        if found is not None:
            raise _Found(found)

    try:
        draw()
    except _Found as found:
        return found.args[0], ran
    return None, ran


def control_finding(checked, broken, cases: int):
    """(the finding of `broken` on the first drawn case `checked` passes, draws made), options
    drawn as the checker draws them."""
    from hypothesis import strategies as st

    def where_the_release_passes(case):
        inner, drawn = case
        options = {k: v for k, v in drawn.items() if v is not None}
        found = broken.finding(inner, options)
        if found is None or checked.finding(inner, options) is not None:
            return None
        return found

    strategy = st.tuples(checked.cases(1), options_strategy(checked, {}, True))
    return first_case(strategy, where_the_release_passes, cases)


@pytest.fixture(scope="module")
def controls(loaded):
    """(library, function) -> its broken copy's finding on a case the release passes."""
    cache: dict = {}

    def control(name: str, function: str):
        if (name, function) not in cache:
            checked = loaded(name, function)
            cache[name, function] = control_finding(checked, checked.broken_copy(), CASES)
        return cache[name, function]

    return control


def _wheel(distribution: str, version: str):
    """The release's wheel, or its sdist where it publishes none, from the cache; the installed
    release's folder where it is that version (torch's, checked where it is installed)."""
    installed = installed_release(distribution, version)
    if installed is not None:
        return installed
    folder = cache_root() / f"{distribution}-{version}"
    return next(p for pattern in ("*.whl", "*.tar.gz") for p in sorted(folder.glob(pattern)))


@pytest.mark.parametrize("name, function", FUNCTIONS, ids=[f"{n}:{f}" for n, f in FUNCTIONS])
def test_the_control_is_flagged_where_the_release_passes(controls, name, function):
    found, ran = controls(name, function)
    assert found is not None, (
        f"{name}@{_release(name)} {function}: the broken copy passes {ran} cases the release "
        "passes: the control proves nothing"
    )
    assert found.what, found


@pytest.mark.parametrize("name, function", FUNCTIONS, ids=[f"{n}:{f}" for n, f in FUNCTIONS])
def test_the_reproducer_accepts_the_truth_and_passes_the_release(
    loaded, controls, name, function, tmp_path, monkeypatch
):
    """On the control's case the release passes: its reproducer, run on the released wheel,
    must find nothing there, and must accept what the ground truth gives."""
    checked = loaded(name, function)
    found, _ = controls(name, function)
    script = _reproducer(checked, found, tmp_path, monkeypatch)
    assert script.problems(checked.truth_outputs(found)) == []
    wheel = _wheel(checked.distribution, checked.version)
    assert script.problems(script.release_outputs(wheel)) == [], checked.label
    if str(wheel).endswith(".whl"):  # the same release installed: a site-packages folder
        folder = tmp_path / "site-packages"
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(folder)
        assert script.problems(script.release_outputs(folder)) == [], f"{checked.label}, installed"


def _reproducer(checked, found, tmp_path, monkeypatch):
    """`checked`'s reproducer of `found`, written and loaded as a module (not run)."""
    source = checked.reproducer(found)
    assert source is not None, f"{checked.label} has no reproducer"
    assert "import recipe" not in source and "from recipe" not in source
    path = tmp_path / "reproduce.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"repro_{len(sys.modules)}", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # a script that fetches a second release (ms-swift's runs on mcore-bridge) takes it from the
    # cache rather than from pip
    bridge = cache_root() / "mcore-bridge-1.6.5"
    if bridge.is_dir():
        monkeypatch.setitem(os.environ, "MCORE_BRIDGE_WHEEL", str(_wheel("mcore-bridge", "1.6.5")))
    return script


# The checker's last table: the functions whose newest release it FAILs (in any mode), in the
# registry's order, and the cases it drew per mode (the draw budget below).
RECORD = json.loads((Path(__file__).parents[1] / "docs" / "upstream.json").read_text())
_FAILED = {registry_key(r) for r in RECORD["rows"] if r["verdict"] == "FAIL"}
FAILING = [(n, f) for n, f in FUNCTIONS if (n, _release(n), f) in _FAILED]


def test_the_table_fails_some_newest_releases():
    """The test below has cases: with none, the reporting side would go unproved unnoticed."""
    assert FAILING


@pytest.mark.parametrize("name, function", FAILING, ids=[f"{n}:{f}" for n, f in FAILING])
def test_the_reproducer_flags_the_release_where_the_table_fails(
    loaded, name, function, tmp_path, monkeypatch, capsys
):
    """Where docs/upstream.json says the newest release FAILs, the checker's draw (seed 0, options
    drawn, not shrunk) finds a case the release fails within the table's own case count, and
    that finding's reproducer reports it on the released wheel while accepting the truth."""
    checked = loaded(name, function)

    def release_finding(case):
        inner, drawn = case
        return checked.finding(inner, {k: v for k, v in drawn.items() if v is not None})

    from hypothesis import strategies as st

    strategy = st.tuples(checked.cases(1), options_strategy(checked, {}, True))
    found, ran = first_case(strategy, release_finding, RECORD["cases"])
    assert found is not None, (
        f"{checked.label}: docs/upstream.json says FAIL, but {ran} drawn cases (seed 0) found "
        "nothing"
    )
    script = _reproducer(checked, found, tmp_path, monkeypatch)
    assert script.problems(checked.truth_outputs(found)) == [], found.describe()
    wheel = _wheel(checked.distribution, checked.version)
    # its entry point, as a user runs it (`reproduce.py --wheel PATH`): exit 1 when `problems`
    # reports the release's outputs, or when the released code itself raises on the case (its
    # `release_outputs` raises then; the prelude's `main` tells that from a raise of its own)
    monkeypatch.setattr(sys, "argv", ["reproduce.py", "--wheel", str(wheel)])
    assert script.main(checked.distribution, checked.version) == 1, (
        f"{checked.label}: the reproducer reports nothing on the release; {found.describe()}"
    )
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(f"{checked.version}: REPRODUCED"), printed


@pytest.mark.parametrize("name", list(REGISTRY))
def test_an_option_the_checker_does_not_know_is_refused(name, capsys):
    assert main([f"{name}@{_release(name)}", "--fixed", "no_such_option=1", "--cases", "1"]) == 2
    assert "no_such_option" in capsys.readouterr().err


def test_a_control_that_changes_nothing_is_not_flagged(loaded):
    """The control test can fail: a "broken copy" that is the release itself is flagged on no
    case the release passes, in every draw."""
    checked = loaded("fla-core", "get_cp_cu_seqlens")
    assert control_finding(checked, checked, 20) == (None, 20)
