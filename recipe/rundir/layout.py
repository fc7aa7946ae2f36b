"""The names of a run directory's files, in one place: every reader and writer takes them here.

    <run dir>/metrics.jsonl             one line per optimizer step (rundir/metrics.py)
              summary.json              the run's summary, written when it ends
              train.log                 the console, with timestamps (conf/hydra/job_logging)
              .lock                     the job's claim on the directory (rundir/claim.py)
              .hydra/                   config.yaml, hydra.yaml, overrides.yaml (job_files.py)
              tokens/step_00000010.npz  per-token records (rundir/tokens.py)
              trace/step_00000010.pt    activations and gradients of a step (rundir/traces.py)
              checkpoints/step_00000010/          a checkpoint, with its manifest.json
              checkpoints/step_00000010.partial/  one being written (never read)
              checkpoints/set_aside/              checkpoints of an abandoned timeline
              noise_twin/               the same run, sequences reversed: its fp32 noise
              anchors/step_00000100/    the run's state at an anchor (a checkpoint)
              anchors/tokens/           per-token records of the steps after each anchor
              anchor_probes/step_00000100/  this run's layout trained from its baseline's
                                        anchor: metrics.jsonl and tokens/ (compare/anchors.py)

A name changed here changes it for every reader and writer at once; the checkpoints of a run
written before a change would no longer be found, so these names do not change lightly.
"""

from __future__ import annotations

import re
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LOG_FILE = "train.log"
"""Written by Hydra's job logging (`${hydra.job.name}.log`, the job being `train`)."""
LOCK_FILE = ".lock"
HYDRA_DIR = ".hydra"
CONFIG_FILE = "config.yaml"
HYDRA_FILE = "hydra.yaml"
OVERRIDES_FILE = "overrides.yaml"
TOKENS_DIR = "tokens"
TRACE_DIR = "trace"
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
PARTIAL_SUFFIX = ".partial"
SET_ASIDE_DIR = "set_aside"
NOISE_TWIN_DIR = "noise_twin"
"""A run directory of its own inside a baseline's: how far the baseline's own rounding carries
it (recipe/compare/noise.py); never a run of the comparison itself."""

ANCHORS_DIR = "anchors"
"""The run's state at its anchors, kept for any run judged against it later."""
ANCHOR_PROBES_DIR = "anchor_probes"
"""This run's layout trained from its baseline's anchors: what the anchored check compares."""

STEP_PREFIX = "step_"
STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")
"""A checkpoint directory's name; its step is group 1."""


def step_name(step: int) -> str:
    """`step_00000010`: the name of step 10's checkpoint, and the stem of its records."""
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step a `step_N` name stands for, or None for any other name."""
    match = STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def summary_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SUMMARY_FILE


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOCK_FILE


def hydra_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HYDRA_DIR


def config_path(run_dir: str | Path) -> Path:
    """The job's resolved config as Hydra composed it: `.hydra/config.yaml`."""
    return hydra_dir(run_dir) / CONFIG_FILE


def tokens_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TOKENS_DIR


def trace_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TRACE_DIR


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def noise_twin_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / NOISE_TWIN_DIR


def anchors_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / ANCHORS_DIR


def anchor_probe_dir(run_dir: str | Path, step: int | None = None) -> Path:
    """`<run>/anchor_probes/` or, with `step`, the probe of the anchor at `step`."""
    root = Path(run_dir) / ANCHOR_PROBES_DIR
    return root if step is None else root / step_name(step)


def anchor_states(run_dir: str | Path) -> dict[int, Path]:
    """The complete anchor states a run kept, by step (a write cut short has no manifest)."""
    root = anchors_dir(run_dir)
    if not root.is_dir():
        return {}
    found = {step_of(p.name): p for p in root.iterdir() if p.is_dir()}
    return {
        step: path
        for step, path in sorted((s, p) for s, p in found.items() if s is not None)
        if (path / MANIFEST_FILE).exists()
    }
