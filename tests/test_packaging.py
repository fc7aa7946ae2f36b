"""The cluster pieces that cannot run here (no Docker engine, no SLURM) are still checked for what
can go wrong without them: dependencies, paths and shell syntax."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from docker_requirements import image_requirements  # noqa: E402


def test_image_keeps_the_base_torch_and_installs_everything_else():
    reqs = image_requirements(ROOT / "pyproject.toml", dev=True)
    names = {re.split(r"[=<>!\[ ;]", r)[0].lower() for r in reqs}
    assert "torch" not in names
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = {
        re.split(r"[=<>!\[ ;]", r)[0].lower()
        for r in project["dependencies"] + project["optional-dependencies"]["dev"]
    }
    assert names == expected - {"torch"}
    assert all("==" in r for r in reqs), "the image installs the same pins"


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
