"""The parity report: a markdown table of every run against its baseline, and its files.

`render_markdown` is what compare prints and sweeps write as `parity_report.md`; jobs that crashed
before logging are listed as FAIL rows, so a report never hides a missing run.
"""

from __future__ import annotations

from pathlib import Path

from recipe.compare.diff import DEFAULT_METRICS, Comparison, all_passed, compare_all
from recipe.compare.plot import plot_comparisons
from recipe.compare.runs import Run, run_labels


def _fmt(value: float | None, spec: str = ".3e") -> str:
    return "n/a" if value is None else format(value, spec)


def render_markdown(
    comparisons: list[Comparison], rtol: float, failures: list[tuple[str, str]] = ()
) -> str:
    """The parity table; `failures` are (job, error) of jobs that crashed, listed as FAIL."""
    runs = [c.run for c in comparisons]
    labels = run_labels(runs)
    metrics = [
        m for m in DEFAULT_METRICS if any(d.metric == m for c in comparisons for d in c.diffs)
    ] or ["lm_loss"]
    header = ["run", "baseline", "steps"]
    for m in metrics:
        header += [f"{m} max abs", f"{m} max rel", f"{m} final (run / base)"]
    header += ["lm_loss corr", "verdict"]
    lines = [
        "# Parity report\n",
        f"Tolerance: relative difference <= {rtol:g} on every step for "
        f"{', '.join(metrics)}. Baseline: the cp=1 (dp=1, tp=1) run with otherwise the same "
        "settings unless one was given.\n",
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
            row = [labels[c.run.path], "-", str(len(c.run.metrics))]
            row += ["-"] * (3 * len(metrics)) + ["-", verdict]
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
                _fmt(lm.correlation if lm else None, ".6f"),
                "**PASS**" if c.passed else "**FAIL**",
            ]
        lines.append("| " + " | ".join(row) + " |")
    logged = {c.run.path.name for c in comparisons}
    for job, _ in failures:
        if job in logged:  # it logged some steps: its row above already shows the shortfall
            continue
        cells = [job, "-", "-"] + ["-"] * (3 * len(metrics)) + ["-", "**FAIL** (job failed)"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {labels[c.run.path]}: {n}" for c in comparisons for n in c.notes]
    notes += [f"- job {job} failed: {error}" for job, error in failures]
    if notes:
        lines += ["", "Notes:", *notes]
    compared = [c for c in comparisons if c.passed is not None]
    failed = {c.run.path.name for c in compared if not c.passed} | {job for job, _ in failures}
    passed = len([c for c in compared if c.passed])
    lines += ["", f"{passed} passed, {len(failed)} failed"]
    return "\n".join(lines) + "\n"


REPORT_FILE = "parity_report.md"
PLOT_FILE = "loss_curves.png"


def write_report(
    runs: list[Run],
    out_dir: str | Path,
    rtol: float,
    baseline: Run | None = None,
    failures: list[tuple[str, str]] = (),
) -> tuple[str, bool]:
    """Write the markdown report and the plot for `runs` (and jobs that failed); returns
    (report, all passed)."""
    out_dir = Path(out_dir)
    comparisons = compare_all(runs, rtol, baseline)
    report = render_markdown(comparisons, rtol, failures)
    (out_dir / REPORT_FILE).write_text(report)
    plot_comparisons(comparisons, out_dir / PLOT_FILE, title=str(out_dir))
    return report, all_passed(comparisons) and not failures
