"""The work of one micro-batch, the same on both engines: the seam between the step and the model.

The recipe's loop and megatron's schedules (which call only `forward_step(data_iterator, model)`
and the loss function it returns) both run a micro-batch through `MicroBatchPass`: before the
forward, the exact MTP backward scales; the model call under autocast, with the per-token losses
captured for `trainer.record_tokens` and the activation trace told which tokens it sees; after it,
the loss in Megatron-LM's contract, `(loss_sum, num_tokens, report)`, and the per-token rows. So
`mtp.scaling`, token records and traces mean the same whichever engine steps the optimizer.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from recipe.model.mtp import MTPBackwardScales, captured_token_losses, take_mtp_loss_means
from recipe.model.numerics import autocast
from recipe.training.step import LM, ForwardOutput, StepWork, loss_func, model_call
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
    ):
        """`gradient_divisor`: what the engine divides every gradient by after backward
        (megatron's finalize_model_grads: the step's global token count with per-token losses;
        its DDP: dp x cp otherwise); None for the recipe's engine, which divides before. The
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
            self.mtp_scales.prepare(
                cfg.mtp.scaling,
                work.global_predicted_tokens,
                work.global_mtp_counts,
                batch.loss_mask.sum(),
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
            output = model_call(batch, model, cfg.passes_position_ids)
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
        result = ForwardOutput(output.squeeze(0), mtp_means)
        loss_sum, num_tokens, report = loss_func(batch, result)
        if captured is not None:
            mtp_losses = captured[:-1]  # megatron computes the MTP depths' losses first
            self.token_rows_out.append(
                token_rows(
                    batch, result.per_token_loss, self.work.samples[index], self.layout, mtp_losses
                )
            )
        stacked = torch.stack([report[name] for name in self.names])
        return loss_sum, num_tokens.to(torch.int), {REPORT: stacked}

    def megatron_forward_step(self, data_iterator, model):
        """`forward_step(data_iterator, model)` for megatron's schedules: the iterator yields
        micro-batch indices."""
        return self.forward(next(data_iterator), model)
