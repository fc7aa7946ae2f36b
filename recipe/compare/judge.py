"""The verdict: every run against its baseline, with each baseline's noise floor where it has one.

`compare.noise_floor` (`--noise-floor`) says where floors come from:
- `auto`: a baseline's stored twin is used; a baseline without one gets its twin trained only when
  a run fails against it at `rtol` (a short run that passes needs none, and the twin can only
  raise the tolerance), and every run is then judged again;
- `twin`: every baseline's twin, trained first where missing;
- `fixed`: `rtol` on every step, no twin.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from recipe.compare.anchors import ProbeFailed, first_failed, judge_anchors, needs_anchors
from recipe.compare.diff import DEFAULT_METRICS, Comparison, compare_all, pick_baselines
from recipe.compare.noise import (
    NoiseFloor,
    TwinFailed,
    stored_floor,
    train_twin_process,
    twin_problem,
)
from recipe.compare.runs import Run
from recipe.names import FP32_TOKEN_ATOL, NOISE_MARGIN
from recipe.rundir.layout import anchor_states


def _needs_twin(comparison: Comparison) -> bool:
    """A run failed against its baseline at `rtol` on a difference a floor could excuse."""
    return comparison.passed is False and any(
        d.worst_ratio is not None and d.worst_ratio > 1 for d in comparison.diffs
    )


def judge(
    runs: list[Run],
    rtol: float,
    baseline: Run | None = None,
    noise_floor: str = "auto",
    margin: float = NOISE_MARGIN,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    train_twin: Callable[[Path], Path] | None = None,
    say: Callable[[str], None] = print,
    train_probes: Callable[[Path, Path], None] | None = None,
    token_atol: float = FP32_TOKEN_ATOL,
) -> list[Comparison]:
    """Compare every run with its baseline under `noise_floor` (see the module); `train_twin`
    trains a baseline's twin into its directory (default: in a process of its own). A run whose
    baseline kept anchors is also judged at each of them (compare/anchors.py; `train_probes`
    trains its settings from them); where a floor widened the tolerance and the baseline kept
    none, a note says the verdict lost that power."""
    if noise_floor == "fixed":
        return compare_all(runs, rtol, baseline, metrics)
    train_twin = train_twin or train_twin_process
    floors: dict[Path, NoiseFloor] = {}

    def learn(base: Run, trained: bool) -> None:
        try:
            floor = stored_floor(base, metrics, margin)
        except ValueError:  # a twin cut short: trained again when one is needed
            if trained:
                raise
            floor = None
        if floor is not None:
            floors[base.path] = floor

    bases = {b.path: b for b in pick_baselines(runs, baseline) if b is not None}
    for base in bases.values():
        learn(base, trained=False)
    comparisons = compare_all(runs, rtol, baseline, metrics, floors)
    if noise_floor == "twin":
        missing = [b for b in bases.values() if b.path not in floors]
    else:
        missing = list(
            {c.baseline.path: c.baseline for c in comparisons if _needs_twin(c)}.values()
        )
        missing = [b for b in missing if b.path not in floors]
    untrainable = {}
    for base in missing:
        steps = len(base.metrics)
        problem = twin_problem(base.path, steps)
        if problem is not None:
            untrainable[base.path] = (
                f"judged at rtol alone: no noise twin can be trained ({problem})"
            )
            continue
        say(f"learning the noise floor of {base.path}: training its noise twin ({steps} steps)")
        try:
            train_twin(base.path)
        except TwinFailed as err:
            untrainable[base.path] = f"judged at rtol alone: {err}"
            say(str(err))
            continue
        learn(base, trained=True)
    if missing:
        comparisons = compare_all(runs, rtol, baseline, metrics, floors)
    for c in comparisons:
        if c.baseline is not None and c.baseline.path in untrainable:
            c.notes.append(untrainable[c.baseline.path])
        if c.baseline is None:
            continue
        if anchor_states(c.baseline.path) or needs_anchors(c.floor, metrics, rtol):
            _check_anchors(c, rtol, token_atol, metrics, train_probes, say)
    return comparisons


def _check_anchors(c: Comparison, rtol, token_atol, metrics, train_probes, say) -> None:
    """Judge the run at its baseline's anchors: a failing anchor fails the run."""
    say(f"anchored check of {c.run.path}: its settings from {c.baseline.path}'s anchors")
    try:
        results, note = judge_anchors(c.run, c.baseline, rtol, token_atol, metrics, train_probes)
    except ProbeFailed as err:
        c.notes.append(f"anchored check failed to run: {err}")
        c.anchors, c.passed = [], False
        return
    if note:
        c.notes.append(note)
        return
    c.anchors = results
    failed = first_failed(results)
    if failed is not None:
        c.passed = False
        c.notes.append(
            f"anchored check FAILED at anchor {failed.step} (steps {failed.steps}): "
            f"{failed.ratio:.3g}x its tolerance ({failed.note or failed.worst_metric})"
        )
