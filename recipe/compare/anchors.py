"""The anchored check: both layouts from the SAME state, at anchors along a long run.

The noise floor (noise.py) lets a long run's curves drift as far as two correct runs drift apart,
which late in a run is far more than a small bug moves them. An anchor takes that drift away: the
baseline kept its state at each anchor (`<baseline>/anchors/`) and logged the
`compare.anchor_steps` steps after it, per token too; the run's own settings are trained from that
state, on the same data, for the same steps (`recipe.launch.anchors`, into
`<run>/anchor_probes/`). The two sides then start equal, so they differ only by how the work was
split, exactly as at step 1 of a run: each step's `lm_loss`, `mtp_loss` and `grad_norm` is judged
at `rtol`, and every token of the first step at the per-token atol, whatever step the anchor is
at. A bug active at an anchor's steps shows there as it would at step 1: the first step shows a
wrong gradient in `grad_norm` (and a wrong forward in the loss and the tokens), the second the
wrong update in its loss. The second step's tokens are not judged one by one: after one update
from gradients that differ in their last bits, Adam moves the weights whose gradients are near
zero by up to `lr` in either direction, and single tokens drift by up to 1e-5 in correct runs
(measured: 9.5e-6 at step 1802 of the default config, cp=2, against 4.8e-6 at most on the first
steps of its 20 anchors), which is the per-token tolerance itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recipe.compare.noise import run_module_logged
from recipe.compare.runs import Run, relative_difference, series
from recipe.compare.tokens import compare_records
from recipe.errors import RecipeError
from recipe.rundir.layout import (
    anchor_probe_dir,
    anchor_states,
    anchors_dir,
    metrics_path,
)
from recipe.rundir.metrics import parse_metrics_lines
from recipe.rundir.tokens import read_token_records

PROBE_TRAINER = "recipe.launch.anchors"
"""The module that trains a run's settings from a baseline's anchors, as a process of its own."""


class ProbeFailed(RecipeError):
    """The run's settings did not train from the baseline's anchors; the message names the log."""


@dataclass
class AnchorResult:
    """One anchor: the run's settings and the baseline, the same state, the same steps."""

    step: int
    """The anchor: both sides start from the baseline's state after this step."""
    steps: list[int]
    worst_metric: str | None
    worst_rel: float
    """The largest relative difference of any metric at any of the steps."""
    token_max_abs: float | None
    """The largest per-token loss difference on the first step (None: no records on one
    side)."""
    ratio: float
    """How far the worst of the two went, in units of its tolerance (> 1 fails)."""
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.ratio <= 1 and not self.note


def needs_anchors(floor, metrics, rtol: float) -> bool:
    """Whether the noise floor widened the tolerance anywhere: only then have the curves lost the
    power to see a bug of rtol's size, and the anchors are needed."""
    return floor is not None and any(floor.margin * floor.largest(m) > rtol for m in metrics)


def train_probes_process(run_dir: Path, baseline_dir: Path) -> None:
    """Train the run's settings from every anchor of the baseline, in a process of its own."""
    root = anchor_probe_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    failed = run_module_logged(PROBE_TRAINER, [str(run_dir), str(baseline_dir)], root)
    if failed is not None:
        raise ProbeFailed(
            f"the anchored check of {run_dir} could not train from {baseline_dir}'s anchors "
            f"({failed})"
        )


def _probes_complete(run: Run, steps: list[int], anchor_steps: int) -> bool:
    for step in steps:
        path = metrics_path(anchor_probe_dir(run.path, step))
        if not path.exists():
            return False
        records, _ = parse_metrics_lines(path.read_text().splitlines())
        if len(records) != anchor_steps:
            return False
    return True


def judge_anchors(
    run: Run,
    baseline: Run,
    rtol: float,
    token_atol: float,
    metrics,
    train_probes: Callable[[Path, Path], None] | None = None,
) -> tuple[list[AnchorResult], str | None]:
    """Every anchor of the baseline, judged; and a note when there are none to judge. Probes
    already trained from the same anchors are reused."""
    states = anchor_states(baseline.path)
    if not states:
        return [], (
            f"no anchored check: the baseline {baseline.path.name} kept no anchors (train it "
            "with compare.anchor_every > 0 and more steps than that); late in the run only the "
            "noise floor judged it"
        )
    anchor_steps = int(baseline.config.get("compare.anchor_steps", 2))
    if not _probes_complete(run, list(states), anchor_steps):
        (train_probes or train_probes_process)(run.path, baseline.path)
    base_tokens = read_token_records(anchors_dir(baseline.path))
    results = []
    for step in states:
        probe_dir = anchor_probe_dir(run.path, step)
        records, _ = parse_metrics_lines(metrics_path(probe_dir).read_text().splitlines())
        probe = Run(probe_dir, records)
        results.append(
            judge_anchor(step, probe, baseline, base_tokens, rtol, token_atol, metrics, run.cp or 1)
        )
    return results, None


def judge_anchor(
    step: int, probe: Run, baseline: Run, base_tokens: dict, rtol, atol, metrics, cp_size: int
) -> AnchorResult:
    """The anchor at `step`: every metric of the probe's steps against the baseline's at `rtol`,
    and every token of the first of them (`base_tokens`, the baseline's records by step) at
    `atol`."""
    steps = sorted(int(r["step"]) for r in probe.metrics)
    worst_metric, worst_rel, note = None, 0.0, ""
    for metric in metrics:
        mine, theirs = series(probe, metric), series(baseline, metric)
        for s in steps:
            if s not in mine and s not in theirs:
                continue
            if s not in mine or s not in theirs:
                note = f"{metric} at step {s} is missing on one side"
                continue
            rel = relative_difference(mine[s], theirs[s])
            if rel != rel:  # NaN
                rel = float("inf")
            if worst_metric is None or rel > worst_rel:
                worst_metric, worst_rel = metric, rel
    ratio = worst_rel / rtol
    token_max = None
    first = steps[:1]
    mine_tokens = {s: r for s, r in read_token_records(probe.path).items() if s in first}
    theirs_tokens = {s: r for s, r in base_tokens.items() if s in first}
    if mine_tokens and theirs_tokens:
        tokens = compare_records(
            mine_tokens, theirs_tokens, atol, cp_size, probe.path, baseline.path
        )
        if tokens.problems:
            note = note or tokens.problems[0]
        token_max = max((d.max_abs for d in tokens.steps), default=0.0)
        ratio = max(ratio, token_max / atol)
    return AnchorResult(step, steps, worst_metric, worst_rel, token_max, ratio, note)


def first_failed(results: list[AnchorResult]) -> AnchorResult | None:
    return next((r for r in results if not r.passed), None)
