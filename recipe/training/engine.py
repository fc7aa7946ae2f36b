"""What steps the optimizer: the recipe's own loop, or megatron-core's machinery.

Both engines take the same `MicroBatchPass` (recipe/training/micro_batch.py) and answer the
trainer the same questions: the step's learning rate, this rank's loss report totals, the global
gradient norm, and the update. `trainer.engine=recipe` (the default) runs its micro-batches itself,
divides each loss by the step's global token count before backward and sums gradients over
dp x cp; `trainer.engine=megatron` is recipe/training/megatron_engine.py.
"""

from __future__ import annotations

import torch

from recipe.checkpoint.optimizer_state import load_torch_optimizer_state, torch_optimizer_state
from recipe.parallel import collectives, groups
from recipe.training.optimizer import build_optimizer, grad_norm, lr_at, set_lr


class RecipeEngine:
    """torch AdamW on the bare model, the recipe's gradient all-reduce and clipping."""

    name = "recipe"

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
        """None: losses are divided before backward (see MicroBatchPass)."""
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
        work = micro.work
        totals = None
        for index in range(len(work.micro_batches)):
            output, finish = micro.forward(index, self.model)
            loss_sum, _, report = finish(output)
            if training:
                (loss_sum / work.global_predicted_tokens).backward()
            report = report["report"]
            totals = report if totals is None else totals + report
        if totals is None:  # no sequence for this rank this step
            device = next(self.model.parameters()).device
            totals = torch.zeros(len(micro.names), 2, dtype=torch.float64, device=device)
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


def pipeline_sum(totals: torch.Tensor, layout) -> torch.Tensor:
    """Only the last pipeline stage computes losses: after the dp x cp sum, every stage gets its
    totals (one all-reduce over the pipeline group; nothing at pp=1)."""
    if layout.pp_size > 1:
        collectives.all_reduce_sum(totals, groups.pipeline_group())
    return totals


def build_engine(model, cfg, layout):
    """The engine `trainer.engine` names, around this rank's model (or pipeline stage)."""
    if cfg.trainer.engine == "megatron":
        from recipe.training.megatron_engine import MegatronEngine

        return MegatronEngine(model, cfg, layout)
    return RecipeEngine(model, cfg, layout)
