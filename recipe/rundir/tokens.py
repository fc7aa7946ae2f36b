"""`<run dir>/tokens/step_NNNNNNNN.npz`: a step's per-token records, one column per field.

Rank 0 writes every rank's rows of a step sorted into global order (sample, position), so two
runs' records line up token for token whatever their layouts; the columns are COLUMNS, then one
`mtp_loss_k` per MTP depth (recipe/training/tokens.py computes the rows). Written under a
temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from recipe.rundir.layout import STEP_PREFIX, step_name, tokens_dir

COLUMNS = ("sample", "position", "lm_loss", "dp_rank", "cp_rank", "chunk")
_INTEGER = ("sample", "position", "dp_rank", "cp_rank", "chunk")
_SUFFIX = ".npz"
_WRITING = ".tmp.npz"
_FILES = f"{STEP_PREFIX}*{_SUFFIX}"


def loss_columns(records: dict) -> list[str]:
    return [name for name in records if name == "lm_loss" or name.startswith("mtp_loss_")]


def write_token_records(
    run_dir: str | Path, step: int, parts: list[torch.Tensor], names=COLUMNS
) -> Path:
    """Every rank's rows of one step, in global order (sample, position), to an npz file."""
    rows = torch.cat([p for p in parts if p.numel()] or [torch.zeros(0, len(names))]).numpy()
    order = np.lexsort((rows[:, 1], rows[:, 0]))
    rows = rows[order]
    columns = {
        name: rows[:, i].astype(np.int64 if name in _INTEGER else np.float64)
        for i, name in enumerate(names)
    }
    directory = tokens_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step_name(step)}{_SUFFIX}"
    tmp = path.with_name(path.name + _WRITING)
    np.savez(tmp, **columns)
    os.replace(tmp, path)
    return path


def has_token_records(run_dir: str | Path) -> bool:
    return any(tokens_dir(run_dir).glob(_FILES))


def read_token_records(run_dir: str | Path) -> dict[int, dict[str, np.ndarray]]:
    """{step: {column: array}} of a run's per-token records (empty when it recorded none)."""
    directory = tokens_dir(run_dir)
    records = {}
    for path in sorted(directory.glob(_FILES)) if directory.is_dir() else []:
        if path.name.endswith(_WRITING):
            continue
        with np.load(path) as data:
            records[int(path.stem.split("_")[1])] = {k: data[k] for k in data.files}
    return records
