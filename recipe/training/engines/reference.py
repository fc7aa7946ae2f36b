"""trainer.engine=reference: the recipe's own loop, the independent reference megatron's engine is
checked against.

torch AdamW on the bare model; each micro-batch through `run_micro_batch` (its loss divided by
the step's GLOBAL count of predicted tokens before backward); the gradients summed over dp x cp
(and sequence-parallel norms over tp) by the recipe's own all-reduce, clipped by its own norm.
Nothing of megatron's DDP, optimizer or schedules: where the two engines agree, neither hides an
error the other would show. No pipeline parallelism (the schema refuses parallel.pp > 1 here).
"""

from __future__ import annotations

import torch

from recipe.checkpoint.optimizer_state import load_torch_optimizer_state, torch_optimizer_state
from recipe.parallel import collectives, groups
from recipe.training.micro_batch import run_micro_batch
from recipe.training.optimizer import build_optimizer, grad_norm, lr_at, set_lr


class ReferenceEngine:
    """torch AdamW on the bare model, the recipe's gradient all-reduce and clipping."""

    name = "reference"

    @staticmethod
    def model_per_token_loss(cfg) -> bool:
        """What the model's `calculate_per_token_loss` is set to (megatron's MTP loss reads
        it): true, the loss sums are per token and divided by the global count here."""
        return True

    def __init__(self, model, cfg, layout):
        self.model = model
        self.cfg = cfg
        self.optimizer = build_optimizer(model, cfg)
        self.grad_group = groups.gradient_group()
        self.tp_group = groups.tp_group()
        self._params = list(model.parameters())

    def optimizer_state(self) -> dict:
        """{parameter: {"step", "exp_avg", "exp_avg_sq"}} for checkpoints."""
        return torch_optimizer_state(self.optimizer)

    def load_optimizer_state(self, moments: dict) -> None:
        load_torch_optimizer_state(self.optimizer, moments)

    def gradient_divisor(self, work) -> float | None:
        """None: losses are divided before backward (see run_micro_batch)."""
        return None

    def begin_step(self, step: int) -> float:
        """Set step `step`'s (1-based) learning rate, clear gradients; returns the rate."""
        lr = lr_at(step - 1, self.cfg)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def forward_backward(self, micro, training: bool = True) -> torch.Tensor:
        """Every micro-batch of `micro` forward (and backward when training); this rank's
        report totals [names, 2] (float64, on the device)."""
        device = next(self.model.parameters()).device
        totals = torch.zeros(len(micro.names), 2, dtype=torch.float64, device=device)
        for index in range(len(micro.work.micro_batches)):
            totals += run_micro_batch(micro, index, self.model, backward=training).report
        return totals

    def reduce_gradients(self) -> None:
        """Sum the gradients over dp x cp ranks (and sequence-parallel norms over tp)."""
        collectives.all_reduce_gradients(self._params, self.grad_group)
        collectives.all_reduce_sequence_parallel_gradients(self._params, self.tp_group)

    def gradient_norm(self) -> float:
        """The global norm before clipping; clips the gradients to optim.grad_clip."""
        return grad_norm(self._params, self.cfg.optim.grad_clip, self.tp_group)

    def apply(self) -> None:
        self.optimizer.step()

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
