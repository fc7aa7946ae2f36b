"""One hand-packed micro-batch through the production path (`run_micro_batch`), for tests that
build their batches themselves instead of planning a step."""

from __future__ import annotations

from recipe.data.packing import PackedBatch
from recipe.training.micro_batch import MicroBatchLoss, MicroBatchPass, run_micro_batch
from recipe.training.step import StepWork


def step_of(batch: PackedBatch) -> StepWork:
    """A step whose only micro-batch is `batch` (whole, on a world of one): the global counts
    are its own."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    mtp = batch.mtp_mask.sum(-1).tolist() if batch.mtp_mask is not None else []
    return StepWork(
        micro_batches=[batch],
        global_predicted_tokens=int(batch.loss_mask.sum()),
        global_real_tokens=sum(lengths),
        global_padded_tokens=int(batch.cu_seqlens_padded[-1]),
        global_micro_batches=1,
        global_mtp_tokens=[int(n) for n in mtp],
        lengths=lengths,
        samples=[list(range(len(lengths)))],
    )


def run_packed(
    batch: PackedBatch, model, cfg, layout, backward: bool = False, training: bool = True
) -> MicroBatchLoss:
    """`batch` through `model` as training runs a micro-batch (cfg's position-id policy and MTP
    scaling, fp32), backward only with `backward`."""
    micro = MicroBatchPass(step_of(batch), cfg, layout, "fp32", model, training=training)
    return run_micro_batch(micro, 0, model, backward=backward)
