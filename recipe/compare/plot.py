"""loss_curves.png: the curves of every run above, each run's distance to its baseline below."""

from __future__ import annotations

from pathlib import Path

from recipe.compare.diff import Comparison
from recipe.compare.runs import run_labels, series


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
        lm = series(c.run, "lm_loss")
        top.plot(list(lm), list(lm.values()), color=color, label=labels[c.run.path])
        mtp = series(c.run, "mtp_loss")
        if mtp:
            top.plot(list(mtp), list(mtp.values()), color=color, linestyle="--", alpha=0.7)
        if c.baseline is not None:
            base = series(c.baseline, "lm_loss")
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
