"""AdamW with linear warmup and cosine decay, and the global gradient norm (clipped or not).

Gradients reach the optimizer already summed over data-parallel x context-parallel ranks. Under
tensor parallelism a rank holds a shard of some parameters (megatron marks them
`tensor_model_parallel`) and a full copy of the others, so the global norm sums the shards' squares
over the tensor-parallel group and counts each copy once: every rank computes the norm of the
whole tp=1 model and takes the same step.
"""

from __future__ import annotations

import math

import torch

from recipe.config import TrainConfig
from recipe.parallel import collectives


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


def grad_norm(parameters, clip: float, tp_group=None) -> float:
    """The global gradient norm before clipping; clips to `clip` when it is > 0 (torch's rule:
    scale by clip / (norm + 1e-6) when that is below 1)."""
    with_grad = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in with_grad]
    sharded = [p.grad for p in with_grad if getattr(p, "tensor_model_parallel", False)]
    replicated = [p.grad for p in with_grad if not getattr(p, "tensor_model_parallel", False)]

    def squares(tensors):
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=grads[0].device)
        return torch.stack([g.detach().double().pow(2).sum() for g in tensors]).sum()

    total = collectives.all_reduce_sum(squares(sharded), tp_group) + squares(replicated)
    norm = float(total.sqrt())
    if clip > 0:
        coefficient = clip / (norm + 1e-6)
        if coefficient < 1:
            for g in grads:
                g.mul_(coefficient)
    return norm
