"""The parity report: a markdown table of every run against its baseline, and its files.

`render_markdown` is what compare prints and sweeps write as `parity_report.md`; jobs that crashed
before logging are listed as FAIL rows, so a report never hides a missing run.
"""

from __future__ import annotations

from pathlib import Path

from recipe.compare.diff import DEFAULT_METRICS, Comparison, all_passed
from recipe.compare.judge import judge
from recipe.compare.plot import plot_comparisons
from recipe.compare.runs import Run, run_labels
from recipe.compare.tokens import TOKEN_ATOL, compare_token_records, render_token_report
from recipe.names import NOISE_MARGIN
from recipe.rundir.tokens import has_token_records


def _fmt(value: float | None, spec: str = ".3e") -> str:
    return "n/a" if value is None else format(value, spec)


def _margin(diff) -> str:
    """The largest relative difference in units of its step's tolerance: 0.02x passes, 33x
    fails (at step N: where it was worst)."""
    if diff is None or diff.worst_ratio is None:
        return "n/a"
    return f"{diff.worst_ratio:.3g}x (step {diff.worst_step})"


def _floors(comparisons: list[Comparison], metrics: list[str], rtol: float) -> list[str]:
    """One line per baseline: the tolerance its runs were judged with."""
    lines, seen = [], set()
    for c in comparisons:
        if c.baseline is None or c.baseline.path in seen:
            continue
        seen.add(c.baseline.path)
        if c.floor is None:
            how = f"rtol {rtol:g} on every step (no noise twin)"
        else:
            how = f"max(rtol {rtol:g}, margin x drift) from its {c.floor.describe(metrics)}"
        lines.append(f"- baseline {c.baseline.path.name}: {how}")
    return lines


def render_markdown(
    comparisons: list[Comparison],
    rtol: float,
    failures: list[tuple[str, str]] = (),
    tokens: dict | None = None,
) -> str:
    """The parity table; `failures` are (job, error) of jobs that crashed, listed as FAIL;
    `tokens` maps a run's path to its per-token miss ("4.1e+04x atol on per-token")."""
    tokens = tokens or {}
    crashed = {job for job, _ in failures}
    runs = [c.run for c in comparisons]
    labels = run_labels(runs)
    metrics = [
        m for m in DEFAULT_METRICS if any(d.metric == m for c in comparisons for d in c.diffs)
    ] or ["lm_loss"]
    header = ["run", "baseline", "steps"]
    for m in metrics:
        header += [f"{m} max abs", f"{m} max rel", f"{m} final (run / base)"]
    header += ["worst / tolerance", "lm_loss corr", "verdict"]
    lines = [
        "# Parity report\n",
        f"Tolerance: relative difference on every step for {', '.join(metrics)}, at most "
        f"{rtol:g} or, where the baseline has a noise twin, its margin times the baseline's own "
        "fp32 drift by that step if larger. Baseline: the cp=1 (dp=1, tp=1) run with otherwise "
        "the same settings unless one was given.\n",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for c in comparisons:
        if c.baseline is None:
            verdict = (
                "baseline"
                if any(
                    o.baseline is not None and o.baseline.path.resolve() == c.run.path.resolve()
                    for o in comparisons
                )
                else "no baseline"
            )
            if c.run.path.name in crashed:
                verdict += " (job failed)"
            row = [labels[c.run.path], "-", str(len(c.run.metrics))]
            row += ["-"] * (3 * len(metrics)) + ["-", "-", verdict]
        else:
            by_metric = {d.metric: d for d in c.diffs}
            row = [labels[c.run.path], c.baseline.path.name, str(c.steps_compared)]
            for m in metrics:
                d = by_metric.get(m)
                if d is None or d.max_abs is None:
                    note = d.note if d is not None else "n/a"
                    row += [note, note, note]
                else:
                    row += [
                        _fmt(d.max_abs),
                        _fmt(d.max_rel),
                        f"{_fmt(d.final_run, '.5f')} / {_fmt(d.final_baseline, '.5f')}",
                    ]
            lm = by_metric.get("lm_loss")
            row += [
                _margin(_worst(c)),
                _fmt(lm.correlation if lm else None, ".6f"),
                "**FAIL** (job failed)"
                if c.run.path.name in crashed
                else ("**PASS**" if c.passed else "**FAIL**"),
            ]
        lines.append("| " + " | ".join(row) + " |")
    logged = {c.run.path.name for c in comparisons}
    for job, _ in failures:
        if job in logged:  # it logged some steps: its row above already shows the shortfall
            continue
        cells = [job, "-", "-"] + ["-"] * (3 * len(metrics)) + ["-", "-", "**FAIL** (job failed)"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {labels[c.run.path]}: {n}" for c in comparisons for n in c.notes]
    notes += [f"- {labels[c.run.path]}: {note}" for c in comparisons if (note := _spikes(c.run))]
    missed = [
        f"- {labels[c.run.path]}: {d.metric} {_margin(d)} the tolerance"
        + (f"; {tokens[c.run.path]}" if c.run.path in tokens else "")
        for c in comparisons
        if c.passed is False and (d := _worst(c)) is not None
    ]
    if missed:
        lines += [
            "",
            "How far the failing runs (negative controls among them) missed the tolerance:",
            *missed,
        ]
    notes += [f"- job {job} failed: {error}" for job, error in failures]
    anchored = _anchor_rows(comparisons, labels)
    if anchored:
        lines += [
            "",
            "Anchored check: the run's settings and its baseline from the SAME state (the "
            "baseline's anchor), the same steps, each step at rtol and each token of the "
            "first step at the per-token atol; `worst / tolerance` > 1 fails:",
            "",
            "| run | anchor | steps | worst metric | max rel | per-token max abs (first step) | "
            "worst / tolerance | verdict |",
            "|---|---|---|---|---|---|---|---|",
            *anchored,
        ]
    floors = _floors(comparisons, metrics, rtol)
    if floors:
        lines += ["", "Tolerance per baseline:", *floors]
    if notes:
        lines += ["", "Notes:", *notes]
    compared = [c for c in comparisons if c.passed is not None]
    failed = {c.run.path.name for c in compared if not c.passed} | crashed
    passed = len([c for c in compared if c.passed and c.run.path.name not in crashed])
    lines += ["", f"{passed} passed, {len(failed)} failed"]
    return "\n".join(lines) + "\n"


def _anchor_rows(comparisons: list[Comparison], labels) -> list[str]:
    rows = []
    for c in comparisons:
        for a in c.anchors or []:
            tokens = "n/a" if a.token_max_abs is None else f"{a.token_max_abs:.3g}"
            verdict = "PASS" if a.passed else "**FAIL**" + (f" ({a.note})" if a.note else "")
            rows.append(
                f"| {labels[c.run.path]} | {a.step} | {a.steps[0]}-{a.steps[-1]} | "
                f"{a.worst_metric or 'n/a'} | {a.worst_rel:.3g} | {tokens} | {a.ratio:.3g}x | "
                f"{verdict} |"
            )
    return rows


def _worst(c: Comparison):
    """The metric that came closest to (or went furthest past) its tolerance."""
    judged = [d for d in c.diffs if d.worst_ratio is not None]
    return max(judged, key=lambda d: d.worst_ratio) if judged else None


def _spikes(run) -> str:
    """A note on the steps the step guard flagged as spikes (empty when there are none)."""
    flagged = [r for r in run.metrics if r.get("spike")]
    if not flagged:
        return ""
    skipped = [r["step"] for r in flagged if r.get("skipped")]
    steps = ", ".join(str(r["step"]) for r in flagged)
    tail = f", not applied: {', '.join(map(str, skipped))}" if skipped else ""
    return f"{len(flagged)} spike step(s) flagged by the step guard (steps {steps}{tail})"


def _first_failure(c: Comparison, crashed: dict) -> tuple[str, str]:
    """Where a mutant run was caught, and by how much: the job's error, the first failing
    anchor, or the curves' worst step."""
    if c.run.path.name in crashed:
        return "job failed", crashed[c.run.path.name][:120]
    failed = next((a for a in c.anchors or [] if not a.passed), None)
    worst = _worst(c)
    if worst is not None and worst.worst_ratio is not None and worst.worst_ratio > 1:
        return (
            f"curves, worst at step {worst.worst_step} ({worst.metric})",
            f"{worst.worst_ratio:.3g}x",
        )
    if failed is not None:
        return f"anchor {failed.step} ({failed.worst_metric})", f"{failed.ratio:.3g}x"
    if c.passed is False:
        return "notes", "; ".join(c.notes)[:120]
    margin = f"{worst.worst_ratio:.3g}x" if worst and worst.worst_ratio is not None else "n/a"
    return "-", margin


def render_mutation_score(
    comparisons: list[Comparison], failures: list[tuple[str, str]] = ()
) -> tuple[str, bool]:
    """The training mutation score of a sweep with `mutant.name` runs: one row per mutant run
    (caught when its verdict FAILs), the correct runs beside them (which must PASS); the last
    line is `training mutation score: N/M caught`. Returns (text, every mutant caught and every
    correct run passed)."""
    crashed = dict(failures)
    rows, caught, total, correct_ok = [], 0, 0, True
    for c in comparisons:
        if c.baseline is None:
            continue
        name = str(c.run.config.get("mutant.name", "none"))
        onset = c.run.config.get("mutant.onset", 1)
        cp = c.run.config.get("cp.size")
        where, margin = _first_failure(c, crashed)
        failed = c.passed is False or c.run.path.name in crashed
        if name == "none":
            correct_ok = correct_ok and not failed
            verdict = "**FAIL** (a correct run)" if failed else "PASS (correct run)"
        else:
            total += 1
            caught += failed
            verdict = "caught" if failed else "**MISSED**"
        rows.append(
            f"| {c.run.path.name} | {name} | {cp} | {onset} | {where} | {margin} | {verdict} |"
        )
    lines = [
        "# Training mutation score",
        "",
        "Each mutant run against its correct baseline: caught when the verdict (curves, anchors, "
        "per-token) FAILs it; the correct runs must PASS.",
        "",
        "| job | mutant | cp | onset | caught by | margin | verdict |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"training mutation score: {caught}/{total} caught",
    ]
    return "\n".join(lines) + "\n", caught == total and correct_ok


MUTATION_FILE = "mutation_report.md"
REPORT_FILE = "parity_report.md"
PLOT_FILE = "loss_curves.png"


def is_mutant_sweep(runs) -> bool:
    """Whether any run trained a training mutant (then the sweep is scored, not just judged)."""
    return any(r.config.get("mutant.name", "none") != "none" for r in runs)


def write_report(
    runs: list[Run],
    out_dir: str | Path,
    rtol: float,
    baseline: Run | None = None,
    failures: list[tuple[str, str]] = (),
    noise_floor: str = "auto",
    margin: float = NOISE_MARGIN,
) -> tuple[str, bool]:
    """Write the markdown report and the plot for `runs` (and jobs that failed), judged under
    `noise_floor` (recipe/compare/judge.py); returns (report, all passed)."""
    out_dir = Path(out_dir)
    comparisons = judge(runs, rtol, baseline, noise_floor, margin)
    token_sections, token_misses, tokens_passed = [], {}, True
    for c in comparisons:
        if c.baseline is None or not (
            has_token_records(c.run.path) and has_token_records(c.baseline.path)
        ):
            continue
        result = compare_token_records(c.run.path, c.baseline.path, TOKEN_ATOL, c.run.cp or 1)
        token_sections.append(render_token_report(result))
        tokens_passed = tokens_passed and result.passed
        worst = max((d.max_abs for d in result.steps), default=0.0)
        if not result.passed:
            token_misses[c.run.path] = f"{worst / TOKEN_ATOL:.3g}x atol on per-token"
    report = render_markdown(comparisons, rtol, failures, token_misses)
    if token_sections:
        report += "\n## Per-token parity\n\n" + "\n\n".join(token_sections) + "\n"
    (out_dir / REPORT_FILE).write_text(report)
    plot_comparisons(comparisons, out_dir / PLOT_FILE, title=str(out_dir))
    if is_mutant_sweep(runs):
        # a mutant sweep passes when every mutant FAILs and every correct run PASSES
        score, scored = render_mutation_score(comparisons, failures)
        (out_dir / MUTATION_FILE).write_text(score)
        return report + "\n" + score, scored
    return report, all_passed(comparisons) and not failures and tokens_passed
