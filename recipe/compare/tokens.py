"""Per-token parity: two runs' recorded token losses, joined token by token, and where they differ.

Every recorded loss is compared: the next-token loss and, with mtp=on, each MTP depth's. A loss
curve averages thousands of tokens: the pre-fix preprocessing moves a step's loss by 3e-4
relative while the tokens it breaks are off by nats. Records (`trainer.record_tokens`) carry each
predicted token's global identity (step, sample, position), so runs at any layouts line up; the
comparison reports the distribution of |difference|, how many tokens exceed the tolerance, and
where those lie in the run's layout: which cp ranks and zigzag chunks (front / back), which
samples and position ranges.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recipe.names import FP32_TOKEN_ATOL
from recipe.rundir.tokens import loss_columns, read_token_records

TOKEN_ATOL = FP32_TOKEN_ATOL
"""Largest absolute per-token loss difference that passes (fp32 on CPU)."""


@dataclass
class TokenDiff:
    step: int
    tokens: int
    max_abs: float
    p50: float
    p99: float
    p999: float
    flagged: int
    by_rank_chunk: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    """(cp rank, chunk) -> (flagged, tokens there), in the run's layout."""
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(sample, flagged tokens, first flagged position, last flagged position), most first."""
    cp_size: int = 1
    by_loss: dict[str, float] = field(default_factory=dict)
    """Largest |difference| of each recorded loss (lm_loss, mtp_loss_1, ...)."""


@dataclass
class TokenComparison:
    run: Path
    baseline: Path
    atol: float
    steps: list[TokenDiff]
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems and bool(self.steps) and all(s.flagged == 0 for s in self.steps)


def compare_token_records(
    run: str | Path, baseline: str | Path, atol: float, cp_size: int = 1
) -> TokenComparison:
    """Join the two runs' records on (step, sample, position); `cp_size` is the run's, to name
    chunks front or back."""
    return compare_records(
        read_token_records(run), read_token_records(baseline), atol, cp_size, run, baseline
    )


def compare_records(
    mine: dict, theirs: dict, atol: float, cp_size: int, run, baseline
) -> TokenComparison:
    """`compare_token_records` on records already read (a golden file's, for one)."""
    problems = []
    for side, records in (("run", mine), ("baseline", theirs)):
        if not records:
            problems.append(
                f"the {side} {run if side == 'run' else baseline} has no per-token "
                "records (trainer.record_tokens)"
            )
    steps = sorted(set(mine) & set(theirs))
    if mine and theirs and not steps:
        problems.append(
            f"no recorded step in common: run {sorted(mine)}, baseline {sorted(theirs)}"
        )
    diffs = []
    for step in steps:
        a, b = mine[step], theirs[step]
        if not (
            np.array_equal(a["sample"], b["sample"])
            and np.array_equal(a["position"], b["position"])
        ):
            problems.append(f"step {step}: {_token_set_difference(a, b)}")
            continue
        diffs.append(_diff(step, a, b, atol, cp_size))
    return TokenComparison(Path(run), Path(baseline), atol, diffs, problems)


def _token_set_difference(mine: dict, theirs: dict) -> str:
    """Which (sample, position) targets only one side predicted: equal counts alone would read
    as the same tokens (a loss mask placed on other tokens keeps the count)."""
    run = set(zip(mine["sample"].tolist(), mine["position"].tolist(), strict=True))
    baseline = set(zip(theirs["sample"].tolist(), theirs["position"].tolist(), strict=True))
    sides = []
    for name, only in (("the run", run - baseline), ("the baseline", baseline - run)):
        if only:
            sample, position = min(only)
            sides.append(
                f"{len(only)} only in {name} (the first sample {sample} position {position})"
            )
    return (
        f"the runs predicted different tokens ({len(run)} vs {len(baseline)}: "
        f"{'; '.join(sides)}); their data, batching or loss mask differ"
    )


def _loss_delta(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """|x - y| per token; NaN on both sides (no target at this MTP depth) is no difference,
    NaN on one side is an infinite one."""
    delta = np.abs(x - y)
    both = np.isnan(x) & np.isnan(y)
    return np.where(both, 0.0, np.where(np.isnan(delta), np.inf, delta))


def _diff(step: int, a: dict, b: dict, atol: float, cp_size: int) -> TokenDiff:
    names = [n for n in loss_columns(a) if n in b]
    per_loss = {n: _loss_delta(a[n], b[n]) for n in names}
    delta = np.max(np.stack(list(per_loss.values())), axis=0)
    flagged = ~(delta <= atol)
    finite = np.nan_to_num(delta, posinf=np.finfo(np.float64).max)  # quantiles of a missing loss
    p50, p99, p999 = (float(np.quantile(finite, q)) for q in (0.5, 0.99, 0.999))
    place = Counter(zip(a["cp_rank"].tolist(), a["chunk"].tolist()))
    bad_place = Counter(zip(a["cp_rank"][flagged].tolist(), a["chunk"][flagged].tolist()))
    samples = []
    for sample in np.unique(a["sample"][flagged]):
        positions = a["position"][flagged & (a["sample"] == sample)]
        samples.append(
            (int(sample), int(positions.size), int(positions.min()), int(positions.max()))
        )
    samples.sort(key=lambda s: (-s[1], s[0]))
    return TokenDiff(
        step=step,
        tokens=int(delta.size),
        max_abs=float(np.nanmax(delta)) if delta.size else 0.0,
        p50=p50,
        p99=p99,
        p999=p999,
        flagged=int(flagged.sum()),
        by_rank_chunk={k: (bad_place.get(k, 0), n) for k, n in sorted(place.items())},
        samples=samples,
        cp_size=cp_size,
        by_loss={n: float(d.max()) if d.size else 0.0 for n, d in per_loss.items()},
    )


def where(diff: TokenDiff) -> str:
    """One phrase for where the flagged tokens are: "back chunks only (rank 0 chunk 3, ...)"."""
    if not diff.flagged:
        return "nowhere"
    hit = [(r, c) for (r, c), (bad, _) in diff.by_rank_chunk.items() if bad]
    if diff.cp_size == 1:
        return "the whole stream (cp=1: no chunks)"
    halves = {"back" if c >= diff.cp_size else "front" for _, c in hit}
    kind = f"{halves.pop()} chunks only" if len(halves) == 1 else "front and back chunks"
    parts = ", ".join(f"rank {r} chunk {c}" for r, c in hit)
    return f"{kind} ({parts})"


def render_token_report(comparison: TokenComparison) -> str:
    lines = [
        f"### Per-token: {comparison.run} vs {comparison.baseline} (atol {comparison.atol:g})",
        "",
    ]
    lines += [f"- {p}" for p in comparison.problems]
    if comparison.steps:
        lines += [
            "| step | tokens | max abs | p50 | p99 | p99.9 | beyond atol | where "
            "| max abs by loss |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for d in comparison.steps:
            by_loss = ", ".join(f"{n} {v:.3g}" for n, v in d.by_loss.items())
            lines.append(
                f"| {d.step} | {d.tokens} | {d.max_abs:.3g} | {d.p50:.3g} | {d.p99:.3g} | "
                f"{d.p999:.3g} | {d.flagged} | {where(d)} | {by_loss} |"
            )
        first = next((d for d in comparison.steps if d.flagged), None)
        if first is not None:
            lines += ["", f"Step {first.step}, by cp rank and chunk (flagged / tokens):", ""]
            lines += ["| cp rank | chunk | half | flagged | tokens |", "|---|---|---|---|---|"]
            for (rank, chunk), (bad, n) in first.by_rank_chunk.items():
                half = (
                    "-" if first.cp_size == 1 else ("back" if chunk >= first.cp_size else "front")
                )
                lines.append(f"| {rank} | {chunk} | {half} | {bad} | {n} |")
            lines += ["", f"Samples with flagged tokens ({len(first.samples)}; most first):", ""]
            lines += [
                f"- sample {s}: {n} tokens, positions {lo}..{hi}"
                for s, n, lo, hi in first.samples[:8]
            ]
    verdict = "PASS" if comparison.passed else "FAIL"
    lines += ["", f"**{verdict}**"]
    return "\n".join(lines)
