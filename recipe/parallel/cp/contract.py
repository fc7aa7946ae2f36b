"""The contract of a CP preprocessing function, its ground truth, and a check of anyone's function.

A preprocessing function turns the sequences of one packed micro-batch into one CP rank's
per-token tensors:

    fn(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1)
        -> (input_ids, position_ids)  or  {"input_ids": ..., "position_ids": ..., "labels": ...,
                                           "loss_mask": ...}   (any of these keys)

- `sequences`: one 1-D int64 tensor per sequence, its real tokens (no padding);
- `cu_seqlens_padded`: int32 [n+1], each sequence padded to a multiple of 2 * cp_size * tp_size;
- the result holds this rank's cu_seqlens_padded[-1] / cp_size local slots, in zigzag order:
  chunks r and 2*cp-1-r of every sequence, each sequence's slots at cu_seqlens_padded[i] / cp.

The ground truth is the global packed stream (tokens, positions 0.. per sequence, labels = the next
token of the same sequence, loss_mask = 1 where such a label exists) selected with the zigzag index
(`zigzag.zigzag_index`, checked against verl's own function). input_ids and position_ids are
compared on real tokens (what a function writes into padding is its own business), labels where
the loss mask is 1, loss_mask on every slot (padding counted as real is a bug).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from recipe.config.preprocess import FUNCTION, parse_preprocess
from recipe.data.packing import PackedBatch, pack_sequences
from recipe.names import CP_PREPROCESS
from recipe.parallel.cp.zigzag import zigzag_index

FIELDS = ("input_ids", "position_ids", "labels", "loss_mask")
PAD_ID = 0


class ContractError(ValueError):
    """A preprocessing function's output has the wrong shape or type for the contract."""


@dataclass(frozen=True)
class LoadedPreprocess:
    """A function `cp.preprocess` names from outside the recipe, loaded once per process."""

    train: Callable
    """What training calls on this rank (a release reads megatron's real parallel state)."""
    check: Callable
    """The same function with one process playing every rank (the check against the index)."""
    checker: str
    """The command that finds a minimal failing case of it."""


@dataclass(frozen=True)
class Mismatch:
    """The first slot where a function's output differs from the ground truth."""

    lengths: tuple[int, ...]
    cp_size: int
    tp_size: int
    cp_rank: int
    field: str
    slot: int
    sequence: int
    position: int
    chunk: int
    expected: float
    got: float
    note: str = ""

    def describe(self) -> str:
        if self.note:
            return (
                f"lengths={list(self.lengths)} cp={self.cp_size} tp={self.tp_size}: rank "
                f"{self.cp_rank}: {self.note}"
            )
        half = "front" if self.chunk < self.cp_size else "back"
        return (
            f"lengths={list(self.lengths)} cp={self.cp_size} tp={self.tp_size}: rank "
            f"{self.cp_rank}, local slot {self.slot} (sequence {self.sequence}, position "
            f"{self.position}, chunk {self.chunk} = {half}): {self.field} expected "
            f"{shown_number(self.expected)}, got {shown_number(self.got)}"
        )


def shown_number(value: float):
    return int(value) if float(value).is_integer() else value


def load_function(spec: str) -> Callable:
    """A built-in name (index, verl_fixed, verl_legacy) or `package.module:function` whose
    signature takes the contract's arguments (ValueError naming the problem otherwise)."""
    parsed = parse_preprocess(spec)
    if parsed.built_in:
        return built_in(spec)
    module_name, attr = parsed.module_and_function
    if parsed.kind != FUNCTION or not module_name or not attr:
        raise ValueError(
            f"{spec!r} is neither a built-in ({', '.join(CP_PREPROCESS)}) nor "
            "package.module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name} for {spec}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {attr} (from {spec})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a readable signature: the first call will tell
    try:
        signature.bind([], None, 2, 0)
    except TypeError as err:
        raise ValueError(
            f"takes {signature}, which cannot be called as fn(sequences, cu_seqlens_padded, "
            f"cp_size, cp_rank, tp_size=1) ({err}); the contract is in "
            "recipe/parallel/cp/contract.py"
        ) from None
    return fn


def built_in(name: str) -> Callable:
    """The recipe's own preprocessing variants with the contract's interface."""
    from recipe.parallel.cp.verl import verl_preprocess

    if name == "index":
        return index_preprocess
    return lambda sequences, cu, cp_size, cp_rank, tp_size=1: verl_preprocess(
        sequences, cu, cp_size, cp_rank, variant=name, tp_size=tp_size
    )


def index_preprocess(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1) -> dict:
    """The recipe's own path as a contract function: one zigzag index over the packed stream."""
    batch = global_batch([s.tolist() for s in sequences], cp_size, tp_size)
    index = zigzag_index(batch.cu_seqlens_padded, cp_size, cp_rank)
    return {name: getattr(batch, name).index_select(0, index) for name in FIELDS}


def global_batch(sequences: list[list[int]], cp_size: int, tp_size: int) -> PackedBatch:
    return pack_sequences(sequences, 2 * cp_size * tp_size, PAD_ID)


LAYOUT_KEY = "cu_seqlens_padded"


def call(fn: Callable, sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size) -> dict:
    """Call `fn` per the contract and return its output as {field: tensor}.

    A function that chooses its own padding (upstream ones do: fp8 alignment, length buckets,
    minimum rows) returns its global `cu_seqlens_padded` beside the fields; this rank's slots are
    then laid out on those boundaries instead of the ones it was given.
    """
    kwargs = {"tp_size": tp_size} if _takes_tp_size(fn) else {}
    out = fn([torch.as_tensor(s) for s in sequences], cu_seqlens_padded, cp_size, cp_rank, **kwargs)
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ContractError(
                f"returned a tuple of {len(out)}; the contract is (input_ids, "
                "position_ids) or a dict"
            )
        out = {"input_ids": out[0], "position_ids": out[1]}
    if not isinstance(out, dict) or not set(out) - {LAYOUT_KEY} or set(out) - {*FIELDS, LAYOUT_KEY}:
        raise ContractError(
            f"returned {type(out).__name__} {sorted(out) if isinstance(out, dict) else ''}; the "
            f"contract is (input_ids, position_ids) or a dict with keys among {', '.join(FIELDS)}"
        )
    out = dict(out)
    layout = out.pop(LAYOUT_KEY, cu_seqlens_padded)
    expected = int(layout[-1]) // cp_size
    for name, value in out.items():
        if not isinstance(value, Tensor) or value.dim() != 1 or value.numel() != expected:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ContractError(
                f"{name} has shape {shape}; this rank holds {expected} slots "
                f"(cu_seqlens_padded[-1] / cp_size)"
            )
    out[LAYOUT_KEY] = torch.as_tensor(layout).to(torch.int64).cpu()
    return out


def _takes_tp_size(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "tp_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _stream(sequences: list[list[int]], cu: Tensor) -> dict[str, Tensor]:
    """The ground truth on every global slot of the boundaries `cu`: token, position, next-token
    label, loss mask, whether the slot holds a real token, and its sequence."""
    slots = torch.arange(int(cu[-1]))
    # searchsorted, not repeat_interleave: the latter costs milliseconds a call on CPU, and the
    # checker calls this for every rank of thousands of cases
    seq_of_slot = torch.searchsorted(cu[1:].contiguous(), slots, right=True)
    position = slots - cu[seq_of_slot]
    real_len = torch.tensor([len(s) for s in sequences])[seq_of_slot]
    tokens = torch.zeros(int(cu[-1]), dtype=torch.int64)
    labels = torch.zeros(int(cu[-1]), dtype=torch.int64)
    for i, seq in enumerate(sequences):
        start = int(cu[i])
        tokens[start : start + len(seq)] = torch.tensor(seq)
        labels[start : start + len(seq) - 1] = torch.tensor(seq[1:], dtype=torch.int64)
    return {
        "input_ids": tokens,
        "position_ids": position,
        "labels": labels,
        "loss_mask": (position + 1 < real_len).to(torch.int64),
        "real": position < real_len,
        "sequence": seq_of_slot,
    }


def _layout_problem(lengths: list[int], cu: Tensor, cp_size: int, tp_size: int = 1) -> str | None:
    """Why boundaries returned by a function cannot hold these sequences in zigzag CP, or None."""
    if cu.dim() != 1 or cu.numel() != len(lengths) + 1 or int(cu[0]) != 0:
        return f"cu_seqlens_padded {cu.tolist()} does not describe {len(lengths)} sequences"
    for i, (padded, real) in enumerate(zip(cu.diff().tolist(), lengths)):
        if padded < real:
            return f"sequence {i} has {real} tokens but a padded length of {padded}"
        if cp_size > 1 and padded % (2 * cp_size):
            return (
                f"sequence {i}'s padded length {padded} is not a multiple of 2*cp={2 * cp_size}: "
                "the zigzag chunks of megatron's CP attention cannot split it (and the function "
                "leaves rows of it on no rank)"
            )
    local = int(cu[-1]) // max(cp_size, 1)
    if tp_size > 1 and local % tp_size:
        return (
            f"each CP rank holds {local} slots, not a multiple of tp={tp_size}: sequence "
            "parallelism cannot scatter them evenly over the tensor-parallel ranks (pad each "
            f"sequence to a multiple of 2*cp*tp={2 * cp_size * tp_size})"
        )
    return None


def unique_sequences(lengths: list[int]) -> list[list[int]]:
    """Sequences of these lengths whose token ids are unique over the batch (0 is padding): how
    the contract's checks, and the plugins that call a function on a case, draw its tokens."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


def rank_mismatch(
    lengths: list[int],
    sequences: list[list[int]],
    got: dict,
    cp_size: int,
    tp_size: int,
    rank: int,
    sequence_parallel: bool = True,
) -> Mismatch | None:
    """The first slot of one rank's output (`call`'s dict) that differs from the ground truth."""
    got = dict(got)
    cu = got.pop(LAYOUT_KEY)
    problem = _layout_problem(lengths, cu, cp_size, tp_size if sequence_parallel else 1)
    if problem is not None:
        return Mismatch(tuple(lengths), cp_size, tp_size, rank, LAYOUT_KEY, -1, -1, -1, -1,
                        0, 0, note=problem)  # fmt: skip
    truth = _stream(sequences, cu)
    index = zigzag_index(cu, cp_size, rank)
    checked = {
        "input_ids": truth["real"][index],
        "position_ids": truth["real"][index],
        "labels": truth["loss_mask"][index] > 0,
        "loss_mask": torch.ones(index.numel(), dtype=torch.bool),
    }
    for name in FIELDS:
        if name not in got:
            continue
        want = truth[name].index_select(0, index).double()
        have = got[name].double().cpu()
        wrong = checked[name] & (want != have)
        if bool(wrong.any()):
            slot = int(wrong.nonzero()[0])
            g = int(index[slot])
            seq = int(truth["sequence"][g])
            position = g - int(cu[seq])
            chunk = position // (int(cu[seq + 1] - cu[seq]) // (2 * cp_size))
            return Mismatch(
                tuple(lengths),
                cp_size,
                tp_size,
                rank,
                name,
                slot,
                seq,
                position,
                chunk,
                float(want[slot]),
                float(have[slot]),
            )
    return None


def first_mismatch(
    fn: Callable, lengths: list[int], cp_size: int, tp_size: int = 1
) -> Mismatch | None:
    """Run `fn` on every rank of one micro-batch of sequences with these lengths; the first slot
    that differs from the ground truth, or None. Token ids are unique per slot, so a token in the
    wrong place cannot match by accident."""
    sequences = unique_sequences(lengths)
    cu_given = global_batch(sequences, cp_size, tp_size).cu_seqlens_padded
    for rank in range(cp_size):
        got = call(fn, sequences, cu_given, cp_size, rank, tp_size)
        mismatch = rank_mismatch(lengths, sequences, got, cp_size, tp_size, rank)
        if mismatch is not None:
            return mismatch
    return None


def check_batch(fn: Callable, batch: PackedBatch, cp_size: int, tp_size: int) -> Mismatch | None:
    """`first_mismatch` on the lengths of a real micro-batch (for a training run's first steps)."""
    return first_mismatch(fn, batch.cu_seqlens.diff().tolist(), cp_size, tp_size)
