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

import enum
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
            f"{_number(self.expected)}, got {_number(self.got)}"
        )


def _number(value: float):
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


def _rank_mismatch(
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
        mismatch = _rank_mismatch(lengths, sequences, got, cp_size, tp_size, rank)
        if mismatch is not None:
            return mismatch
    return None


class Impact(enum.IntEnum):
    """What a finding costs a user, worst last: the order the checker searches up."""

    UNBALANCED = 0  # every token trains as it should; the ranks' attention work is uneven
    PADDING = 1  # only padding is laid out wrong: every real token trains as it should
    RAISES = 2  # the function raises on a valid input: training stops, loudly
    MISPLACED = 3  # a real token trains with a wrong position, label, loss weight or rank
    LOST = 4  # a real token is on no rank: it never trains

    @property
    def label(self) -> str:
        return IMPACT_LABELS[self]


IMPACT_LABELS = {
    Impact.UNBALANCED: "work unbalanced",
    Impact.PADDING: "padding only",
    Impact.RAISES: "raises",
    Impact.MISPLACED: "real tokens misplaced",
    Impact.LOST: "real tokens lost",
}


@dataclass(frozen=True)
class Assessment:
    """A finding on one micro-batch: its impact class and what the checker saw."""

    impact: Impact
    what: str


def _case(lengths, cp_size: int, tp_size: int) -> str:
    return f"lengths={list(lengths)} cp={cp_size} tp={tp_size}"


def _token_problem(
    sequences: list[list[int]], outputs: list[dict]
) -> tuple[Assessment | None, str | None]:
    """Every real token on a rank, with its own position, label and loss weight, trained once;
    padding never weighted. Reads the layout from nothing but the token ids, so it also judges
    boundaries that zigzag CP cannot split. (the problem or None, a note on harmless copies:
    a real token copied into padding slots with no loss weight, which no real query sees)."""
    where: dict[int, tuple[int, int]] = {}  # token id -> (sequence, position)
    for i, seq in enumerate(sequences):
        for p, token in enumerate(seq):
            where[token] = (i, p)
    copies: dict[int, list[tuple[int, int, dict]]] = {}  # token -> (rank, slot, its fields)
    for rank, tensors in enumerate(outputs):
        # plain lists: this loop visits every slot, and indexing a tensor per slot is slow
        got = {k: v.double().cpu().tolist() for k, v in tensors.items() if k in FIELDS}
        for slot, value in enumerate(got["input_ids"]):
            token = int(value)
            fields = {name: got[name][slot] for name in got}
            if token in where:
                copies.setdefault(token, []).append((rank, slot, fields))
            elif fields.get("loss_mask", 0) != 0:
                return Assessment(
                    Impact.MISPLACED,
                    f"rank {rank}, local slot {slot}: a padding slot (token {token}) has loss "
                    f"mask {_number(fields['loss_mask'])}: padding trains as a real token",
                ), None
    missing = [where[t] for t in where if t not in copies]
    if missing:
        listed = ", ".join(f"sequence {i} position {p}" for i, p in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        return Assessment(
            Impact.LOST,
            f"{len(missing)} of {len(where)} real tokens are on no rank ({listed}{more}): they "
            "never train",
        ), None
    note = None
    for token, found in copies.items():
        i, p = where[token]
        n = len(sequences[i])
        want = {"position_ids": p, "loss_mask": int(p + 1 < n)}
        if p + 1 < n:
            want["labels"] = sequences[i][p + 1]
        if len(found) > 1:
            weighted = [c for c in found if c[2].get("loss_mask", 1) != 0]
            ranks = [rank for rank, _, _ in found]
            if len(weighted) != want["loss_mask"]:
                return Assessment(
                    Impact.MISPLACED,
                    f"sequence {i} position {p} is on ranks {ranks}, {len(weighted)} of the "
                    f"copies weighted in the loss: it trains {len(weighted)} times",
                ), None
            note = note or (
                f"sequence {i} position {p} is copied to ranks {ranks}, the copies without "
                "loss weight"
            )
            found = weighted or found[:1]
        rank, slot, fields = found[0]
        for name, expected in want.items():
            if name in fields and fields[name] != expected:
                return Assessment(
                    Impact.MISPLACED,
                    f"rank {rank}, local slot {slot} (sequence {i}, position {p}): {name} "
                    f"expected {expected}, got {_number(fields[name])}",
                ), None
    return None, note


def assess(
    fn: Callable, lengths: list[int], cp_size: int, tp_size: int = 1, sequence_parallel: bool = True
) -> Assessment | None:
    """`first_mismatch` with the finding's impact: None when every rank matches the ground
    truth, else the worst thing the micro-batch shows (tokens lost over misplaced over a raise
    over padding laid out wrong) and where. With `sequence_parallel` (the recipe's way at tp > 1)
    each rank's slots must also split evenly over the tp ranks."""
    case = _case(lengths, cp_size, tp_size)
    sequences = unique_sequences(lengths)
    cu_given = global_batch(sequences, cp_size, tp_size).cu_seqlens_padded
    outputs = []
    try:
        for rank in range(cp_size):
            outputs.append(call(fn, sequences, cu_given, cp_size, rank, tp_size))
    except ContractError as err:
        return Assessment(Impact.MISPLACED, f"{case}: breaks the contract: {err}")
    except Exception as err:  # noqa: BLE001 (a function raising on a valid input is the finding)
        return Assessment(Impact.RAISES, f"{case}: rank {len(outputs)} raises "
                          f"{type(err).__name__}: {err}")  # fmt: skip
    copied = None
    if all("input_ids" in got for got in outputs):
        problem, copied = _token_problem(sequences, outputs)
        if problem is not None:
            return Assessment(problem.impact, f"{case}: {problem.what}")
    for rank, got in enumerate(outputs):
        mismatch = _rank_mismatch(
            lengths, sequences, got, cp_size, tp_size, rank, sequence_parallel
        )
        if mismatch is None:
            continue
        if mismatch.field == LAYOUT_KEY and all("input_ids" in got for got in outputs):
            # every real token sits on one rank with its position and label (checked above):
            # what zigzag cannot split is padding
            return Assessment(
                Impact.PADDING,
                f"{mismatch.describe()}; every real token is on one rank with its position and "
                "label, only padding rows are on no rank",
            )
        return Assessment(Impact.MISPLACED, mismatch.describe())
    if copied is not None:
        # the copies sit in padding slots (a copy in a real slot differs above); no real query
        # attends to a padding position of its own sequence, and none carries loss weight
        return Assessment(Impact.PADDING, f"{case}: {copied}")
    return None


def micro_batches(max_sequences: int = 12, max_length: int = 400, min_length: int = 1):
    """(lengths, cp, tp) of the micro-batches the checker draws (every sequence at least
    `min_length` tokens: a way past a finding on short sequences to what else there is)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw):
        cp = draw(st.sampled_from([2, 4, 8]))
        tp = draw(st.sampled_from([1, 2, 4]))
        unit = 2 * cp
        length = st.one_of(
            st.just(1),
            st.integers(1, unit - 1),
            st.tuples(st.integers(1, 6), st.sampled_from([-1, 0, 1])).map(
                lambda kd: kd[0] * unit + kd[1]
            ),
            st.integers(1, max_length),
        )
        length = length.map(lambda n: max(n, min_length))
        lengths = draw(st.lists(length, min_size=1, max_size=max_sequences))
        return lengths, cp, tp

    return draw()


def check_batch(fn: Callable, batch: PackedBatch, cp_size: int, tp_size: int) -> Mismatch | None:
    """`first_mismatch` on the lengths of a real micro-batch (for a training run's first steps)."""
    return first_mismatch(fn, batch.cu_seqlens.diff().tolist(), cp_size, tp_size)
