"""The training loop: one optimizer step = the same global tokens whatever the parallel layout.

Each step's whole sequences are split across data-parallel ranks, packed into budgeted THD
micro-batches, sharded for CP at one point, and run forward/backward with per-token loss sums
divided by the step's GLOBAL count of predicted tokens. Gradients are then summed over
data-parallel x context-parallel ranks, which makes the update exactly the cp=1, dp=1 update.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from recipe.config import TrainConfig
from recipe.data.batching import (
    StepStream,
    chunk_for_eval,
    plan_micro_batches,
    split_across_ranks,
)
from recipe.data.corpus import load_corpus
from recipe.data.packing import PackedBatch, pack_sequences
from recipe.data.thd import aligned_length
from recipe.launch.environment import compute_device, read_environment
from recipe.model.cpu_compat import apply_cpu_compat, seed_model_parallel_rng
from recipe.model.gpt import packed_seq_params
from recipe.model.mtp import (
    global_mtp_token_counts,
    mtp_label_masks,
    set_mtp_backward_scale,
    take_mtp_loss_means,
)
from recipe.parallel import collectives, groups
from recipe.parallel.cp.shard import shard_batch
from recipe.training.loggers import NullLogger, RunLogger
from recipe.training.metrics import summarize


@dataclass
class StepWork:
    """What this rank computes for one step (or one eval chunk)."""

    micro_batches: list[PackedBatch]
    """Already sharded for this CP rank, moved to the model's device."""
    global_predicted_tokens: int
    """Loss-masked tokens of the whole step over all ranks: the loss normaliser."""
    global_real_tokens: int
    global_padded_tokens: int
    global_micro_batches: int
    global_mtp_tokens: list[int]
    """Per MTP layer: tokens it predicts over the whole step (empty with mtp=off)."""


def plan_step(
    sequences: list[list[int]], cfg: TrainConfig, layout, pad_id: int, device: torch.device
) -> StepWork:
    """Split a step across DP ranks, into micro-batches, and shard each for this CP rank."""
    lengths = [len(s) for s in sequences]
    alignment = cfg.alignment
    per_rank = split_across_ranks(lengths, layout.dp_size, alignment)
    plans = [
        plan_micro_batches(
            [lengths[i] for i in ids], alignment, layout.cp_size, cfg.batching.max_tokens_per_rank
        )
        for ids in per_rank
    ]
    mine = per_rank[layout.dp_rank]
    mtp_layers = cfg.mtp.num_layers if cfg.mtp.enabled else 0
    micro_batches = []
    for micro in plans[layout.dp_rank]:
        batch = pack_sequences([sequences[mine[j]] for j in micro], alignment, pad_id)
        if mtp_layers:
            masks = mtp_label_masks(
                batch.position_ids, batch.tokens_per_sequence_length(), mtp_layers
            )
            batch = batch.replace(mtp_mask=masks)
        local = shard_batch(batch, layout.cp_size, layout.cp_rank, cfg.cp.preprocess)
        micro_batches.append(local.to(device))
    return StepWork(
        micro_batches=micro_batches,
        global_predicted_tokens=sum(n - 1 for n in lengths),
        global_real_tokens=sum(lengths),
        global_padded_tokens=sum(aligned_length(n, alignment) for n in lengths),
        global_micro_batches=sum(len(p) for p in plans),
        global_mtp_tokens=global_mtp_token_counts(lengths, mtp_layers),
    )


def forward_loss_sum(
    model, batch: PackedBatch, pass_position_ids: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's masked loss sums for one micro-batch: (next-token sum, per-MTP-layer sums).

    The MTP sums (None without MTP or outside training) are for logging; the MTP gradient reaches
    the model inside megatron, scaled by `set_mtp_backward_scale`.
    """
    kwargs = {}
    if batch.mtp_mask is not None:
        kwargs["loss_mask"] = batch.loss_mask.unsqueeze(0)  # megatron rolls it per MTP layer
    per_token = model(
        input_ids=batch.input_ids.unsqueeze(0),
        position_ids=batch.position_ids.unsqueeze(0) if pass_position_ids else None,
        attention_mask=None,
        labels=batch.labels.unsqueeze(0),
        packed_seq_params=packed_seq_params(batch),
        **kwargs,
    )
    lm_sum = (per_token.squeeze(0).float() * batch.loss_mask).sum()
    mtp_sums = None
    if batch.mtp_mask is not None and model.training:
        counts = batch.mtp_mask.sum(-1).double().cpu()
        means = take_mtp_loss_means(counts.numel())
        # A rank with no MTP target in this micro-batch tracked 0/0; it contributes nothing.
        mtp_sums = torch.where(counts > 0, means * counts, torch.zeros_like(counts))
    return lm_sum, mtp_sums


def mtp_metrics(sums: list[float], counts: list[int], lm_loss: float, scale: float) -> dict:
    """`loss` is what is optimised: lm_loss + scale * mean over MTP layers of (sum / N), with N
    the first layer's global token count (megatron applies one backward scale to all layers), so
    with one layer it is exactly lm_loss + scale * mtp_loss."""
    if not counts:
        return {"loss": lm_loss}
    means = [s / n if n else None for s, n in zip(sums, counts)]
    known = [m for m in means if m is not None]
    metrics = {
        "loss": lm_loss + scale * sum(sums) / len(sums) / counts[0] if counts[0] else lm_loss,
        # None when no sequence of the step was long enough to give MTP a target.
        "mtp_loss": sum(known) / len(known) if known else None,
    }
    if len(means) > 1:
        metrics.update({f"mtp_loss_{k + 1}": m for k, m in enumerate(means)})
    return metrics


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


def _grad_norm(parameters, clip: float) -> float:
    params = [p for p in parameters if p.grad is not None]
    if clip > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, clip))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))


@torch.no_grad()
def evaluate(model, chunks: list[StepWork], group, pass_position_ids: bool) -> float:
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for work in chunks:
        for batch in work.micro_batches:
            loss_sum += forward_loss_sum(model, batch, pass_position_ids)[0].double().cpu()
    model.train()
    collectives.all_reduce_sum(loss_sum, group)
    return float(loss_sum) / sum(w.global_predicted_tokens for w in chunks)


def _set_threads(local_world: int) -> None:
    """Ranks of one machine share its cores instead of each grabbing all of them."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def train(cfg: TrainConfig) -> dict:
    """Train one model; returns {"summary": ..., "history": [per-step metrics]} on every rank."""
    apply_cpu_compat()
    owns_world = not torch.distributed.is_initialized()
    env = read_environment(os.environ)
    layout = groups.init_distributed(cfg.parallel_dims, env)
    logger = NullLogger()
    try:
        _set_threads(env.local_world_size)
        seed_model_parallel_rng(cfg.trainer.seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        device = compute_device(env.local_rank)

        corpus = load_corpus(cfg.data)
        pad_id = corpus.tokenizer.pad_id
        model = build_model(cfg, corpus.tokenizer.vocab_size, device)
        optimizer = build_optimizer(model, cfg)
        grad_group = groups.gradient_group()
        eval_chunks = [
            plan_step(c, cfg, layout, pad_id, device)
            for c in chunk_for_eval(corpus.eval, cfg.batching.tokens_per_step)
        ]
        if layout.is_main:
            logger = RunLogger(cfg, cfg.output_dir, cfg.trainer.max_steps)

        history: list[dict] = []
        steps = iter(StepStream(corpus.train, cfg.batching.tokens_per_step, cfg.data.seed))
        loop_start = time.perf_counter()
        for step in range(1, cfg.trainer.max_steps + 1):
            step_start = time.perf_counter()
            work = plan_step(next(steps), cfg, layout, pad_id, device)
            lr = lr_at(step - 1, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            mtp_counts = work.global_mtp_tokens
            if mtp_counts:
                set_mtp_backward_scale(1.0 / mtp_counts[0] if mtp_counts[0] else 0.0)
            # One buffer, one all-reduce: [next-token sum, MTP sum per layer].
            sums = torch.zeros(1 + len(mtp_counts), dtype=torch.float64)
            for batch in work.micro_batches:
                lm_sum, mtp_sums = forward_loss_sum(model, batch, cfg.passes_position_ids)
                (lm_sum / work.global_predicted_tokens).backward()
                sums[0] += lm_sum.detach().double().cpu()
                if mtp_sums is not None:
                    sums[1:] += mtp_sums
            collectives.all_reduce_gradients(model.parameters(), grad_group)
            grad_norm = _grad_norm(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            collectives.all_reduce_sum(sums, grad_group)
            lm_loss = float(sums[0]) / work.global_predicted_tokens
            step_time = time.perf_counter() - step_start
            metrics = {
                "step": step,
                "lm_loss": lm_loss,
                **mtp_metrics(sums[1:].tolist(), mtp_counts, lm_loss, cfg.mtp.loss_scaling_factor),
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens": work.global_real_tokens,
                "padded_tokens": work.global_padded_tokens,
                "micro_batches": work.global_micro_batches,
                "step_time_s": step_time,
                "tokens_per_s": work.global_real_tokens / step_time,
            }
            every = cfg.trainer.eval_every
            if step == cfg.trainer.max_steps or (every and step % every == 0):
                metrics["eval_lm_loss"] = evaluate(
                    model, eval_chunks, grad_group, cfg.passes_position_ids
                )
            history.append(metrics)
            logger.log_step(metrics)
        wall = time.perf_counter() - loop_start
        summary = summarize(
            history,
            entropy_floor=corpus.entropy_floor,
            baseline_loss=corpus.baseline_loss,
            wall_time_s=wall,
        )
        logger.log_summary(summary)
        return {"summary": summary, "history": history}
    finally:
        logger.close()
        if owns_world:
            groups.shutdown_distributed()


def build_model(cfg: TrainConfig, vocab_size: int, device=None):
    from recipe.model.gpt import build_gpt_model

    return build_gpt_model(
        cfg.model,
        mtp_cfg=cfg.mtp,
        vocab_size=vocab_size,
        max_sequence_length=aligned_length(cfg.data.max_seq_len, cfg.alignment),
        seed=cfg.trainer.seed,
        cp_size=cfg.cp.size,
        tp_size=cfg.parallel.tp,
        device=device,
    )
