"""Stored baselines: a run's curves and per-token records in one file, to judge later runs by.

    python -m recipe.compare RUN --export-golden cp1.golden.json     # store a cp=1 run
    python -m recipe.compare RUN --golden cp1.golden.json [--per-token]

So a GPU run can be judged against a stored cp=1 curve without running cp=1 again. The file is
JSON: the run's resolved config (flattened), its metrics.jsonl records (after resumes) and, when
it recorded any, its per-token records.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recipe.compare.runs import Run, load_run
from recipe.rundir.tokens import read_token_records

GOLDEN_FORMAT = 1


def export_golden(run_dir: str | Path, path: str | Path) -> Path:
    run = load_run(run_dir)
    tokens = read_token_records(run_dir)
    golden = {
        "format": GOLDEN_FORMAT,
        "source": str(Path(run_dir).resolve()),
        "config": run.config,
        "metrics": run.metrics,
        "tokens": {
            str(step): {name: _strict(values) for name, values in columns.items()}
            for step, columns in tokens.items()
        },
    }
    path = Path(path)
    path.write_text(json.dumps(golden) + "\n")
    return path


def _strict(values: np.ndarray) -> list:
    """NaN (no target at an MTP depth) as null: the file stays strict JSON."""
    if values.dtype.kind != "f":
        return values.tolist()
    return [None if v != v else v for v in values.tolist()]


def load_golden(path: str | Path) -> tuple[Run, dict]:
    """(the stored run, its per-token records {step: {column: array}})."""
    path = Path(path)
    try:
        golden = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read golden file {path}: {err}") from None
    if not isinstance(golden, dict) or golden.get("format") != GOLDEN_FORMAT:
        raise ValueError(f"{path} is not a golden file of format {GOLDEN_FORMAT}")
    run = Run(path=path, metrics=golden["metrics"], config=golden["config"])
    losses = {"lm_loss"} | {
        name
        for columns in golden.get("tokens", {}).values()
        for name in columns
        if name.startswith("mtp_loss_")
    }
    tokens = {
        int(step): {
            name: np.asarray(values, dtype=np.float64 if name in losses else np.int64)
            for name, values in columns.items()
        }
        for step, columns in golden.get("tokens", {}).items()
    }
    return run, tokens
