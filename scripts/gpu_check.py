#!/usr/bin/env python
"""`python scripts/gpu_check.py [--out DIR] [--quick] [--only PART,PART]`: the GPU path on one GPU,
report.json and report.md (the body and its parts: `recipe.checks.gpu`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipe.checks.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
