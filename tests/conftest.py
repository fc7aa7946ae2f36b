"""Fixtures for every test: a clean environment per test, GPU tests only where CUDA is."""

from __future__ import annotations

import os

import pytest

from tests.helpers.cli import RANK_VARIABLES


@pytest.fixture(autouse=True)
def _isolated_environment():
    """A test process is a lone rank unless a test says otherwise, and whatever a test (or the
    code under test) writes into os.environ is undone afterwards."""
    saved = dict(os.environ)
    for var in RANK_VARIABLES:
        os.environ.pop(var, None)
    os.environ.setdefault("WANDB_MODE", "disabled")
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """Ranks are processes: `distributed` implies `launches`. GPU tests run only where CUDA is."""
    import torch

    for item in items:
        if "distributed" in item.keywords and "launches" not in item.keywords:
            item.add_marker(pytest.mark.launches)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Processes a test may start without the `launches` marker: quick tools that are not Python.
# fc-list: matplotlib asks fontconfig for the system's fonts the first time it draws on a machine
# (its font cache, built once), so on a fresh machine the first plotting test starts it.
_QUICK_TOOLS = {"fc-list", "git", "hadolint", "pgrep"}


@pytest.fixture(autouse=True)
def _launches_are_marked(request, monkeypatch):
    """A test that starts a process (train.py, a Python script, gloo ranks) must be marked
    `launches`, so that `make test-fast` (-m "not launches") stays free of process starts; an
    unmarked one fails here with the fix, instead of slowing the fast tier in silence."""
    if "launches" in request.keywords:
        return
    import multiprocessing.process
    import subprocess

    name = request.node.nodeid

    def refuse(what):
        raise AssertionError(
            f"{name} starts {what}: mark it @pytest.mark.launches (make test-fast skips those)"
        )

    real_init = subprocess.Popen.__init__

    def checked_init(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, str | os.PathLike) else list(args)
        tool = os.path.basename(str(argv[0])) if argv else ""
        if tool not in _QUICK_TOOLS and argv[:2] != ["bash", "-n"]:
            refuse(f"the process {argv[:3]}")
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_init)
    monkeypatch.setattr(
        multiprocessing.process.BaseProcess, "start", lambda self: refuse("a child process")
    )


@pytest.fixture(scope="session")
def worlds(tmp_path_factory):
    """Launched gloo worlds kept for the whole session, one per world size (helpers/world.py)."""
    from tests.helpers.world import WorldPool

    pool = WorldPool(tmp_path_factory.mktemp("worlds"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def shared_runs(worlds, tmp_path_factory):
    """Training runs trained once per session, whichever module asks first (helpers/runs.py)."""
    from tests.helpers.runs import SharedRuns

    return SharedRuns(worlds, tmp_path_factory.mktemp("shared_runs"))
