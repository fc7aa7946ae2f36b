"""The step guard: one judgement per step on values every rank already agrees on.

After the loss all-reduce and the gradient norm, and before the optimizer step, a step is judged
on its lm_loss and grad_norm (the same numbers on every rank, so every rank takes the same
decision without another collective). Non-finite values are never applied to the weights
(`trainer.on_nonfinite`: stop | skip_step). A spike is a value above `factor` times the median
of the same value over the previous `window` steps that were applied and not flagged
(`trainer.loss_spike.action`: warn | skip_step | stop). The window is rebuilt from the run's
history on resume, so a resumed run judges its next step as the uninterrupted run would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

JUDGED = ("lm_loss", "grad_norm")
"""The values judged for spikes (every value handed to the guard is checked for NaN/inf)."""


@dataclass
class Verdict:
    """What the guard decided about one step."""

    nonfinite: list[str] = field(default_factory=list)
    """The values that are NaN/inf."""
    spike: dict[str, float] = field(default_factory=dict)
    """Each flagged value's ratio to the median of its window."""
    take_step: bool = True
    """Whether the optimizer applies this step's update."""
    stop: str | None = None
    """Why the run stops after this step is logged (None: it goes on)."""


class StepGuard:
    def __init__(self, on_nonfinite: str, factor: float, window: int, action: str):
        self.on_nonfinite = on_nonfinite
        self.factor = factor
        self.action = action
        self.recent = {key: deque(maxlen=window) for key in JUDGED}

    @classmethod
    def from_config(cls, trainer_cfg) -> StepGuard:
        spike = trainer_cfg.loss_spike
        return cls(trainer_cfg.on_nonfinite, spike.factor, spike.window, spike.action)

    def judge(self, step: int, values: dict[str, float]) -> Verdict:
        verdict = Verdict(nonfinite=[k for k, v in values.items() if not math.isfinite(v)])
        if verdict.nonfinite:
            verdict.take_step = False
            if self.on_nonfinite == "stop":
                found = ", ".join(f"{k}=nan/inf" for k in verdict.nonfinite)
                verdict.stop = (
                    f"step {step}: {found}; the weights stay at step {step - 1} "
                    "(trainer.on_nonfinite=stop). Lower optim.lr or raise optim.warmup_steps, or "
                    "set trainer.on_nonfinite=skip_step to skip such steps"
                )
            return verdict
        if self.factor > 0:
            for key in JUDGED:
                window = self.recent[key]
                if len(window) == window.maxlen:
                    median = statistics.median(window)
                    if median > 0 and values[key] > self.factor * median:
                        verdict.spike[key] = values[key] / median
        if verdict.spike:
            verdict.take_step = self.action == "warn"
            if self.action == "stop":
                found = self.describe(verdict.spike, values)
                verdict.stop = (
                    f"step {step}: {found}; the weights stay at step "
                    f"{step - 1} (trainer.loss_spike.action=stop). Lower optim.lr or raise "
                    "optim.warmup_steps; trainer.loss_spike.action=skip_step skips such steps, "
                    "warn only reports them"
                )
        else:
            self.remember(values)
        return verdict

    def describe(self, spike: dict[str, float], values) -> str:
        """Spike findings in words; `values` is the judged values or the step's metrics record."""
        window = self.recent[JUDGED[0]].maxlen
        found = ", ".join(
            f"{key}={values[key]:.4g} is {ratio:.1f} x the median of the previous {window} steps"
            for key, ratio in spike.items()
        )
        return f"{found} (trainer.loss_spike.factor={self.factor:g})"

    def remember(self, values: dict[str, float]) -> None:
        for key in JUDGED:
            self.recent[key].append(values[key])

    def rebuild(self, history: list[dict]) -> None:
        """The window as the uninterrupted run had it after the last step of `history`."""
        for window in self.recent.values():
            window.clear()
        for record in history:
            # As judge() did: a step is remembered unless a judged value was non-finite or it
            # was flagged (an eval loss alone being non-finite does not exclude it).
            judged_nonfinite = set(record.get("nonfinite", ())) & {*JUDGED, "loss"}
            if not judged_nonfinite and not record.get("spike"):
                self.remember({key: record[key] for key in JUDGED})
