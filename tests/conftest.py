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
    """GPU tests run only where CUDA is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
