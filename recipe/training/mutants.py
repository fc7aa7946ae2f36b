"""Broken copies of the recipe's CP/MTP/loss path: the catalogue the training mutation score runs.

Each mutant is one bug that frameworks have shipped (named after the bug it is modelled on), made
selectable with `mutant.name=NAME` and active from step `mutant.onset` on, so the verdict can be
shown to catch it from the first step and when it starts late in a long run. A mutant acts at one
of six seams of the correct path, each a pure function of what that seam already holds:

- `local`: this CP rank's micro-batch after sharding (positions, labels, masks, chunk order);
- `backward`: the loss sum one micro-batch hands to backward (normalisation, weights, padding);
  the logged loss is the correct one, as a framework's logging usually is;
- `model_call`: what megatron's model call is handed (MTP loss mask, offsets);
- `mtp_counts`: the counts megatron's MTP loss is scaled by;
- `gradients`: which parameters' gradients the reduction over CP ranks leaves out;
- `weights`: the weights themselves, once at the onset (a lossy state reload).

Every mutant is the identity at cp=1, dp=1 except `mtp_roll_real_offsets` and
`weights_rounded_to_16_bits`, which break any layout: the catalogue runs them at cp>1 only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.data.packing import PackedBatch
from recipe.names import MUTANTS


@dataclass(frozen=True)
class Mutant:
    name: str
    modelled_on: str
    """The upstream bug (or bug class) this copy re-creates."""
    seam: str
    """Where it acts: local | backward | model_call | mtp_counts | gradients | weights."""
    local: Callable | None = None
    """(global batch, local batch, cp_size, cp_rank) -> local batch."""
    backward: Callable | None = None
    """(loss_sum, per_token_loss, batch, step_local_count, work, layout) -> loss_sum."""
    model_call: Callable | None = None
    """(kwargs, batch) -> kwargs."""
    mtp_counts: Callable | None = None
    """(global per-layer counts, this rank's per-layer step counts, layout) -> counts."""
    unreduced: Callable[[str], bool] | None = None
    """Which parameters (by name) keep this rank's own gradient instead of the CP sum."""
    weights: Callable | None = None
    """(model) -> None, at the onset step only."""


def _local_sequences(cu_seqlens_padded: torch.Tensor, cp_size: int) -> list[tuple[int, int]]:
    """(start, length) of each sequence's slots in a rank's local stream: its two chunks."""
    local = (cu_seqlens_padded // cp_size).tolist()
    return [(a, b - a) for a, b in zip(local[:-1], local[1:])]


def _contiguous(tensor: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rank `cp_rank`'s contiguous share of a stream (the tokens' layout is zigzag)."""
    share = tensor.shape[-1] // cp_size
    return tensor[..., cp_rank * share : (cp_rank + 1) * share].clone()


def _prefix_positions(g: PackedBatch, local: PackedBatch, cp_size: int, cp_rank: int):
    from recipe.parallel.cp.verl import verl_preprocess

    starts = g.cu_seqlens_padded[:-1].tolist()
    lengths = g.cu_seqlens.diff().tolist()
    sequences = [g.input_ids[s : s + n] for s, n in zip(starts, lengths)]
    _, positions = verl_preprocess(
        sequences, g.cu_seqlens_padded, cp_size, cp_rank, variant="verl_legacy"
    )
    return local.replace(position_ids=positions.to(local.position_ids.dtype))


def _local_arange_positions(g, local: PackedBatch, cp_size, cp_rank):
    return local.replace(position_ids=torch.arange(local.position_ids.numel()))


def _chunk_local_positions(g: PackedBatch, local: PackedBatch, cp_size, cp_rank):
    positions = local.position_ids.clone()
    for start, length in _local_sequences(g.cu_seqlens_padded, cp_size):
        half = length // 2
        positions[start : start + half] = torch.arange(half)
        positions[start + half : start + length] = torch.arange(half)
    return local.replace(position_ids=positions)


def _contiguous_field(name: str):
    def mutate(g: PackedBatch, local: PackedBatch, cp_size: int, cp_rank: int):
        if getattr(g, name) is None:
            return local
        return local.replace(**{name: _contiguous(getattr(g, name), cp_size, cp_rank)})

    return mutate


def _labels_rolled_after_split(g, local: PackedBatch, cp_size, cp_rank):
    return local.replace(labels=torch.roll(local.input_ids, -1))


def _back_chunk_label_off_by_one(g: PackedBatch, local: PackedBatch, cp_size, cp_rank):
    labels = local.labels.clone()
    for start, length in _local_sequences(g.cu_seqlens_padded, cp_size):
        back = start + length // 2
        labels[back : start + length - 1] = local.labels[back + 1 : start + length]
    return local.replace(labels=labels)


def _swapped_chunks_last_rank(g: PackedBatch, local: PackedBatch, cp_size: int, cp_rank: int):
    if cp_rank != cp_size - 1:
        return local
    order = []
    for start, length in _local_sequences(g.cu_seqlens_padded, cp_size):
        half = length // 2
        order += list(range(start + half, start + length)) + list(range(start, start + half))
    index = torch.tensor(order, dtype=torch.long)
    swapped = {
        name: tensor.index_select(PackedBatch.TOKEN_DIMS.get(name, 0), index)
        for name, tensor in local.per_token().items()
    }
    return local.replace(**swapped)


def _padding_in_loss(loss_sum, per_token_loss, batch: PackedBatch, count, work, layout):
    sequences = _local_sequences(batch.cu_seqlens_padded, layout.cp_size)
    slots = torch.tensor([length for _, length in sequences], device=batch.loss_mask.device)
    real_lengths = batch.cu_seqlens.diff().to(slots.device)
    real_length_of_slot = torch.repeat_interleave(real_lengths, slots)
    padding = (batch.position_ids >= real_length_of_slot).to(per_token_loss.dtype)
    return loss_sum + (per_token_loss.float() * padding.float()).sum()


def _rank_local_loss(loss_sum, per_token_loss, batch, count, work, layout):
    ranks = layout.dp_size * layout.cp_size
    return loss_sum * work.global_predicted_tokens / (max(count, 1.0) * ranks)


def _loss_scaled_by_cp(loss_sum, per_token_loss, batch, count, work, layout):
    return loss_sum * layout.cp_size


def _last_rank(layout) -> bool:
    return layout.cp_rank == layout.cp_size - 1


def _one_rank_loss_scale(loss_sum, per_token_loss, batch, count, work, layout):
    return loss_sum * (1 + 3e-5) if _last_rank(layout) else loss_sum


def _one_token_weight(loss_sum, per_token_loss, batch: PackedBatch, count, work, layout):
    if not _last_rank(layout):
        return loss_sum
    predicted = torch.nonzero(batch.loss_mask > 0)
    if predicted.numel() == 0:
        return loss_sum
    return loss_sum + 5e-2 * per_token_loss.float()[predicted[0, 0]]


def _mtp_no_loss_mask(kwargs: dict, batch) -> dict:
    kwargs.pop("loss_mask", None)
    return kwargs


def _mtp_roll_real_offsets(kwargs: dict, batch) -> dict:
    from recipe.model.gpt import packed_seq_params

    kwargs["packed_seq_params"] = packed_seq_params(batch, "real")
    return kwargs


def _mtp_local_counts(global_counts, local_counts, layout):
    return local_counts * (layout.dp_size * layout.cp_size)


def _round_weights(model) -> None:
    with torch.no_grad():
        for param in model.parameters():
            bits = param.data.view(torch.int32)
            bits.copy_(bits & ~0x7F)  # drop the 7 lowest mantissa bits: 2^-17 relative


CATALOGUE: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant(
            "prefix_positions",
            "verl before PR #6267: the back chunk's position_ids off by one on rank 0 and wrong "
            "on rank 1 (preprocess_thd_no_padding, verl 0.7.1)",
            "local",
            local=_prefix_positions,
        ),
        Mutant(
            "local_arange_positions",
            "position_ids built after the split as arange(local length) (ring-attention "
            "integrations that shard input_ids and make positions per rank)",
            "local",
            local=_local_arange_positions,
        ),
        Mutant(
            "chunk_local_positions",
            "positions restarted at 0 in each zigzag chunk (per-chunk arange, the contiguous "
            "split's formula applied to zigzag chunks)",
            "local",
            local=_chunk_local_positions,
        ),
        Mutant(
            "position_ids_contiguous",
            "position_ids split contiguously while the tokens are split zigzag (Megatron-LM's "
            "get_batch_on_this_cp_rank applied to one tensor but not another)",
            "local",
            local=_contiguous_field("position_ids"),
        ),
        Mutant(
            "labels_rolled_after_split",
            "labels made by rolling each rank's local input_ids (the shift done after the CP "
            "split: each chunk's last token predicts the next chunk's first)",
            "local",
            local=_labels_rolled_after_split,
        ),
        Mutant(
            "back_chunk_label_off_by_one",
            "the back chunk's labels one slot late (the remain_start off-by-one of PR #6267, "
            "on labels)",
            "local",
            local=_back_chunk_label_off_by_one,
        ),
        Mutant(
            "labels_contiguous",
            "labels split contiguously while the tokens are split zigzag",
            "local",
            local=_contiguous_field("labels"),
        ),
        Mutant(
            "loss_mask_contiguous",
            "the loss mask not sharded with the tokens (split contiguously: the same global "
            "count, on the wrong slots)",
            "local",
            local=_contiguous_field("loss_mask"),
        ),
        Mutant(
            "mtp_mask_contiguous",
            "the MTP mask not sharded with the tokens (split contiguously)",
            "local",
            local=_contiguous_field("mtp_mask"),
        ),
        Mutant(
            "swapped_zigzag_chunks_last_rank",
            "one rank's two zigzag chunks in swapped order (a chunk index of 2*cp-1-r taken "
            "as r), every per-token tensor alike",
            "local",
            local=_swapped_chunks_last_rank,
        ),
        Mutant(
            "padding_in_loss",
            "the loss summed over padding slots too (an unmasked sum over the padded stream; "
            "the padding differs with cp)",
            "backward",
            backward=_padding_in_loss,
        ),
        Mutant(
            "rank_local_loss",
            "each rank's loss divided by its own token count, gradients averaged over ranks "
            "(megatron-core with calculate_per_token_loss=False; verl's early CP loss)",
            "backward",
            backward=_rank_local_loss,
        ),
        Mutant(
            "loss_scaled_by_cp",
            "the loss multiplied by the CP size (a cp_size factor applied twice)",
            "backward",
            backward=_loss_scaled_by_cp,
        ),
        Mutant(
            "one_rank_loss_scale_3e-5",
            "one rank's loss scale 3e-5 off (a per-rank loss-scale drift; a small-effect mutant)",
            "backward",
            backward=_one_rank_loss_scale,
        ),
        Mutant(
            "one_token_weight_5e-2",
            "one token per micro-batch of one rank weighted 1.05 (a boundary token counted "
            "with a wrong weight; a small-effect mutant)",
            "backward",
            backward=_one_token_weight,
        ),
        Mutant(
            "mtp_no_loss_mask",
            "the MTP block not given the loss mask (megatron then rolls an all-ones mask: "
            "padding predicted, verl before it passed loss_mask)",
            "model_call",
            model_call=_mtp_no_loss_mask,
        ),
        Mutant(
            "mtp_roll_real_offsets",
            "the MTP roll on real offsets in cu_seqlens_q (megatron's roll_tensor reads "
            "cu_seqlens_q; Megatron-Bridge passes real ones)",
            "model_call",
            model_call=_mtp_roll_real_offsets,
        ),
        Mutant(
            "mtp_local_counts",
            "the MTP loss weighted by each rank's local counts (Megatron-LM PR #3159's local "
            "original_num_tokens / num_tokens ratio)",
            "mtp_counts",
            mtp_counts=_mtp_local_counts,
        ),
        Mutant(
            "norm_grads_not_reduced_over_cp",
            "the norms' gradients not reduced over CP (a parameter group left out of the "
            "data x context-parallel gradient group)",
            "gradients",
            unreduced=lambda name: "layernorm" in name or "final_norm" in name,
        ),
        Mutant(
            "position_embedding_grad_not_reduced",
            "the position embedding outside the gradient group (megatron's MTP copy of it at "
            "pp > 1 is summed with no other copy)",
            "gradients",
            unreduced=lambda name: "position_embeddings" in name,
        ),
        Mutant(
            "mtp_grads_not_reduced",
            "the MTP block's gradients not reduced over CP",
            "gradients",
            # a vision model's language model holds it one level down: language_model.mtp.
            unreduced=lambda name: ".mtp." in f".{name}",
        ),
        Mutant(
            "weights_rounded_to_16_bits",
            "the weights reloaded at reduced precision once (a checkpoint written with a "
            "16-bit mantissa; a small-effect mutant, 2^-17 relative)",
            "weights",
            weights=_round_weights,
        ),
    )
}


def mutant_named(name: str) -> Mutant | None:
    """The catalogue's mutant (None for `none`)."""
    return None if name == "none" else CATALOGUE[name]


def active_mutant(cfg, step: int) -> Mutant | None:
    """The mutant this step runs with: none before its onset."""
    if step < cfg.mutant.onset:
        return None
    return mutant_named(cfg.mutant.name)


def step_local_count(work) -> float:
    """This rank's loss-masked token count over the step's micro-batches."""
    return float(sum(float(b.loss_mask.sum()) for b in work.micro_batches))


assert set(CATALOGUE) == set(MUTANTS) - {"none"}, "recipe.names.MUTANTS lists the catalogue"


class LocalGradients:
    """The gradients of the parameters a `gradients` mutant names, as this rank computed them,
    put back after the reduction over ranks: those parameters are left out of it."""

    def __init__(self, model, mutant: Mutant):
        self.params = [p for n, p in model.named_parameters() if mutant.unreduced(n)]
        self.kept: list[torch.Tensor] = []

    def keep(self, attr: str) -> None:
        self.kept = [getattr(p, attr).detach().clone() for p in self.params]

    def restore(self, attr: str, divisor: float = 1.0) -> None:
        with torch.no_grad():
            for param, kept in zip(self.params, self.kept):
                getattr(param, attr).copy_(kept / divisor)


def wrap_reduction(engine, model, mutant: Mutant, work):
    """Leave the mutant's parameters out of this step's gradient reduction on `engine`; returns
    the function that undoes the wrapping (called after the step's reduction)."""
    local = LocalGradients(model, mutant)
    if engine.name == "reference":  # gradients in .grad, reduced by reduce_gradients
        reduce = engine.reduce_gradients

        def reduce_leaving_out():
            local.keep("grad")
            reduce()
            local.restore("grad")

        engine.reduce_gradients = reduce_leaving_out
        return lambda: setattr(engine, "reduce_gradients", reduce)
    # megatron's DDP: main_grad, reduced and divided inside finalize_model_grads
    config = model.config
    finalize = config.finalize_model_grads_func
    divisor = engine.gradient_divisor(work)

    def finalize_leaving_out(*args, **kwargs):
        local.keep("main_grad")
        result = finalize(*args, **kwargs)
        local.restore("main_grad", divisor)
        return result

    config.finalize_model_grads_func = finalize_leaving_out
    return lambda: setattr(config, "finalize_model_grads_func", finalize)
