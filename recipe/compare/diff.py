"""Compare training runs step by step: the verdict behind parity reports and `recipe.compare`.

Each run is compared with a baseline: by default the run with cp=1 (and dp=1, tp=1) whose config is
otherwise the same (keys that only change the parallel layout or logging are ignored), or one
baseline given explicitly. Per metric we report the largest absolute and relative difference over
the steps both runs logged, the final values and the correlation of the two curves; a run passes
when every metric shared with its baseline stays within `rtol`, it logged the same steps, and no
metric is missing on one side. Unequal lengths and missing metrics are reported, never fatal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from recipe.compare.noise import NoiseFloor
from recipe.compare.runs import (
    IGNORED_PREFIXES,
    Run,
    nonfinite_steps,
    relative_difference,
    series,
)

DEFAULT_METRICS = ("lm_loss", "mtp_loss", "grad_norm")
# Keys that may differ between a run and its baseline: how the work is split, not what is computed.
LAYOUT_KEYS = (
    "cp.size",
    "cp.preprocess",
    "cp.comm_type",
    "parallel.dp",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.pp",
    # megatron's engine: how the gradient reduction and optimizer state are split
    "trainer.megatron.use_distributed_optimizer",
    "trainer.megatron.overlap_grad_reduce",
    "model.attention_backend",
    "batching.max_tokens_per_rank",
    "batching.sequence_order",
    "model.pass_position_ids",
    # How 3-D positions reach the rope: a correct delivery changes nothing, so every variant is
    # judged against the reference run (which delivers them whole: see Run.is_reference_layout).
    "vision.positions",
    # A training mutant claims to change nothing, like a layout: it is judged against the
    # correct run (and a run with one is never a baseline: Run.is_reference_layout).
    "mutant.name",
    "mutant.onset",
)


def _identity(run: Run) -> tuple:
    return tuple(
        sorted(
            (k, json.dumps(v))
            for k, v in run.config.items()
            if k not in LAYOUT_KEYS and not k.startswith(IGNORED_PREFIXES)
        )
    )


def pick_baselines(runs: list[Run], baseline: Run | None = None) -> list[Run | None]:
    """For each run its baseline (None when there is none, or for the baseline itself)."""
    if baseline is not None:
        return [None if r.path.resolve() == baseline.path.resolve() else baseline for r in runs]
    references: dict[tuple, Run] = {}
    for run in runs:
        if run.is_reference_layout:
            references.setdefault(_identity(run), run)
    picked = []
    for run in runs:
        ref = references.get(_identity(run)) if run.config else None
        picked.append(None if ref is None or ref.path == run.path else ref)
    return picked


@dataclass
class MetricDiff:
    metric: str
    max_abs: float | None = None
    max_rel: float | None = None
    final_run: float | None = None
    final_baseline: float | None = None
    correlation: float | None = None
    note: str = ""
    worst_ratio: float | None = None
    """The largest relative difference in units of the step's tolerance (> 1 fails)."""
    worst_step: int | None = None
    """The step of `worst_ratio`."""


@dataclass
class Comparison:
    run: Run
    baseline: Run | None
    diffs: list[MetricDiff]
    steps_compared: int
    passed: bool | None
    """None when there is nothing to compare against (a baseline row)."""
    notes: list[str]
    floor: NoiseFloor | None = None
    """The baseline's noise floor the run was judged with; None: `rtol` on every step."""
    anchors: list | None = None
    """The anchored check's results (compare/anchors.py), one per anchor of the baseline; None
    where the curves were judged at rtol alone (no floor widened the tolerance)."""


def _correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy)


def compare(
    run: Run,
    baseline: Run | None,
    rtol: float,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    floor: NoiseFloor | None = None,
) -> Comparison:
    """The run against its baseline; each step's tolerance is `rtol`, or with a `floor` the
    larger of `rtol` and the floor's margin times the baseline's own drift by that step."""
    if baseline is None:
        return Comparison(run, None, [], 0, None, list(run.notes))
    notes, diffs, ok = list(run.notes), [], True
    run_steps = {int(m["step"]) for m in run.metrics}
    base_steps = {int(m["step"]) for m in baseline.metrics}
    if run_steps != base_steps:
        notes.append(
            f"logged {len(run_steps)} steps, baseline {len(base_steps)}: compared the "
            f"{len(run_steps & base_steps)} both have"
        )
        ok = False
    compared = 0
    for metric in metrics:
        for side, which in ((run, "run"), (baseline, "baseline")):
            bad = nonfinite_steps(side, metric)
            if bad:
                shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
                notes.append(f"{metric} is non-finite in the {which} at {len(bad)} steps ({shown})")
                ok = False
        a, b = series(run, metric), series(baseline, metric)
        if not a and not b:
            continue
        if not a or not b:
            side = "run" if not a else "baseline"
            diffs.append(MetricDiff(metric, note=f"missing in {side}"))
            notes.append(f"{metric} is missing in the {side}")
            ok = False
            continue
        steps = sorted(a.keys() & b.keys())
        if not steps:
            diffs.append(MetricDiff(metric, note="no common steps"))
            ok = False
            continue
        xs, ys = [a[s] for s in steps], [b[s] for s in steps]
        abs_d = [abs(x - y) for x, y in zip(xs, ys)]
        rel_d = [relative_difference(x, y) for x, y in zip(xs, ys)]
        finite = all(math.isfinite(v) for v in xs + ys)
        diff = MetricDiff(metric, max(abs_d), max(rel_d), xs[-1], ys[-1], _correlation(xs, ys))
        ratios = [
            r / (floor.threshold(metric, s, rtol) if floor else rtol) for s, r in zip(steps, rel_d)
        ]
        worst = max(range(len(steps)), key=ratios.__getitem__)
        diff.worst_ratio, diff.worst_step = ratios[worst], steps[worst]
        if not finite:
            diff.note = "non-finite values"
        diffs.append(diff)
        ok = ok and finite and diff.worst_ratio <= 1
        compared = max(compared, len(steps))
    return Comparison(run, baseline, diffs, compared, ok, notes, floor)


def compare_all(
    runs: list[Run],
    rtol: float,
    baseline: Run | None = None,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    floors: dict[Path, NoiseFloor] | None = None,
) -> list[Comparison]:
    """Every run against its baseline; `floors` maps a baseline's path to its noise floor."""
    floors = floors or {}
    return [
        compare(r, b, rtol, metrics, floors.get(b.path) if b is not None else None)
        for r, b in zip(runs, pick_baselines(runs, baseline))
    ]


def all_passed(comparisons: list[Comparison]) -> bool:
    """True when every run that has a baseline passed (and at least one had one)."""
    judged = [c for c in comparisons if c.passed is not None]
    return bool(judged) and all(c.passed for c in judged)
