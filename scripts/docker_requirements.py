#!/usr/bin/env python
"""Print the recipe's pinned requirements for a GPU image whose base already ships torch.

NVIDIA's PyTorch containers carry their own CUDA build of torch (and Transformer Engine);
installing the project's `torch==2.13.0` pin there would replace it, so the image installs
everything else from pyproject.toml and the package itself with --no-deps.

    python scripts/docker_requirements.py [--dev] > requirements-image.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PROVIDED_BY_BASE_IMAGE = ("torch", "transformer-engine", "transformer_engine")


def image_requirements(pyproject: Path, dev: bool) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    if dev:
        wanted += project["optional-dependencies"]["dev"]

    def name(requirement: str) -> str:
        for sep in "=<>![ ;":
            requirement = requirement.split(sep)[0]
        return requirement.strip().lower()

    return [r for r in wanted if name(r) not in PROVIDED_BY_BASE_IMAGE]


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(image_requirements(root / "pyproject.toml", dev="--dev" in sys.argv)))
