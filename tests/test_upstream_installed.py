"""A release read where it is installed: the checker's `installed` release (torch, whose wheel is
too large to fetch), a named version that is the installed one (read, not downloaded), a
reproducer's default source, and the `--all` table's key for such a library; and the mildest
impact class those checks can report, work unbalanced. No download, no process."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream import table as upstream_table
from recipe.checks.upstream.kit.checked import IMPACTS, Library
from recipe.upstream import prelude, source

FILE = "torch/nn/modules/linear.py"  # any file of the installed torch


def test_installed_and_the_installed_version_read_the_installed_file(monkeypatch):
    def no_download(*args):
        raise AssertionError(f"fetched {args}: the installed release is that version")

    monkeypatch.setattr(source, "fetched_file", no_download)
    path, version = source.source_file("torch", "installed", FILE)
    assert (
        version == importlib.metadata.version("torch")
        and path.read_text() == open(torch.nn.modules.linear.__file__).read()
    )
    public = source.public_version(torch.__version__)  # "2.13.0+cpu" -> "2.13.0"
    assert "+" not in public and torch.__version__.startswith(public)
    assert source.source_file("torch", public, FILE) == (path, public)


class _Listed:
    """A RECORD entry whose hash is not the installed file's (a file edited in place)."""

    def __init__(self, real):
        self.real, self.hash = real, type("Hash", (), {"mode": "sha256", "value": "edited"})()

    def __str__(self):
        return str(self.real)

    def locate(self):
        return self.real.locate()


def test_only_the_wheels_own_file_is_read_in_place_of_a_download(monkeypatch):
    assert source.installed_as_released("torch", FILE)
    assert not source.installed_as_released("torch", "torch/no_such_file.py")
    real = importlib.metadata.distribution("torch")
    listed = [_Listed(f) for f in real.files if str(f) == FILE]
    edited = type("Dist", (), {"files": listed, "version": real.version})()
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: edited)
    assert not source.installed_as_released("torch", FILE)
    fetched = []
    monkeypatch.setattr(source, "fetched_file", lambda *args: fetched.append(args) or "wheel")
    public = source.public_version(torch.__version__)
    assert source.source_file("torch", public, FILE) == ("wheel", public) and fetched


def test_another_version_is_still_fetched(monkeypatch):
    fetched = []
    monkeypatch.setattr(source, "fetched_file", lambda *args: fetched.append(args) or "wheel")
    assert source.source_file("torch", "1.0.0", FILE) == ("wheel", "1.0.0")
    assert fetched == [("torch", "1.0.0", FILE)]


def test_a_reproducer_reads_the_installed_release_when_it_is_the_version(
    tmp_path, monkeypatch, capsys
):
    root = prelude.installed_release("torch", source.public_version(torch.__version__))
    assert root == source.installed_root("torch") and (root / FILE).is_file()
    assert prelude.installed_release("torch", "1.0.0") is None
    assert prelude.installed_release("no-such-distribution", "1.0.0") is None
    prelude.extract(root, FILE, tmp_path)  # a site-packages folder serves as the wheel
    assert (tmp_path / FILE).read_bytes() == (root / FILE).read_bytes()
    # main's default source: the installed folder, no pip
    monkeypatch.setattr(sys, "argv", ["reproduce.py"])
    monkeypatch.setattr(prelude, "fetch_wheel", lambda *a: pytest.fail("pip download"))
    monkeypatch.setattr(prelude, "release_outputs", lambda wheel: wheel)
    monkeypatch.setattr(prelude, "problems", lambda outputs: [f"read {outputs}"])
    assert prelude.main("torch", torch.__version__) == 1
    assert f"read {root}" in capsys.readouterr().out


def test_the_table_keys_an_installed_librarys_rows_by_the_registry_release(monkeypatch):
    registry = {
        "lib": Library("lib", (), releases=("installed",)),
        "other": Library("o", (), ("1.0",)),
    }
    monkeypatch.setattr(upstream_table, "REGISTRY", registry)
    row = {"library": "lib", "version": "2.14.1+cu130", "function": "f"}
    assert upstream_table.registry_key(row) == ("lib", "installed", "f")
    other = {"library": "other", "version": "1.0", "function": "g"}
    assert upstream_table.registry_key(other) == ("other", "1.0", "g")


def test_work_unbalanced_is_the_mildest_impact():
    """The search climbs from a finding's class to every worse one: an imbalance first found is
    then searched for padding, raises, misplaced and lost tokens."""
    assert min(Impact) is Impact.UNBALANCED and Impact.UNBALANCED < Impact.PADDING
    assert IMPACTS["unbalanced"] is Impact.UNBALANCED
    assert Impact.UNBALANCED.label == "work unbalanced"
