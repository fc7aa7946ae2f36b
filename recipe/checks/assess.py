"""What a finding on a CP function costs a user, and the micro-batches the checkers draw: the
impact classes (worst last, the order a search climbs), `assess` (the worst thing one
micro-batch shows when a function with the contract of `recipe/parallel/cp/contract.py` runs on
every rank) and the `micro_batches` strategy. Shared by the checks of a user's function
(`recipe/checks/preprocess.py`), the mutation score and the upstream checker; training needs
none of it, so it sits here, above the contract, not in it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from recipe.parallel.cp.contract import (
    FIELDS,
    LAYOUT_KEY,
    ContractError,
    call,
    global_batch,
    rank_mismatch,
    shown_number,
    unique_sequences,
)


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
                    f"mask {shown_number(fields['loss_mask'])}: padding trains as a real token",
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
                    f"expected {expected}, got {shown_number(fields[name])}",
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
        mismatch = rank_mismatch(lengths, sequences, got, cp_size, tp_size, rank, sequence_parallel)
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
