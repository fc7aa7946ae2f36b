"""Training runs as the comparison reads them: metrics.jsonl plus the resolved Hydra config.

A run directory holds `metrics.jsonl` (one JSON line per optimizer step) and `.hydra/config.yaml`;
a sweep directory holds run directories. A run killed while writing its last line still loads,
with a note, because a crashed job is exactly the one a user wants to compare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from recipe.rundir.job_files import read_job_config
from recipe.rundir.layout import ANCHOR_PROBES_DIR, METRICS_FILE, NOISE_TWIN_DIR, metrics_path
from recipe.rundir.metrics import parse_metrics_lines

# Config keys that say nothing about what a run computed: where it wrote and how it logged.
IGNORED_PREFIXES = (
    "output_dir",
    "logger.",
    "trainer.progress_bar",
    "trainer.log_every",
    "trainer.checkpoint_",  # where and how often state is saved, and whether the run resumed:
    "trainer.resume",  # not what is computed
    "trainer.requeue",
    "compare.",
    "hydra.",
)


@dataclass
class Run:
    path: Path
    metrics: list[dict]
    config: dict[str, object] = field(default_factory=dict)
    """Flattened resolved config (`a.b.c` keys), empty when the run has no .hydra/config.yaml."""
    notes: list[str] = field(default_factory=list)
    """What loading had to work around (a line cut short by a kill)."""

    @property
    def cp(self) -> int | None:
        value = self.config.get("cp.size")
        return int(value) if value is not None else None

    @property
    def is_reference_layout(self) -> bool:
        """One rank of everything, and (vision) positions delivered whole."""
        return (
            self.cp == 1
            and int(self.config.get("parallel.dp", 1)) == 1
            and int(self.config.get("parallel.tp", 1)) == 1
            and int(self.config.get("parallel.pp", 1)) == 1
            and self.config.get("vision.positions", "full_stream") == "full_stream"
            and self.config.get("mutant.name", "none") == "none"
        )


def flatten_config(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(flatten_config(value, f"{prefix}{key}."))
        return out
    if isinstance(node, list):
        return {prefix[:-1]: json.dumps(node)}
    return {prefix[:-1]: node}


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics_file = metrics_path(path)
    if not metrics_file.exists():
        raise FileNotFoundError(f"{path} has no {METRICS_FILE}: not a run directory")
    try:
        metrics, cut = parse_metrics_lines(metrics_file.read_text().splitlines())
    except ValueError as err:
        raise ValueError(f"{metrics_file}: {err}") from err
    notes = [f"ignored a line cut short by a kill ({n}) of {METRICS_FILE}" for n in cut]
    job_config = read_job_config(path)
    config = {} if job_config is None else flatten_config(job_config)
    return Run(path=path, metrics=metrics, config=config, notes=notes)


HELPER_DIRS = {NOISE_TWIN_DIR, ANCHOR_PROBES_DIR}
"""Directories inside a run that hold metrics of runs of its own making, judged with it."""


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Run directories from the given paths; a directory without metrics (a sweep) is searched."""
    runs = []
    for p in map(Path, paths):
        if metrics_path(p).exists():
            runs.append(load_run(p))
            continue
        found = sorted(
            {
                m.parent
                for m in p.rglob(METRICS_FILE)
                # a baseline's noise twin and a run's anchor probes are the run's helpers
                if not HELPER_DIRS & set(m.relative_to(p).parts)
            },
            key=_natural_key,
        )
        if not found:
            raise FileNotFoundError(f"{p} holds no {METRICS_FILE}: nothing to compare")
        runs.extend(load_run(f) for f in found)
    return runs


def _natural_key(path: Path):
    # Numbered jobs in number order, before any other name (a sweep may hold both).
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts]


def series(run: Run, metric: str) -> dict[int, float]:
    """A metric by step, skipping steps where it was not logged or null."""
    return {
        int(m["step"]): float(m[metric])
        for m in run.metrics
        if metric in m and m[metric] is not None
    }


def relative_difference(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def nonfinite_steps(run: Run, metric: str) -> list[int]:
    """Steps whose record holds the metric as null: a NaN or inf, written as null (JSON has no
    NaN), which `series` leaves out."""
    return [int(m["step"]) for m in run.metrics if metric in m and m[metric] is None]


def run_labels(runs: list[Run]) -> dict[Path, str]:
    """Short names: the directory name plus the config values that differ between the runs."""
    keys = sorted({k for r in runs for k in r.config if not k.startswith(IGNORED_PREFIXES)})
    varying = [k for k in keys if len({json.dumps(r.config.get(k)) for r in runs}) > 1]
    labels = {}
    for run in runs:
        settings = " ".join(f"{k.removesuffix('.size')}={run.config.get(k)}" for k in varying)
        labels[run.path] = f"{run.path.name}: {settings}" if settings else run.path.name
    return labels
