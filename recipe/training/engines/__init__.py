"""What steps the optimizer: megatron-core's own machinery (the default) or the reference loop.

`trainer.engine` is read here and nowhere else in the training code: `engine_class` picks the
class, and each class says what it needs of the model (`model_per_token_loss`). Both engines
answer the trainer the same questions, the `Engine` protocol below, and both run a micro-batch
through the same `MicroBatchPass` (recipe/training/micro_batch.py): the reference engine through
`run_micro_batch`, megatron's schedules through the same forward and loss in Megatron-LM's
`forward_step(data_iterator, model)` contract.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from recipe.training.engines.megatron_core import MegatronEngine
from recipe.training.engines.reference import ReferenceEngine


@runtime_checkable
class Engine(Protocol):
    """One rank's optimizer machinery around its model (or pipeline stage)."""

    name: str
    optimizer: Any

    def optimizer_state(self) -> dict:
        """{parameter: {"step", "exp_avg", "exp_avg_sq"}} of the whole model, for checkpoints."""

    def load_optimizer_state(self, moments: dict) -> None:
        """Take over `optimizer_state()` of a checkpoint (written at any layout)."""

    def gradient_divisor(self, work) -> float | None:
        """What the engine divides every gradient by after backward (None: losses are divided
        before it); the exact MTP scales are multiplied by it."""

    def begin_step(self, step: int) -> float:
        """Set step `step`'s (1-based) learning rate and clear gradients; returns the rate."""

    def forward_backward(self, micro, training: bool = True) -> torch.Tensor:
        """Every micro-batch of the `MicroBatchPass` forward (and backward when training):
        this rank's report totals [names, 2] (float64, on the device)."""

    def reduce_gradients(self) -> None:
        """Sum the gradients over the ranks that share them."""

    def gradient_norm(self) -> float:
        """The global gradient norm before clipping."""

    def apply(self) -> None:
        """Clip to optim.grad_clip and update the weights."""

    def train(self, mode: bool = True) -> None:
        """Training or evaluation mode of the model."""


ENGINE_CLASSES: dict[str, type] = {cls.name: cls for cls in (MegatronEngine, ReferenceEngine)}
"""By `trainer.engine` value, each class's own `name` (recipe.names.ENGINES, which the schema
checks, lists the same: tests/test_engines.py)."""


def engine_class(cfg) -> type:
    """The class `trainer.engine` names (the schema has refused any other name)."""
    return ENGINE_CLASSES[cfg.trainer.engine]


def build_engine(model, cfg, layout) -> Engine:
    """The run's engine around this rank's model (or pipeline stage)."""
    return engine_class(cfg)(model, cfg, layout)


__all__ = [
    "ENGINE_CLASSES",
    "Engine",
    "MegatronEngine",
    "ReferenceEngine",
    "build_engine",
    "engine_class",
]
