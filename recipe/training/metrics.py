"""The end-of-run summary: final losses, the data's loss floors and how much of the gap closed."""

from __future__ import annotations

import math

FINAL_WINDOW = 10


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def summarize(
    history: list[dict],
    *,
    entropy_floor: float | None,
    baseline_loss: float | None,
    wall_time_s: float,
) -> dict:
    """The end-of-run numbers; `gap_closed` is the share of the learnable gap the model closed."""
    last = history[-FINAL_WINDOW:]
    final_lm = sum(h["lm_loss"] for h in last) / len(last) if last else None
    evals = [h["eval_lm_loss"] for h in history if "eval_lm_loss" in h]
    final_eval = evals[-1] if evals else None
    gap_closed = None
    if None not in (final_eval, entropy_floor, baseline_loss) and baseline_loss > entropy_floor:
        gap_closed = (baseline_loss - final_eval) / (baseline_loss - entropy_floor)
    summary = {
        "final_lm_loss": final_lm,
        "final_eval_lm_loss": final_eval,
        "entropy_floor": entropy_floor,
        "baseline_loss": baseline_loss,
        "gap_closed": gap_closed,
        "steps": len(history),
        "wall_time_s": wall_time_s,
    }
    mtp = [h["mtp_loss"] for h in last if h.get("mtp_loss") is not None]
    if mtp:
        summary["final_mtp_loss"] = sum(mtp) / len(mtp)
    return {k: _finite_or_none(v) for k, v in summary.items()}
