#!/usr/bin/env python
"""Compare training runs step by step and gate on the result (same as `python -m recipe.compare`).

python scripts/compare_runs.py RUN_DIR... [--baseline RUN_DIR] [--rtol X] [--plot FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipe.compare.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
