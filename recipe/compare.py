"""Compare training runs step by step: the verdict behind parity reports and compare_runs.py.

Each run is compared with a baseline: by default the run with cp=1 (and dp=1) whose config is
otherwise the same (keys that only change the parallel layout or logging are ignored), or one
baseline given explicitly. Per metric we report the largest absolute and relative difference over
the steps both runs logged, the final values and the correlation of the two curves; a run passes
when every metric shared with its baseline stays within `rtol`, it logged the same steps, and no
metric is missing on one side. Unequal lengths and missing metrics are reported, never fatal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from recipe.metrics import METRICS_FILE

DEFAULT_METRICS = ("lm_loss", "mtp_loss", "grad_norm")
# Keys that may differ between a run and its baseline: how the work is split, not what is computed.
LAYOUT_KEYS = (
    "cp.size",
    "cp.preprocess",
    "parallel.dp",
    "parallel.tp",
    "model.attention_backend",
    "batching.max_tokens_per_rank",
    "model.pass_position_ids",
)
IGNORED_PREFIXES = (
    "output_dir",
    "logger.",
    "trainer.progress_bar",
    "trainer.log_every",
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
    """What loading had to work around (a truncated last line)."""

    @property
    def cp(self) -> int | None:
        value = self.config.get("cp.size")
        return int(value) if value is not None else None

    @property
    def is_reference_layout(self) -> bool:
        return self.cp == 1 and int(self.config.get("parallel.dp", 1)) == 1


def _flatten(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(node, list):
        return {prefix[:-1]: json.dumps(node)}
    return {prefix[:-1]: node}


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics_file = path / METRICS_FILE
    if not metrics_file.exists():
        raise FileNotFoundError(f"{path} has no {METRICS_FILE}: not a run directory")
    metrics, notes = [], []
    lines = [line for line in metrics_file.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines, start=1):
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # a run killed while writing its last line
                notes.append(f"ignored a truncated last line ({number}) of {METRICS_FILE}")
                continue
            raise ValueError(f"{metrics_file}:{number} is not JSON: {err}") from err
    config = {}
    config_file = path / ".hydra" / "config.yaml"
    if config_file.exists():
        from omegaconf import OmegaConf

        config = _flatten(OmegaConf.to_container(OmegaConf.load(config_file), resolve=False))
    return Run(path=path, metrics=metrics, config=config, notes=notes)


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Run directories from the given paths; a directory without metrics (a sweep) is searched."""
    runs = []
    for p in map(Path, paths):
        if (p / METRICS_FILE).exists():
            runs.append(load_run(p))
            continue
        found = sorted({m.parent for m in p.rglob(METRICS_FILE)}, key=_natural_key)
        if not found:
            raise FileNotFoundError(f"{p} holds no {METRICS_FILE}: nothing to compare")
        runs.extend(load_run(f) for f in found)
    return runs


def _natural_key(path: Path):
    return [int(part) if part.isdigit() else part for part in path.parts]


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


@dataclass
class Comparison:
    run: Run
    baseline: Run | None
    diffs: list[MetricDiff]
    steps_compared: int
    passed: bool | None
    """None when there is nothing to compare against (a baseline row)."""
    notes: list[str]


def _series(run: Run, metric: str) -> dict[int, float]:
    return {
        int(m["step"]): float(m[metric])
        for m in run.metrics
        if metric in m and m[metric] is not None
    }


def _correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy)


def relative_difference(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def compare(
    run: Run, baseline: Run | None, rtol: float, metrics: tuple[str, ...] = DEFAULT_METRICS
) -> Comparison:
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
        a, b = _series(run, metric), _series(baseline, metric)
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
        if not finite:
            diff.note = "non-finite values"
        diffs.append(diff)
        ok = ok and finite and diff.max_rel <= rtol
        compared = max(compared, len(steps))
    return Comparison(run, baseline, diffs, compared, ok, notes)


def compare_all(
    runs: list[Run],
    rtol: float,
    baseline: Run | None = None,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
) -> list[Comparison]:
    return [compare(r, b, rtol, metrics) for r, b in zip(runs, pick_baselines(runs, baseline))]


def run_labels(runs: list[Run]) -> dict[Path, str]:
    """Short names: the directory name plus the config values that differ between the runs."""
    keys = sorted({k for r in runs for k in r.config if not k.startswith(IGNORED_PREFIXES)})
    varying = [k for k in keys if len({json.dumps(r.config.get(k)) for r in runs}) > 1]
    labels = {}
    for run in runs:
        settings = " ".join(f"{k.removesuffix('.size')}={run.config.get(k)}" for k in varying)
        labels[run.path] = f"{run.path.name}: {settings}" if settings else run.path.name
    return labels


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
        f"{', '.join(metrics)}. Baseline: the cp=1 run with otherwise the same settings "
        "unless one was given.\n",
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


def plot_comparisons(
    comparisons: list[Comparison], path: str | Path, title: str = "loss curves"
) -> None:
    """Top: lm_loss (solid) and mtp_loss (dashed) of every run. Bottom: per-step |difference| of
    lm_loss to the run's baseline on a log scale, failing runs drawn thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = run_labels([c.run for c in comparisons])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    floor = 1e-12
    for i, c in enumerate(comparisons):
        color = f"C{i % 10}"
        lm = _series(c.run, "lm_loss")
        top.plot(list(lm), list(lm.values()), color=color, label=labels[c.run.path])
        mtp = _series(c.run, "mtp_loss")
        if mtp:
            top.plot(list(mtp), list(mtp.values()), color=color, linestyle="--", alpha=0.7)
        if c.baseline is not None:
            base = _series(c.baseline, "lm_loss")
            steps = sorted(lm.keys() & base.keys())
            diff = [max(abs(lm[s] - base[s]), floor) for s in steps]
            bottom.plot(
                steps,
                diff,
                color=color,
                linewidth=3 if not c.passed else 1.2,
                label=f"{labels[c.run.path]} ({'PASS' if c.passed else 'FAIL'})",
            )
    top.set_ylabel("lm_loss (solid), mtp_loss (dashed)")
    top.set_title(title)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.set_yscale("log")
    bottom.set_ylabel(f"|lm_loss - baseline| (floor {floor:g})")
    bottom.set_xlabel("step")
    if bottom.lines:
        bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def all_passed(comparisons: list[Comparison]) -> bool:
    """True when every run that has a baseline passed (and at least one had one)."""
    judged = [c for c in comparisons if c.passed is not None]
    return bool(judged) and all(c.passed for c in judged)
