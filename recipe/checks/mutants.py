"""A mutation score for the CP preprocessing checker: broken copies of the zigzag contract
function, each with one bug modelled on a pattern found in (or reported against) upstream code,
and `score`, which runs the checker's own search on each of them.

A checker that passes the right functions proves little until it is seen to fail the wrong ones:
the share of these mutants it catches, each shrunk to a minimal case, is that proof. Every mutant
keeps the contract's interface (`recipe/parallel/cp/contract.py`) and changes exactly one thing of
the correct function; `python -m recipe.check_preprocess --mutants` prints the score.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from recipe.checks.assess import micro_batches
from recipe.checks.search import search
from recipe.data.packing import PackedBatch, pack_sequences
from recipe.data.thd import aligned_length, cu_seqlens_from_lengths
from recipe.parallel.cp.contract import (
    FIELDS,
    LAYOUT_KEY,
    PAD_ID,
    ContractError,
    Mismatch,
    first_mismatch,
    global_batch,
    index_preprocess,
)
from recipe.parallel.cp.verl import verl_preprocess
from recipe.parallel.cp.zigzag import real_token_mask, zigzag_index


@dataclass(frozen=True)
class Mutant:
    name: str
    pattern: str
    """One line: the bug and, where it applies, the library and release that had it."""
    function: Callable


_CATALOGUE: list[Mutant] = []


def _mutant(pattern: str):
    def register(fn: Callable) -> Callable:
        _CATALOGUE.append(Mutant(fn.__name__, pattern, fn))
        return fn

    return register


# --- shared pieces: the correct global stream and ways to select from it ---------------------


def _batch(sequences: Sequence[Tensor], cp: int, tp: int) -> PackedBatch:
    return global_batch([s.tolist() for s in sequences], cp, tp)


def _take(batch: PackedBatch, index: Tensor) -> dict[str, Tensor]:
    """Every field at these global slots; -1 selects a padding slot (0 in every field), which is
    what a function leaves in slots it never writes."""
    return {
        name: torch.cat([getattr(batch, name), getattr(batch, name).new_zeros(1)])[index]
        for name in FIELDS
    }


def _chunk_index(cu: Tensor, cp: int, chunks, shifts=(0, 0)) -> Tensor:
    """The global slots of `chunks` (chunk numbers, None for unwritten slots) of every sequence,
    in local order, each chunk's start moved by its shift; a slot past the stream is -1."""
    total = int(cu[-1])
    parts = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        size = (end - start) // (2 * cp)
        for chunk, shift in zip(chunks, shifts):
            if chunk is None:
                parts.append(torch.full((size,), -1))
            else:
                low = start + chunk * size + shift
                parts.append(torch.arange(low, low + size))
    index = torch.cat(parts)
    return torch.where(index < total, index, -1)


def _zigzag(cp: int, rank: int) -> list[int]:
    return [rank, 2 * cp - 1 - rank]


def _select(batch: PackedBatch, cp: int, rank: int) -> dict[str, Tensor]:
    return _take(batch, zigzag_index(batch.cu_seqlens_padded, cp, rank))


def _real(batch: PackedBatch) -> Tensor:
    return batch.position_ids < batch.tokens_per_sequence_length()


def _placed(out: dict[str, Tensor], cu: Tensor, cp: int, starts: list[int]) -> dict[str, Tensor]:
    """The rank's per-sequence local slices moved to `starts`, written in sequence order into a
    buffer of the contract's size (a later sequence overwrites an earlier one, as in a loop)."""
    size = int(cu[-1]) // cp
    placed = {name: torch.zeros_like(value) for name, value in out.items()}
    given = (cu[:-1] // cp).tolist()
    for old, new, n in zip(given, starts, (cu.diff() // cp).tolist()):
        fit = max(0, min(n, size - new))
        for name, value in out.items():
            placed[name][new : new + fit] = value[old : old + fit]
    return placed


def _rows(batch: PackedBatch, cp: int, rank: int) -> dict[str, Tensor]:
    """Zigzag by whole rows on whatever boundaries the batch has (a chunk is padded // 2cp rows;
    rows left over are on no rank), returned with those boundaries: a function choosing its own
    padding, as verl 0.9.1's preprocess_thd_engine does."""
    cu = batch.cu_seqlens_padded
    parts = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        size = (end - start) // (2 * cp)
        for chunk in _zigzag(cp, rank):
            parts.append(torch.arange(start + chunk * size, start + (chunk + 1) * size))
        parts.append(torch.full(((end - start) // cp - 2 * size,), -1))
    return {**_take(batch, torch.cat(parts)), LAYOUT_KEY: cu}


def _sliced(data: Sequence[Tensor], layout: list[int], cp: int, rank: int, whole_front: bool):
    """verl's per-sequence slicing of input_ids: chunks rank and 2cp-1-rank of each sequence's
    data written at its local offset. Each slice writes what it reads, unless `whole_front`: then
    the front slice fills its whole chunk, right only when the data reaches the padded length."""
    ids = torch.zeros(layout[-1] // cp, dtype=torch.int64)
    for seq, start, end in zip(data, layout[:-1], layout[1:]):
        half = (end - start) // (2 * cp)
        local = start // cp
        for slot, chunk in ((local, rank), (local + half, 2 * cp - 1 - rank)):
            piece = seq[chunk * half : (chunk + 1) * half]
            width = half if whole_front and chunk == rank else piece.numel()
            ids[slot : slot + width] = piece
    return ids


def _padded_to(seq: Tensor, length: int) -> Tensor:
    return torch.cat([seq, seq.new_zeros(max(0, length - seq.numel()))])


# --- which slots a rank holds ----------------------------------------------------------------


@_mutant("rank order reversed: rank r takes rank cp-1-r's shard (a CP group built from a "
         "reversed rank list)")  # fmt: skip
def rank_order_reversed(sequences, cu, cp, rank, tp_size=1):
    return index_preprocess(sequences, cu, cp, cp - 1 - rank, tp_size)


@_mutant("cp rank ignored: every rank takes rank 0's shard (the rank read from the wrong "
         "process group)")  # fmt: skip
def cp_rank_ignored(sequences, cu, cp, rank, tp_size=1):
    return index_preprocess(sequences, cu, cp, 0, tp_size)


@_mutant("chunks swapped on the last rank: it lays out its back chunk before its front chunk")
def swapped_chunks_on_last_rank(sequences, cu, cp, rank, tp_size=1):
    chunks = _zigzag(cp, rank)
    if rank == cp - 1:
        chunks.reverse()
    return _take(_batch(sequences, cp, tp_size), _chunk_index(cu, cp, chunks))


@_mutant("off-by-one chunk index: the back chunk is 2*cp-2-r instead of 2*cp-1-r")
def back_chunk_off_by_one(sequences, cu, cp, rank, tp_size=1):
    return _take(_batch(sequences, cp, tp_size), _chunk_index(cu, cp, [rank, 2 * cp - 2 - rank]))


@_mutant("front chunk only: the back half of the zigzag is never written")
def front_chunk_only(sequences, cu, cp, rank, tp_size=1):
    return _take(_batch(sequences, cp, tp_size), _chunk_index(cu, cp, [rank, None]))


@_mutant("contiguous split: rank r holds chunks 2r and 2r+1 (cp_partition_mode contiguous fed "
         "to zigzag ring attention)")  # fmt: skip
def contiguous_split(sequences, cu, cp, rank, tp_size=1):
    return _take(_batch(sequences, cp, tp_size), _chunk_index(cu, cp, [2 * rank, 2 * rank + 1]))


@_mutant("duplicate token: the back slice starts one row early (remain_start - 1), repeating "
         "the previous chunk's last token")  # fmt: skip
def back_slice_one_row_early(sequences, cu, cp, rank, tp_size=1):
    index = _chunk_index(cu, cp, _zigzag(cp, rank), shifts=(0, -1))
    return _take(_batch(sequences, cp, tp_size), index)


@_mutant("the back slice starts one row late (remain_start + 1: check_upstream's --control)")
def back_slice_one_row_late(sequences, cu, cp, rank, tp_size=1):
    index = _chunk_index(cu, cp, _zigzag(cp, rank), shifts=(0, 1))
    return _take(_batch(sequences, cp, tp_size), index)


@_mutant("chunk starts from the real length (ceil(len/2cp)) instead of the padded one: right "
         "while the padding is under one chunk")  # fmt: skip
def chunk_size_from_real_length(sequences, cu, cp, rank, tp_size=1):
    parts = []
    for seq, start, end in zip(sequences, cu[:-1].tolist(), cu[1:].tolist()):
        size, real_size = (end - start) // (2 * cp), math.ceil(seq.numel() / (2 * cp))
        for chunk in _zigzag(cp, rank):
            parts.append(torch.arange(start + chunk * real_size, start + chunk * real_size + size))
    return _take(_batch(sequences, cp, tp_size), torch.cat(parts))


@_mutant("sequences reordered by length (a length bucket) and not restored: each slot range "
         "holds another sequence")  # fmt: skip
def sequences_sorted_by_length(sequences, cu, cp, rank, tp_size=1):
    ordered = sorted(sequences, key=lambda s: -s.numel())
    return _select(_batch(ordered, cp, tp_size), cp, rank)


@_mutant("last sequence dropped: the loop runs over range(len(cu_seqlens) - 2)")
def last_sequence_dropped(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    for value in out.values():
        value[int(cu[-2]) // cp :] = 0
    return out


# --- the local offset of each sequence ------------------------------------------------------


@_mutant("unpadded (real) offsets where padded ones are needed: local slots at cu_seqlens // cp "
         "(megatron-core 0.19.2 roll_tensor with cu_seqlens_q real)")  # fmt: skip
def real_offsets_for_local_slots(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    real = cu_seqlens_from_lengths(torch.tensor([s.numel() for s in sequences]))
    return _placed(out, cu, cp, (real[:-1] // cp).tolist())


@_mutant("per-rank token counts used as offsets: each sequence starts after the real tokens "
         "this rank holds of the ones before")  # fmt: skip
def per_rank_token_count_offsets(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    real = cu_seqlens_from_lengths(torch.tensor([s.numel() for s in sequences]))
    held = real_token_mask(real, cu, cp, rank).to(torch.int64)
    counts = [int(part.sum()) for part in held.split((cu.diff() // cp).tolist())]
    return _placed(out, cu, cp, [0, *torch.tensor(counts).cumsum(0)[:-1].tolist()])


@_mutant("cu_seqlens offset divided by cp before padding: local length round_up(len // cp, 2*tp)")
def cu_offset_divided_before_padding(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    local = [aligned_length(s.numel() // cp, 2 * tp_size) for s in sequences]
    return _placed(out, cu, cp, [0, *torch.tensor(local).cumsum(0)[:-1].tolist()])


# --- padding and alignment --------------------------------------------------------------------


@_mutant("tp ignored in alignment: each sequence padded to 2*cp, not 2*cp*tp (the layout is "
         "returned)")  # fmt: skip
def tp_ignored_in_alignment(sequences, cu, cp, rank, tp_size=1):
    return _rows(pack_sequences([s.tolist() for s in sequences], 2 * cp, PAD_ID), cp, rank)


@_mutant("alignment without the factor 2: padded to cp*tp, so zigzag chunks are not whole rows "
         "(verl 0.9.1 lcm(pad_to_length_bucket, cp) / cp*min_local_rows)")  # fmt: skip
def alignment_without_factor_2(sequences, cu, cp, rank, tp_size=1):
    return _rows(pack_sequences([s.tolist() for s in sequences], cp * tp_size, PAD_ID), cp, rank)


@_mutant("sequences not padded: the real cu_seqlens used as the layout (THD without CP padding)")
def sequences_not_padded(sequences, cu, cp, rank, tp_size=1):
    real = cu_seqlens_from_lengths(torch.tensor([s.numel() for s in sequences]))
    share = int(real[-1]) // cp
    ids = torch.cat(list(sequences))[rank * share : (rank + 1) * share]
    return {"input_ids": ids, LAYOUT_KEY: real}


@_mutant("own padding not returned: sequences padded to lcm(16, 2*cp*tp) for fp8 without "
         "returning cu_seqlens_padded")  # fmt: skip
def own_padding_not_returned(sequences, cu, cp, rank, tp_size=1):
    alignment = math.lcm(16, 2 * cp * tp_size)
    batch = pack_sequences([s.tolist() for s in sequences], alignment, PAD_ID)
    return _select(batch, cp, rank)


@_mutant("fp8 padding lcm(16, 2*cp*tp) on the last sequence only, its tokens padded to 2*cp*tp "
         "alone (verl 0.7.1/0.8.0 use_fp8_padding)")  # fmt: skip
def fp8_padding_last_sequence_only(sequences, cu, cp, rank, tp_size=1):
    alignment = 2 * cp * tp_size
    padded = [aligned_length(s.numel(), alignment) for s in sequences]
    padded[-1] = aligned_length(padded[-1], math.lcm(16, alignment))
    layout = cu_seqlens_from_lengths(torch.tensor(padded))
    # Whole chunks are right when each sequence's data reaches its padded length; the last one's
    # stops at the 2*cp*tp alignment.
    data = [_padded_to(s, aligned_length(s.numel(), alignment)) for s in sequences]
    return {"input_ids": _sliced(data, layout.tolist(), cp, rank, True), LAYOUT_KEY: layout}


@_mutant("unclamped front slice: d[half*r : half*(r+1)] written as a whole chunk past the real "
         "tokens (verl 0.7.1 / Megatron-Bridge 0.6.2 preprocess_packed_seqs)")  # fmt: skip
def unclamped_front_slice(sequences, cu, cp, rank, tp_size=1):
    return {"input_ids": _sliced(list(sequences), cu.tolist(), cp, rank, whole_front=True)}


@_mutant("padding at the front: real tokens placed at the end of their padded slots (a "
         "left-padded batch read as right-padded)")  # fmt: skip
def padding_at_front(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    ids = torch.zeros_like(batch.input_ids)
    for seq, end in zip(sequences, cu[1:].tolist()):
        ids[end - seq.numel() : end] = seq
    return _select(batch.replace(input_ids=ids), cp, rank)


@_mutant("integer (0/1) attention mask used as an index: input_ids[i, mask[i]] gathers rows 0/1 "
         "(verl 0.8.0/0.9.1, Megatron-Bridge 0.6.2 exaone45 mask_dtype=int64)")  # fmt: skip
def integer_mask_as_index(sequences, cu, cp, rank, tp_size=1):
    width = max(s.numel() for s in sequences)
    rows = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros(len(sequences), width, dtype=torch.int64)
    for i, seq in enumerate(sequences):
        rows[i, : seq.numel()] = seq
        mask[i, : seq.numel()] = 1
    tokens = [rows[i, mask[i]][: seq.numel()] for i, seq in enumerate(sequences)]
    return index_preprocess(tokens, cu, cp, rank, tp_size)


# --- position_ids -----------------------------------------------------------------------------


@_mutant("back-chunk positions numbered from the padded end (verl 0.7.1, before PR #6267)")
def back_positions_from_padded_end(sequences, cu, cp, rank, tp_size=1):
    return verl_preprocess(sequences, cu, cp, rank, variant="verl_legacy", tp_size=tp_size)


@_mutant("back-chunk positions one too early (an off-by-one in remain_start)")
def off_by_one_back_positions(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    back = _chunk_index(cu, cp, [None, 0]) >= 0  # the back half of every sequence's slots
    out["position_ids"] = torch.where(back, out["position_ids"] - 1, out["position_ids"])
    return out


@_mutant("positions restarting per chunk: each zigzag chunk numbered from 0")
def positions_restart_per_chunk(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    chunk = torch.repeat_interleave(cu.diff() // (2 * cp), cu.diff() // cp)
    out["position_ids"] = out["position_ids"] % chunk
    return out


@_mutant("positions global, not per sequence: the packed stream numbered as one sequence")
def positions_global(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    out["position_ids"] = zigzag_index(cu, cp, rank)
    return out


@_mutant("positions made after sharding: each sequence's local slots numbered 0, 1, ...")
def positions_after_sharding(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    local = cu.diff() // cp
    starts = torch.repeat_interleave((cu[:-1] // cp).to(torch.int64), local)
    out["position_ids"] = torch.arange(starts.numel()) - starts
    return out


@_mutant("positions from 1 (a 1-based position offset, as HF models with padding_idx add)")
def positions_from_one(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    out["position_ids"] = out["position_ids"] + 1
    return out


# --- labels -----------------------------------------------------------------------------------


@_mutant("label roll done locally per rank: labels = roll(local input_ids, -1) (the local-roll "
         "MTP bug)")  # fmt: skip
def local_label_roll(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    out["labels"] = torch.roll(out["input_ids"], -1)
    return out


@_mutant("label roll across a document boundary: one roll over the packed stream, the loss "
         "mask the attention mask")  # fmt: skip
def label_roll_across_document_boundary(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    labels = torch.roll(batch.input_ids, -1)
    return _select(batch.replace(labels=labels, loss_mask=_real(batch).float()), cp, rank)


@_mutant("labels rolled within real offsets on the padded stream (megatron-core roll_tensor, "
         "cu_seqlens_q real: Megatron-LM #4494)")  # fmt: skip
def roll_with_real_offsets(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    labels = batch.input_ids.clone()
    real = batch.cu_seqlens.tolist()
    for start, end in zip(real[:-1], real[1:]):
        labels[start:end] = torch.roll(batch.input_ids[start:end], -1)
    return _select(batch.replace(labels=labels), cp, rank)


@_mutant("labels not shifted: labels = input_ids (a model that shifts inside, fed to one that "
         "does not)")  # fmt: skip
def labels_not_shifted(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    out["labels"] = out["input_ids"].clone()
    return out


@_mutant("labels shifted the wrong way: each token's label is the previous token")
def labels_shifted_backwards(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    return _select(batch.replace(labels=torch.roll(batch.input_ids, 1)), cp, rank)


# --- loss_mask --------------------------------------------------------------------------------


@_mutant("loss mask counting padding: padding slots get loss_mask 1")
def loss_mask_counts_padding(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    return _select(batch.replace(loss_mask=torch.where(_real(batch), batch.loss_mask, 1.0)), cp,
                   rank)  # fmt: skip


@_mutant("loss mask missing the last real target: [:-2] where [:-1] was meant")
def loss_mask_missing_last_real_token(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    lengths = batch.tokens_per_sequence_length()
    return _select(batch.replace(loss_mask=(batch.position_ids + 2 < lengths).float()), cp, rank)


@_mutant("loss mask on targets, not predictors: 1 on positions 1..len-1")
def loss_mask_on_targets(sequences, cu, cp, rank, tp_size=1):
    batch = _batch(sequences, cp, tp_size)
    mask = (batch.position_ids >= 1) & _real(batch)
    return _select(batch.replace(loss_mask=mask.float()), cp, rank)


@_mutant("per-rank token counts used for normalisation: loss_mask / this rank's count "
         "(Megatron-LM PR #3159's local MTP ratio, issue #7452)")  # fmt: skip
def loss_mask_normalised_per_rank(sequences, cu, cp, rank, tp_size=1):
    out = index_preprocess(sequences, cu, cp, rank, tp_size)
    out["loss_mask"] = out["loss_mask"] / out["loss_mask"].sum().clamp(min=1)
    return out


MUTANTS: tuple[Mutant, ...] = tuple(_CATALOGUE)


# --- the score --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """What the checker reports on one case: a mismatch, a contract breach or an exception."""

    lengths: tuple[int, ...]
    cp_size: int
    tp_size: int
    what: str
    mismatch: Mismatch | None = None
    raised: str | None = None
    """The exception's type name when the function raised (ContractError included)."""

    def describe(self) -> str:
        return self.what


def case_finding(fn: Callable, lengths, cp_size: int, tp_size: int) -> Finding | None:
    """`first_mismatch` on one case, a raise turned into a finding: a function that raises on a
    valid input is as wrong as one that answers wrongly, and as a value hypothesis shrinks it."""
    case = f"lengths={list(lengths)} cp={cp_size} tp={tp_size}"
    lengths = tuple(lengths)
    try:
        mismatch = first_mismatch(fn, list(lengths), cp_size, tp_size)
    except ContractError as err:
        return Finding(lengths, cp_size, tp_size, f"{case}: breaks the contract: {err}",
                       raised="ContractError")  # fmt: skip
    except Exception as err:  # noqa: BLE001 (raising on a valid input is the finding)
        first_line = str(err).splitlines()[0] if str(err) else ""
        return Finding(lengths, cp_size, tp_size,
                       f"{case}: raises {type(err).__name__}: {first_line}",
                       raised=type(err).__name__)  # fmt: skip
    if mismatch is None:
        return None
    return Finding(lengths, cp_size, tp_size, mismatch.describe(), mismatch=mismatch)


@dataclass(frozen=True)
class Score:
    mutant: Mutant
    finding: Finding | None
    """The minimal case the checker shrank it to, or None: the mutant passed every case."""
    cases: int
    """Cases run, shrinking included."""
    seconds: float

    @property
    def caught(self) -> bool:
        return self.finding is not None


def score_one(mutant: Mutant, cases: int = 100, seed: int = 0) -> Score:

    threads = torch.get_num_threads()
    # A case's tensors hold a few hundred slots: more threads only contend (4x slower on 2
    # loaded cores); benchmarks/proof_tools.py times the checker on one thread too.
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        finding, ran = search(micro_batches(), lambda case: case_finding(mutant.function, *case),
                              cases, seed)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return Score(mutant, finding, ran, time.perf_counter() - start)


def score(cases: int = 100, seed: int = 0, mutants: Sequence[Mutant] | None = None) -> list[Score]:
    """The checker's search on each mutant (the whole catalogue unless `mutants` is given)."""
    return [score_one(m, cases, seed) for m in (MUTANTS if mutants is None else mutants)]
