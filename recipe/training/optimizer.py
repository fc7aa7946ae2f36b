"""AdamW with linear warmup and cosine decay, and the global gradient norm (clipped or not).

Gradients reach the optimizer already summed over data-parallel x context-parallel ranks, so every
rank computes the same norm and takes the same step; nothing here communicates.
"""

from __future__ import annotations

import math

import torch

from recipe.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to optim.lr, then cosine decay to optim.min_lr at trainer.max_steps."""
    o, total = cfg.optim, cfg.trainer.max_steps
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; norms and biases (1-D parameters) get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    o = cfg.optim
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(parameters, clip: float) -> float:
    """The global gradient norm before clipping; clips to `clip` when it is > 0."""
    params = [p for p in parameters if p.grad is not None]
    if clip > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, clip))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
