"""Multi-token prediction bookkeeping: which tokens each MTP layer predicts, and its exact loss.

megatron-core's MTP layer k (0-based) predicts, at position t, the token at t+k+2 of the same
sequence: it rolls labels and the loss mask one step further per layer, within the padded
boundaries in `cu_seqlens_q`, exchanging chunk edges between CP ranks. The recipe computes the
same masks on the global stream (position t counts for layer k when t+k+2 < length) and shards
them with the tokens, which gives each rank its exact token counts. megatron only tracks the
per-micro-batch, per-rank MEAN of the MTP loss for logging; mean x local count, summed over ranks
and micro-batches and divided by the global count, is the exact global mean.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from recipe.megatron.versions import mtp_loss_has_local_token_ratio


def mtp_label_masks(
    position_ids: torch.Tensor, seq_lengths: torch.Tensor, num_layers: int
) -> torch.Tensor:
    """[num_layers, T] float masks: 1 where MTP layer k has a target inside the same sequence.

    `seq_lengths` gives, per token, the real length of the token's sequence.
    """
    depth = torch.arange(num_layers).unsqueeze(1)
    return (position_ids.unsqueeze(0) + depth + 2 < seq_lengths.unsqueeze(0)).to(torch.float32)


def global_mtp_token_counts(lengths: list[int], num_layers: int) -> list[int]:
    """Tokens each MTP layer predicts over a set of sequences: L-2-k per sequence."""
    return [sum(max(0, n - 2 - k) for n in lengths) for k in range(num_layers)]


def mask_given_to_mtp(loss_mask: torch.Tensor, mtp_loss_mask: str) -> torch.Tensor:
    """The mask megatron's MTP block rolls and counts: the loss mask, where the model call hands
    it over (convention.mtp_loss_mask=passed), else all ones (process_mtp_loss's fallback)."""
    return loss_mask if mtp_loss_mask == "passed" else torch.ones_like(loss_mask)


def rolled_loss_masks(
    loss_mask: torch.Tensor, cu_seqlens_padded: torch.Tensor, num_layers: int
) -> torch.Tensor:
    """[num_layers, T] float: megatron's per-layer roll of the loss mask, on the global stream.

    MTP layer k reads the loss mask rolled k+1 steps left within each padded sequence (nothing
    rolls in from the next one), so a label the main loss skips (an image placeholder) is
    skipped at every depth too. For text this equals `mtp_label_masks`.
    """
    total = loss_mask.numel()
    cu = cu_seqlens_padded.to(torch.int64)
    seq_end = torch.repeat_interleave(cu[1:], cu.diff())
    masks = torch.zeros(num_layers, total, dtype=torch.float32)
    index = torch.arange(total)
    for k in range(num_layers):
        source = index + k + 1
        inside = source < seq_end
        masks[k, inside] = loss_mask[source[inside]].to(torch.float32)
    return masks


def predicted_token_counts(
    sequences: list[list[int]], num_layers: int, skip_id: int | None = None
) -> tuple[int, list[int]]:
    """(next-token targets, [targets of each MTP layer]) of a set of sequences: token t of a
    sequence is a target of the main loss when t >= 1 and of MTP layer k when t >= k + 2, unless
    it is `skip_id` (an image placeholder). Text: L-1 and L-2-k per sequence."""
    if skip_id is None:
        lengths = [len(s) for s in sequences]
        return sum(n - 1 for n in lengths), global_mtp_token_counts(lengths, num_layers)
    main, per_layer = 0, [0] * num_layers
    for seq in sequences:
        counted = [t != skip_id for t in seq]
        main += sum(counted[1:])
        for k in range(num_layers):
            per_layer[k] += sum(counted[k + 2 :])
    return main, per_layer


# --- megatron's MTP loss: what it tracked, and the backward scale of each layer ---------------


def take_mtp_loss_means(num_layers: int) -> torch.Tensor:
    """The per-layer mean MTP loss megatron tracked during the last forward, then reset it
    (0.16 keeps it in `tracker["values"]`, 0.19 in `tracker["loss_values"]`)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    key = "loss_values" if "loss_values" in tracker else "values"
    if key not in tracker:
        return torch.zeros(num_layers, dtype=torch.float64)
    means = tracker[key].detach().double().clone()  # stays on the device: no host sync
    # Emptied rather than zeroed (megatron's own clean-up keeps the tensors): megatron sizes them
    # on first use, so a later model with more MTP layers in the same process (a sweep over
    # mtp.num_layers in one Hydra process) would index past them.
    tracker.clear()
    return means


@contextlib.contextmanager
def captured_token_losses(model):
    """Every per-token loss the model computes in the forward passes inside the block, in call
    order: megatron computes each MTP depth's loss with the model's own
    `compute_language_model_loss` (looked up on the instance in 0.16 and 0.19), before the
    main next-token loss. Yields the list the [b, s] losses are appended to."""
    original = model.compute_language_model_loss
    seen: list[torch.Tensor] = []

    def keep(labels, logits):
        loss = original(labels, logits)
        seen.append(loss.detach())
        return loss

    model.compute_language_model_loss = keep
    try:
        yield seen
    finally:
        del model.compute_language_model_loss


def mtp_layer_backward_scales(
    global_layer_counts: list[int] | torch.Tensor,
    local_lm_count: torch.Tensor,
    local_layer_counts: torch.Tensor,
) -> torch.Tensor:
    """[num_layers] backward scale per MTP layer for one micro-batch on this rank, so that each
    target of layer k weighs exactly 1 / (global count of layer k over the step).

    `local_lm_count` is the micro-batch's loss-mask count on this rank (megatron's
    `original_num_tokens`), `local_layer_counts` each layer's count (`num_tokens`). A layer with no
    target anywhere gets 0. Given the global counts as a tensor on the counts' device (the
    trainer copies them once per step), nothing here waits for the host.
    """
    device = local_layer_counts.device
    counts = torch.as_tensor(global_layer_counts, dtype=torch.float64, device=device)
    scales = torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    if mtp_loss_has_local_token_ratio():
        # megatron multiplies by local_lm / clamp(local_k, 1); multiply by its inverse.
        local_ratio = local_layer_counts.double().clamp(min=1) / local_lm_count.double().clamp(
            min=1
        )
        scales = scales * local_ratio
    return scales.float()


@functools.cache
def _megatron_autoscaler():
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    return MTPLossAutoScaler


class MTPBackwardScales:
    """What megatron's MTP autoscaler gives the MTP targets at backward time, micro-batch by
    micro-batch (`mtp.scaling`).

    megatron hands every MTP target one backward scale, the class attribute
    `MTPLossAutoScaler.main_loss_backward_scale`, for all MTP layers alike; on 0.19 after the
    local token ratio (`recipe.megatron.versions`). `mtp.scaling=exact` swaps megatron's
    autoscaler, where megatron calls it (the GPT model on 0.16, `process_mtp_loss` on 0.19), for
    one that takes a scale per MTP layer from this object's queue, chosen so that every target of
    layer k weighs 1 / (global count of layer k), the local ratio divided back out.
    `mtp.scaling=upstream` leaves the release's weighting alone. The queue belongs to the object:
    its autoscaler reads only its own, and `prepare` binds it for the forward that follows, so
    several objects (two Trainers in one process) can take turns.
    """

    def __init__(self):
        self.pending: list[torch.Tensor] = []
        """Per MTP layer of the coming forward, the backward scale its autoscaler takes."""
        self.autoscaler = None
        """The autograd function `install` binds in megatron (made then: it imports megatron)."""

    def _per_layer_autoscaler(self):
        original = _megatron_autoscaler()
        pending = self.pending

        class PerLayerMTPLossAutoScaler(original):
            """megatron's autoscaler, but each call (one per MTP layer, in layer order) takes its
            own backward scale from the queue; with an empty queue (mtp.scaling=upstream,
            evaluation) it is megatron's: one class-wide scale."""

            recipe_per_layer = True

            @staticmethod
            def forward(ctx, output: torch.Tensor, mtp_loss: torch.Tensor):
                ctx.save_for_backward(mtp_loss)
                ctx.layer_scale = pending.pop(0) if pending else None
                return output

            @staticmethod
            def set_loss_scale(scale: torch.Tensor):
                # megatron's schedule sets the scale through the name its module now binds to
                # this class; keep it where the backward below (and megatron's own class) reads it
                original.main_loss_backward_scale = scale

            @staticmethod
            def backward(ctx, grad_output: torch.Tensor):
                (mtp_loss,) = ctx.saved_tensors
                scale = ctx.layer_scale
                if scale is None:
                    scale = original.main_loss_backward_scale
                return grad_output, torch.ones_like(mtp_loss) * scale.to(mtp_loss.device)

        return PerLayerMTPLossAutoScaler

    def install(self) -> MTPBackwardScales:
        """Bind this object's autoscaler where megatron calls it (in place of megatron's, or of
        an earlier object's). Harmless for later upstream runs: with an empty queue it is
        megatron's."""
        from megatron.core.models.gpt import gpt_model
        from megatron.core.transformer import multi_token_prediction

        original = _megatron_autoscaler()
        if self.autoscaler is None:
            self.autoscaler = self._per_layer_autoscaler()
        for module in (gpt_model, multi_token_prediction):
            bound = getattr(module, "MTPLossAutoScaler", None)
            if bound is original or getattr(bound, "recipe_per_layer", False):
                module.MTPLossAutoScaler = self.autoscaler
        return self

    def prepare(
        self,
        scaling: str,
        global_lm_count: int,
        global_layer_counts: list[int] | torch.Tensor,
        local_lm_count: torch.Tensor,
        local_layer_counts: torch.Tensor,
        gradient_divisor: float | None = None,
    ) -> None:
        """Before the forward of one training micro-batch: set what megatron's MTP autoscaler
        gives the MTP targets at backward time.

        exact: per layer, `mtp_layer_backward_scales` (this object's autoscaler bound), times
        `gradient_divisor` when the engine divides every gradient by it after backward
        (megatron's). upstream: what megatron's own schedule does with per-token losses: a scale
        of 1 and every gradient divided by the step's global main-loss count
        (`finalize_model_grads`). The reference engine (`gradient_divisor` None) folds that into
        the one scale; on megatron's engine its own schedule sets the scale.
        """
        self.pending.clear()
        if scaling == "exact":
            # bound here, for this forward: another object (a second Trainer in the process, as
            # in benchmarks/engine_step.py) may have bound its own since
            self.install()
            scales = mtp_layer_backward_scales(
                global_layer_counts, local_lm_count, local_layer_counts
            )
            if gradient_divisor is not None:
                scales = scales * gradient_divisor
            self.pending.extend(scales.unbind())
        elif gradient_divisor is not None:
            return
        else:
            # Set on megatron's class itself: its `set_loss_scale` looks the class up by module
            # name, which after `install` is the subclass.
            _megatron_autoscaler().main_loss_backward_scale = torch.tensor(
                1.0 / max(global_lm_count, 1)
            )

    def confirm_taken(self) -> None:
        """After the forward: every queued per-layer scale must have been taken by an MTP layer.
        Left over means megatron no longer calls the autoscaler the recipe replaced, and the MTP
        gradient would silently be megatron's, not the exact one."""
        if self.pending:
            left = len(self.pending)
            self.pending.clear()
            raise RuntimeError(
                f"mtp.scaling=exact: {left} MTP layer scale(s) were not taken by megatron's MTP "
                "autoscaler; this megatron-core calls it elsewhere. Use mtp.scaling=upstream or "
                "update recipe/model/mtp.py"
            )
