"""The per-step metrics record (the metrics.jsonl contract) and the end-of-run summary.

`StepMetrics` is spelled once: its fields, in order, are the keys of a metrics.jsonl line, except
that the per-layer MTP losses are written as `mtp_loss` (their mean) and, with several layers,
`mtp_loss_1`, `mtp_loss_2`, ...; keys that do not apply (MTP off, no eval this step) are left
out rather than written as null. The summary's `gap_closed` is the share of the learnable gap
(unigram baseline minus the data's entropy floor) that the model closed on the eval set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FINAL_WINDOW = 10


@dataclass
class StepMetrics:
    """One optimizer step, as every rank computes it after the step's one all-reduce."""

    step: int
    lm_loss: float
    """Mean next-token loss over the step's predicted tokens (all ranks, all micro-batches)."""
    loss: float
    """What is optimised: lm_loss + mtp.loss_scaling_factor * (MTP term)."""
    mtp_layer_losses: tuple[float | None, ...]
    """Per MTP layer, its mean loss over the step (None: no sequence gave it a target); empty
    with mtp=off."""
    grad_norm: float
    lr: float
    tokens: int
    """Real tokens of the step."""
    padded_tokens: int
    """Tokens after alignment padding."""
    micro_batches: int
    """Micro-batches over all data-parallel ranks."""
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float | None = None
    """On GPU: tokens_per_s / world size."""
    mfu: float | None = None
    """Model FLOPs utilisation: the step's model FLOPs / time / (devices x peak), when the peak is
    known (a known GPU, or trainer.peak_tflops)."""
    eval_lm_loss: float | None = None
    """Set on eval steps (every trainer.eval_every steps and the last)."""
    spike: dict[str, float] = field(default_factory=dict)
    """The step guard's spike findings: each flagged value's ratio to its window's median."""
    skipped: bool = False
    """A spike the guard did not apply (trainer.loss_spike.action=skip_step or stop)."""

    @property
    def mtp_loss(self) -> float | None:
        known = [m for m in self.mtp_layer_losses if m is not None]
        return sum(known) / len(known) if known else None

    def to_record(self) -> dict:
        """The metrics.jsonl line."""
        record: dict = {"step": self.step, "lm_loss": self.lm_loss, "loss": self.loss}
        if self.mtp_layer_losses:
            # None when no sequence of the step was long enough to give MTP a target.
            record["mtp_loss"] = self.mtp_loss
            if len(self.mtp_layer_losses) > 1:
                record.update({f"mtp_loss_{k + 1}": m for k, m in enumerate(self.mtp_layer_losses)})
        record.update(
            grad_norm=self.grad_norm,
            lr=self.lr,
            tokens=self.tokens,
            padded_tokens=self.padded_tokens,
            micro_batches=self.micro_batches,
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
        )
        for key in ("tokens_per_s_per_device", "mfu"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
        if self.eval_lm_loss is not None:
            record["eval_lm_loss"] = self.eval_lm_loss
        if self.spike:
            record["spike"] = dict(self.spike)
            if self.skipped:
                record["skipped"] = True
        nonfinite = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        if nonfinite:
            # Strict JSON has no NaN: null, and the reason beside it.
            record.update({k: None for k in nonfinite})
            record["nonfinite"] = nonfinite
        return record


def mtp_layer_means(mtp_sums: list[float], mtp_counts: list[int]) -> tuple[float | None, ...]:
    """Per MTP layer, its global mean over the step (None: no sequence gave it a target)."""
    return tuple(s / n if n else None for s, n in zip(mtp_sums, mtp_counts))


def optimised_loss(lm_loss: float, mtp_sums: list[float], mtp_counts: list[int], scale: float):
    """`loss`: lm_loss + scale * mean over MTP layers of each layer's global mean (a layer with
    no target counts 0), which is what mtp.scaling=exact optimises; with one layer, or every
    layer with targets, exactly lm_loss + scale * mtp_loss. (With mtp.scaling=upstream it is
    the same reference value; megatron's own weighting is release-dependent.)"""
    if not mtp_counts:
        return lm_loss
    means = [m or 0.0 for m in mtp_layer_means(mtp_sums, mtp_counts)]
    return lm_loss + scale * sum(means) / len(means)


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
    """The end-of-run numbers from the metrics.jsonl records of the run."""
    last = [h for h in history[-FINAL_WINDOW:] if h.get("lm_loss") is not None]
    final_lm = sum(h["lm_loss"] for h in last) / len(last) if last else None
    evals = [h["eval_lm_loss"] for h in history if "eval_lm_loss" in h]
    final_eval = evals[-1] if evals else None
    gap_closed = None
    if None not in (final_eval, entropy_floor, baseline_loss) and baseline_loss > entropy_floor:
        gap_closed = (baseline_loss - final_eval) / (baseline_loss - entropy_floor)
    skipped = [h["step"] for h in history if h.get("nonfinite")]
    spikes = [h["step"] for h in history if h.get("spike")]
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
    if skipped:
        summary["nonfinite_steps"] = skipped
    summary["spikes"] = len(spikes)
    if spikes:
        summary["spike_steps"] = spikes
    return {k: _finite_or_none(v) for k, v in summary.items()}
