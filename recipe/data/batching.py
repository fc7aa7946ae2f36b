"""Dynamic batching: whole sequences into optimizer steps and token-budget micro-batches.

A step takes sequences in data order until the next one would pass `tokens_per_step` real tokens,
so what a step contains never depends on the parallel layout. The step's sequences are then split
across data-parallel ranks and, on each, into as few micro-batches as the per-rank budget allows,
balanced by longest-first assignment. The budget counts tokens after alignment padding and after
CP sharding, because that is what one rank actually holds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from recipe.data.thd import aligned_length


def _longest_first(sizes: list[int], bins: int) -> list[list[int]]:
    """Assign items (by index) to `bins` bins, largest first into the lightest bin.

    Ties break on bin index, so the result is deterministic; items keep data order within a bin.
    """
    loads = [0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        b = min(range(bins), key=lambda k: (loads[k], k))
        loads[b] += sizes[i]
        members[b].append(i)
    return [sorted(m) for m in members]


def split_across_ranks(lengths: list[int], dp_size: int, alignment: int) -> list[list[int]]:
    """Balance a step's sequences (indices) over data-parallel ranks by padded tokens.

    A step with fewer sequences than ranks leaves some ranks empty: they contribute zero gradient,
    and since the loss is normalised by the global token count the update stays exact.
    """
    return _longest_first([aligned_length(n, alignment) for n in lengths], dp_size)


def plan_micro_batches(
    lengths: list[int], alignment: int, cp_size: int, max_tokens_per_rank: int
) -> list[list[int]]:
    """Fewest balanced micro-batches (lists of sequence indices) under the per-rank budget."""
    padded = [aligned_length(n, alignment) for n in lengths]
    capacity = max_tokens_per_rank * cp_size  # global padded tokens that fit on cp ranks
    too_long = [i for i, p in enumerate(padded) if p > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sequence of {lengths[i]} tokens ({padded[i]} padded) exceeds the budget of "
            f"{max_tokens_per_rank} tokens per rank x cp={cp_size}; raise "
            "batching.max_tokens_per_rank or lower data.max_seq_len"
        )
    if not lengths:
        return []
    bins = max(1, math.ceil(sum(padded) / capacity))
    while True:
        plan = [b for b in _longest_first(padded, bins) if b]
        if all(sum(padded[i] for i in b) <= capacity for b in plan):
            return _merge_lightest(plan, padded, capacity)
        bins += 1


def _merge_lightest(plan: list[list[int]], sizes: list[int], capacity: int) -> list[list[int]]:
    """Longest-first is not optimal: if the two lightest micro-batches fit together, merge."""
    while len(plan) > 1:
        plan.sort(key=lambda b: (sum(sizes[i] for i in b), b))
        a, b = plan[0], plan[1]
        if sum(sizes[i] for i in a + b) > capacity:
            break
        plan = [sorted(a + b)] + plan[2:]
    return sorted(plan)


class StepStream:
    """Endless optimizer steps of whole sequences, reshuffled (seeded) every epoch.

    A step may run across an epoch boundary: the stream is one sequence order, cut by the token
    budget. Its state is where the next sequence comes from (epoch, position in that epoch's
    order), so `state_dict()` / `load_state_dict()` resume it exactly.
    """

    def __init__(self, sequences: list[list[int]], tokens_per_step: int, seed: int):
        longest = max(len(s) for s in sequences)
        if longest > tokens_per_step:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds batching.tokens_per_step={tokens_per_step}"
            )
        self.sequences = sequences
        self.tokens_per_step = tokens_per_step
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.sequences)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _peek(self) -> list[int]:
        return self.sequences[self._order[self.position]]

    def _advance(self) -> None:
        self.position += 1
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)

    def __iter__(self) -> Iterator[list[list[int]]]:
        return self

    def __next__(self) -> list[list[int]]:
        step: list[list[int]] = []
        total = 0
        while not step or total + len(self._peek()) <= self.tokens_per_step:
            seq = self._peek()
            step.append(seq)
            total += len(seq)
            self._advance()
        return step

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.sequences):
            raise ValueError(
                f"data stream state epoch={epoch} position={position} does not fit a corpus of "
                f"{len(self.sequences)} sequences; was it saved with other data settings?"
            )
        self.epoch, self.position = epoch, position
        self._order = self._order_of(epoch)


def chunk_for_eval(sequences: list[list[int]], tokens_per_chunk: int) -> list[list[list[int]]]:
    """Eval sequences in order, grouped like training steps (bounded memory per group)."""
    groups, current, total = [], [], 0
    for seq in sequences:
        if current and total + len(seq) > tokens_per_chunk:
            groups.append(current)
            current, total = [], 0
        current.append(seq)
        total += len(seq)
    if current:
        groups.append(current)
    return groups
