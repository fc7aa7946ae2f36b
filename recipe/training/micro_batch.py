"""The one driver of a micro-batch, the same on both engines: the seam between step and model.

`MicroBatchPass.forward` is the only code that calls the model on a micro-batch, and the loss
function it returns the only code that turns the output into a loss: before the forward, the
exact MTP backward scales; the model call (the one place that passes position_ids, images and
the loss mask) under autocast, with the per-token losses captured for `trainer.record_tokens` and
the activation trace told which tokens it sees; after it, the loss in Megatron-LM's contract,
`(loss_sum, num_tokens, report)`, and the per-token rows. megatron's schedules call it as
`forward_step(data_iterator, model)` and run backward themselves; everything else (the reference
engine, the GPU checks, the benchmarks, the tests) calls `run_micro_batch`, which adds the
reference engine's backward. So `mtp.scaling`, token records and traces mean the same whichever
engine steps the optimizer, and a test of a micro-batch tests what training runs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from recipe.data.packing import PackedBatch
from recipe.model.gpt import packed_seq_params
from recipe.model.mtp import (
    MTPBackwardScales,
    captured_token_losses,
    mask_given_to_mtp,
    take_mtp_loss_means,
)
from recipe.model.numerics import autocast
from recipe.training.mutants import step_local_count
from recipe.training.step import LM, StepWork, mtp_report_name
from recipe.training.tokens import token_rows

REPORT = "report"
"""Key of the loss function's report in megatron's `loss_reduced` dict: [names, 2] sums/counts."""


class MicroBatchPass:
    """One step's (or eval chunk's) micro-batches on this rank, run one at a time."""

    def __init__(
        self,
        work: StepWork,
        cfg,
        layout,
        precision: str,
        bare_model,
        *,
        training: bool = True,
        gradient_divisor: float | None = None,
        token_rows_out: list | None = None,
        trace=None,
        mtp_scales: MTPBackwardScales | None = None,
        mutant=None,
    ):
        """`gradient_divisor`: what the engine divides every gradient by after backward
        (megatron's finalize_model_grads: the step's global token count with per-token losses;
        its DDP: dp x cp otherwise); None for the reference engine, which divides before. The
        exact MTP scales are multiplied by it, so they mean the same after the division.
        `mtp_scales`: the run's MTP backward scales, installed where megatron calls its
        autoscaler when mtp.scaling=exact (the model's builder's)."""
        self.work = work
        self.cfg = cfg
        self.layout = layout
        self.precision = precision
        self.bare_model = bare_model
        self.training = training
        self.gradient_divisor = gradient_divisor
        self.token_rows_out = token_rows_out
        self.trace = trace
        self.mtp_scales = mtp_scales if mtp_scales is not None else MTPBackwardScales()
        self.names = work.report_names if training else [LM]  # evaluation: no MTP
        self.mutant = mutant if training else None
        """The training mutant active this step (recipe/training/mutants.py), or None."""

    def forward(self, index: int, model):
        """Micro-batch `index` through `model` (this rank's stage of it): the model's raw output
        and the loss function that turns it into `(loss_sum, num_tokens, report)` (on the last
        pipeline stage; megatron's schedule calls it there only)."""
        from recipe.model.vision import language_model_of  # megatron-core: not in the parent

        work, cfg = self.work, self.cfg
        batch = work.micro_batches[index]
        if self.trace is not None:
            self.trace.micro_batch(batch, work.samples[index])
        mtp = self.training and bool(work.global_mtp_tokens) and self.layout.is_last_stage
        if mtp:
            # megatron's original_num_tokens: the count of the mask its MTP block was given
            given = mask_given_to_mtp(batch.loss_mask, cfg.convention.mtp_loss_mask)
            counts = work.global_mtp_counts
            if self.mutant is not None and self.mutant.mtp_counts is not None:
                mine = sum(b.mtp_mask.sum(-1).double() for b in work.micro_batches)
                counts = self.mutant.mtp_counts(counts, mine, self.layout)
            self.mtp_scales.prepare(
                cfg.mtp.scaling,
                work.global_predicted_tokens,
                counts,
                given.sum(),
                batch.mtp_mask.sum(-1),
                self.gradient_divisor,
            )
        # tp ranks compute the same losses: one of them records
        recording = (
            self.token_rows_out is not None
            and self.layout.tp_rank == 0
            and self.layout.is_last_stage
        )
        with (
            (
                captured_token_losses(language_model_of(self.bare_model))
                if recording
                else contextlib.nullcontext()
            ) as captured,
            autocast(batch.input_ids.device, self.precision),
        ):
            output = _model_call(batch, model, cfg, self.mutant)
        if mtp:
            self.mtp_scales.confirm_taken()
        return output, functools.partial(self.loss, index, captured)

    def loss(self, index: int, captured: list | None, output: torch.Tensor):
        """Megatron-LM's loss contract: this rank's masked loss sum (what backward sees), its
        token count (an int tensor, as megatron's schedule wants it) and {REPORT: [names, 2]}."""
        batch = self.work.micro_batches[index]
        mtp_means = None
        if batch.mtp_mask is not None and self.training:
            mtp_means = take_mtp_loss_means(batch.mtp_mask.shape[0]).to(output.device)
        per_token_loss = output.squeeze(0)
        loss_sum, num_tokens, report = _loss_and_report(batch, per_token_loss, mtp_means)
        if self.mutant is not None and self.mutant.backward is not None:  # the report stays
            loss_sum = self.mutant.backward(
                loss_sum, per_token_loss, batch, step_local_count(self.work), self.work, self.layout
            )
        if captured is not None:
            mtp_losses = captured[:-1]  # megatron computes the MTP depths' losses first
            self.token_rows_out.append(
                token_rows(batch, per_token_loss, self.work.samples[index], self.layout, mtp_losses)
            )
        stacked = torch.stack([report[name] for name in self.names])
        return loss_sum, num_tokens.to(torch.int), {REPORT: stacked}

    def megatron_forward_step(self, data_iterator, model):
        """`forward_step(data_iterator, model)` for megatron's schedules: the iterator yields
        micro-batch indices."""
        return self.forward(next(data_iterator), model)


@dataclass
class MicroBatchLoss:
    """What `run_micro_batch` returns for one micro-batch on this rank."""

    loss_sum: torch.Tensor
    """The masked next-token loss sum (what backward saw), before the division."""
    num_tokens: torch.Tensor
    """Its loss-masked token count."""
    report: torch.Tensor
    """[names, 2] float64 (sum, count) per loss of `names` (lm, mtp_1, ...), detached."""
    names: list[str]
    per_token_loss: torch.Tensor
    """[T_local] next-token loss of every local token (padding and masked ones too), detached;
    on a pipeline stage without the loss, its output hidden states."""

    def __getitem__(self, name: str) -> torch.Tensor:
        """The (sum, count) pair of loss `name`."""
        return self.report[self.names.index(name)]


def run_micro_batch(
    micro: MicroBatchPass, index: int, model, backward: bool = True
) -> MicroBatchLoss:
    """Micro-batch `index` of `micro` through `model` as the reference engine runs it: forward,
    loss and, with `backward`, backward of its loss divided by the step's GLOBAL count of predicted
    tokens (so that the gradients summed over micro-batches and ranks are the cp=1 gradient)."""
    output, finish = micro.forward(index, model)
    loss_sum, num_tokens, report = finish(output)
    if backward:
        (loss_sum / micro.work.global_predicted_tokens).backward()
    return MicroBatchLoss(
        loss_sum, num_tokens, report[REPORT], micro.names, output.detach().squeeze(0)
    )


def _model_call(batch: PackedBatch, model, cfg, mutant=None) -> torch.Tensor:
    """The model call for one packed micro-batch: [1, T] per-token losses from the last (or only)
    pipeline stage, hidden states from the others. `cfg.convention` decides what megatron is
    handed: which offsets go in cu_seqlens_q, and whether its MTP block gets the loss mask."""
    kwargs = {}
    if batch.mtp_mask is not None and cfg.convention.mtp_loss_mask == "passed":
        kwargs["loss_mask"] = batch.loss_mask.unsqueeze(0)  # megatron rolls it per MTP layer
    if batch.images is not None:
        kwargs["batch"] = batch  # images, their slots and the stream for the 3-D positions
    kwargs["packed_seq_params"] = packed_seq_params(batch, cfg.convention.cu_seqlens_q)
    if mutant is not None and mutant.model_call is not None:
        kwargs = mutant.model_call(kwargs, batch)
    return model(
        input_ids=batch.input_ids.unsqueeze(0),
        position_ids=batch.position_ids.unsqueeze(0) if cfg.passes_position_ids else None,
        attention_mask=None,
        labels=batch.labels.unsqueeze(0),
        **kwargs,
    )


def _loss_and_report(
    batch: PackedBatch, per_token_loss: torch.Tensor, mtp_means: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's masked next-token loss sum (what backward sees), its token count, and the
    report: float64 `[sum, count]` per named loss. `mtp_means`: per MTP layer, the mean loss
    megatron tracked for this micro-batch on this rank (training with mtp=on only; the MTP
    gradient itself reaches the model inside megatron). Each mean is weighted by the batch's
    MTP mask count (convention.mtp_loss_mask=all_ones: the all-ones mask megatron rolls then)."""
    loss_sum = (per_token_loss.float() * batch.loss_mask).sum()
    num_tokens = batch.loss_mask.sum()
    report = {LM: torch.stack([loss_sum.detach().double(), num_tokens.double()])}
    if mtp_means is not None:
        counts = batch.mtp_mask.sum(-1).double()
        means = mtp_means.double()
        # A rank with no MTP target in this micro-batch tracked 0/0; it contributes nothing.
        sums = torch.where(counts > 0, means * counts, torch.zeros_like(counts))
        for k in range(counts.numel()):
            report[mtp_report_name(k)] = torch.stack([sums[k], counts[k]])
    return loss_sum, num_tokens, report
