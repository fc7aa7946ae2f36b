"""The fp32 noise floor of a baseline, learned from its noise twin, and the tolerance it sets.

Two correct fp32 runs that sum the same numbers in another order drift apart: a rounding
difference of ~1e-7 at step 1 is carried and grown by training itself, so on the default config
grad_norm differs by ~1e-5 at step 80 and ~4e-4 by step 300 whatever the layout (docs/comparing-
runs.md has the measurements). A fixed tolerance therefore calls correct long runs FAIL. The twin
measures the drift of the very setting being judged: the baseline trained again with only
`batching.sequence_order=reversed` (the same sums, taken in another order), stored in
`<baseline>/noise_twin/`. Its relative difference from the baseline, as a running maximum over the
steps so far, is the floor's envelope; a run passes a step when its difference from the baseline
is within `max(rtol, margin x envelope(step))`. So a short run is judged by `rtol` alone, and a
bug that shows on the first steps (every negative control of the repository) fails as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from recipe.compare.runs import Run, load_run, relative_difference, series
from recipe.environment import lone_process_environment
from recipe.errors import RecipeError
from recipe.names import NOISE_MARGIN
from recipe.rundir.job_files import read_job_config
from recipe.rundir.layout import LOG_FILE, config_path, metrics_path, noise_twin_dir

TWIN_TRAINER = "recipe.launch.noise_twin"
"""The module that trains a twin, run as a process of its own: the comparison reads run
directories and starts no training in its own process."""


class TwinFailed(RecipeError):
    """The noise twin did not train; the message names its log."""


@dataclass(frozen=True)
class NoiseFloor:
    """A baseline's drift from its noise twin, per metric, as a running maximum by step."""

    twin: Path
    envelopes: dict[str, dict[int, float]]
    margin: float = NOISE_MARGIN

    def threshold(self, metric: str, step: int, rtol: float) -> float:
        envelope = self.envelopes.get(metric, {})
        earlier = [s for s in envelope if s <= step]
        drift = envelope[max(earlier)] if earlier else 0.0
        return max(rtol, self.margin * drift)

    def largest(self, metric: str) -> float:
        return max(self.envelopes.get(metric, {}).values(), default=0.0)

    def describe(self, metrics: tuple[str, ...] | list[str]) -> str:
        drift = ", ".join(f"{m} {self.largest(m):.1e}" for m in metrics if m in self.envelopes)
        return f"noise twin {self.twin} (largest drift {drift}), margin {self.margin:g}x"


def envelope(baseline: Run, twin: Run, metric: str) -> dict[int, float]:
    """The running maximum, step by step, of the relative difference between the two runs."""
    a, b = series(baseline, metric), series(twin, metric)
    running, out = 0.0, {}
    for step in sorted(a.keys() & b.keys()):
        running = max(running, relative_difference(a[step], b[step]))
        out[step] = running
    return out


def floor_from_twin(baseline: Run, twin: Run, metrics, margin: float = NOISE_MARGIN) -> NoiseFloor:
    """The floor a twin gives; raises ValueError when the twin did not train the baseline's
    steps (a twin cut short says nothing about the steps it lacks)."""
    missing = {int(m["step"]) for m in baseline.metrics} - {int(m["step"]) for m in twin.metrics}
    if missing:
        raise ValueError(
            f"noise twin {twin.path} lacks {len(missing)} of the baseline's steps (first "
            f"{min(missing)}): delete it and compare again to train it anew"
        )
    return NoiseFloor(twin.path, {m: envelope(baseline, twin, m) for m in metrics}, margin)


def stored_floor(baseline: Run, metrics, margin: float = NOISE_MARGIN) -> NoiseFloor | None:
    """The floor of the twin stored in the baseline's directory, or None when it has none."""
    twin_dir = noise_twin_dir(baseline.path)
    if not metrics_path(twin_dir).exists():
        return None
    return floor_from_twin(baseline, load_run(twin_dir), metrics, margin)


def twin_problem(baseline_dir: str | Path, logged_steps: int) -> str | None:
    """Why the baseline's twin cannot be trained, or None: it needs the config a train.py run
    records, and a baseline that ran all its steps (a twin of a run cut short would train the
    steps the baseline never took)."""
    raw = read_job_config(baseline_dir)
    if raw is None:
        return f"{baseline_dir} has no {config_path(baseline_dir).relative_to(baseline_dir)}"
    steps = (raw.get("trainer") or {}).get("max_steps")
    if not isinstance(steps, int) or not all(k in raw for k in ("model", "data", "batching")):
        return f"{config_path(baseline_dir)} is not the config of a train.py run"
    if logged_steps != steps:
        return f"the baseline logged {logged_steps} of its trainer.max_steps={steps} steps"
    return None


def run_module_logged(module: str, args: list[str], directory: Path) -> str | None:
    """Run `python -m module args` as a lone process of its own (even when a launched rank
    asks), its console in `directory`'s train.log; returns None, or the log's last line and
    where the log is when it failed."""
    log = directory / LOG_FILE
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, "-m", module, *args],
            stdout=out,
            stderr=out,
            env=lone_process_environment(os.environ),
        )
    if done.returncode == 0:
        return None
    tail = log.read_text().strip().splitlines()[-1:] or ["(empty log)"]
    return f"exit {done.returncode}: {tail[0]}; its log is {log}"


def train_twin_process(baseline_dir: str | Path) -> Path:
    """Train the twin of `baseline_dir` anew, in a process of its own (a lone process even when
    a launched rank asks), its console in the twin's train.log; returns the twin's directory."""
    twin = noise_twin_dir(baseline_dir)
    shutil.rmtree(twin, ignore_errors=True)  # a twin cut short by an earlier failure
    twin.mkdir(parents=True)
    failed = run_module_logged(TWIN_TRAINER, [str(baseline_dir)], twin)
    if failed is not None or not metrics_path(twin).exists():
        raise TwinFailed(f"the noise twin of {baseline_dir} did not train ({failed})")
    return twin
