"""One optimizer step's work on this rank.

`plan_step` splits a step's whole sequences across data-parallel ranks, into budgeted micro-batches,
packs each on the global stream and shards it for this CP rank at the one point CP is applied.
What runs them through the model is recipe/training/micro_batch.py; the report it returns holds a
`[sum, count]` pair per named loss (`lm`, `mtp_1`, ...), which the trainer adds up on the model's
device, reduces with one all-reduce per step and divides once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.config import TrainConfig
from recipe.config.layout import ParallelLayout
from recipe.data.batching import plan_micro_batches, split_across_ranks
from recipe.data.packing import PackedBatch, attach_images, pack_sequences
from recipe.data.thd import aligned_length
from recipe.model.mtp import mask_given_to_mtp, predicted_token_counts, rolled_loss_masks
from recipe.parallel.cp.shard import shard_batch
from recipe.training.preprocess import load_preprocess

LM = "lm"


def mtp_report_name(layer: int) -> str:
    """Report name of MTP layer `layer` (0-based): mtp_1, mtp_2, ..."""
    return f"mtp_{layer + 1}"


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
    lengths: list[int]
    """Real length of every sequence of the step (all ranks)."""
    samples: list[list[int]] | None = None
    """Per micro-batch of this rank: the step-level index of each of its sequences."""
    global_mtp_counts: torch.Tensor | None = None
    """`global_mtp_tokens` on the model's device (float64), copied there once per step with the
    micro-batches, so that the per-micro-batch MTP scaling never waits on a host copy."""

    @property
    def report_names(self) -> list[str]:
        return [LM] + [mtp_report_name(k) for k in range(len(self.global_mtp_tokens))]

    @property
    def expected_counts(self) -> list[int]:
        """The global count each report must add up to, known from the lengths alone."""
        return [self.global_predicted_tokens, *self.global_mtp_tokens]


def plan_step(
    sequences: list[list[int]],
    cfg: TrainConfig,
    layout: ParallelLayout,
    pad_id: int,
    device: torch.device,
    check_preprocess: bool = False,
    image_token_id: int | None = None,
    mutant=None,
) -> StepWork:
    """Split a step across DP ranks, into micro-batches, and shard each for this CP rank
    (checking a user's cp.preprocess function on them when `check_preprocess`). With
    `image_token_id` (vision), the sequences carry images that travel with their micro-batch.
    `mutant`: the training mutant active this step (recipe/training/mutants.py), or None."""
    lengths = [len(s) for s in sequences]
    alignment = cfg.alignment
    per_rank = split_across_ranks(lengths, layout.dp_size, alignment)
    plans = [
        plan_micro_batches(
            [lengths[i] for i in ids], alignment, layout.cp_size, cfg.batching.max_tokens_per_rank
        )
        for ids in per_rank
    ]
    if cfg.batching.sequence_order == "reversed":
        plans = [[micro[::-1] for micro in plan] for plan in plans]
    mine = per_rank[layout.dp_rank]
    mtp_layers = cfg.mtp.num_layers if cfg.mtp.enabled else 0
    micro_batches = []
    loaded = load_preprocess(cfg.cp.preprocess) if layout.cp_size > 1 else None
    for micro in plans[layout.dp_rank]:
        chosen = [sequences[mine[j]] for j in micro]
        batch = pack_sequences(chosen, alignment, pad_id)
        if image_token_id is not None:
            batch = attach_images(batch, chosen, image_token_id, cfg.image_grid)
        if mtp_layers:
            given = mask_given_to_mtp(batch.loss_mask, cfg.convention.mtp_loss_mask)
            masks = rolled_loss_masks(given, batch.cu_seqlens_padded, mtp_layers)
            batch = batch.replace(mtp_mask=masks)
        local = shard_batch(
            batch,
            layout.cp_size,
            layout.cp_rank,
            cfg.cp.preprocess,
            tp_size=layout.tp_size,
            check=check_preprocess,
            loaded=loaded,
        )
        if mutant is not None and mutant.local is not None and layout.cp_size > 1:
            local = mutant.local(batch, local, layout.cp_size, layout.cp_rank)
        micro_batches.append(local.to(device))
    predicted, mtp_targets = predicted_token_counts(sequences, mtp_layers, image_token_id)
    if cfg.convention.mtp_loss_mask == "all_ones":  # megatron counts every padded slot then
        mtp_targets = [
            sum(max(0, aligned_length(n, alignment) - k - 1) for n in lengths)
            for k in range(mtp_layers)
        ]
    return StepWork(
        micro_batches=micro_batches,
        global_predicted_tokens=predicted,
        global_real_tokens=sum(lengths),
        global_padded_tokens=sum(aligned_length(n, alignment) for n in lengths),
        global_micro_batches=sum(len(p) for p in plans),
        global_mtp_tokens=mtp_targets,
        lengths=lengths,
        samples=[[mine[j] for j in micro] for micro in plans[layout.dp_rank]],
        global_mtp_counts=(
            torch.tensor(mtp_targets, dtype=torch.float64).to(device) if mtp_targets else None
        ),
    )
