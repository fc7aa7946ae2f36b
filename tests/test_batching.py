"""Property tests of dynamic batching and THD packing, against invariants and a plain reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.data.batching import (
    StepStream,
    plan_micro_batches,
    split_across_ranks,
)
from recipe.data.packing import pack_sequences
from recipe.data.thd import aligned_length

PAD = 999
lengths_st = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=40)


def _sequences(lengths, offset=0):
    # Token values encode (sequence, position) so any misplaced token is detectable.
    return [[1000 * (i + offset) + j for j in range(n)] for i, n in enumerate(lengths)]


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, alignment=st.sampled_from([1, 2, 4, 8, 16]))
def test_packing_invariants(lengths, alignment):
    seqs = _sequences(lengths)
    b = pack_sequences(seqs, alignment, PAD)
    padded = [aligned_length(n, alignment) for n in lengths]
    # Offsets: real and padded cumulative lengths, each sequence padded to the alignment.
    assert b.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert b.cu_seqlens_padded.tolist() == [0] + torch.tensor(padded).cumsum(0).tolist()
    assert all(p % alignment == 0 and p - n < alignment for p, n in zip(padded, lengths))
    assert b.max_seqlen == max(padded)
    assert b.input_ids.numel() == b.cu_seqlens_padded[-1]
    for i, seq in enumerate(seqs):
        s, e, n = int(b.cu_seqlens_padded[i]), int(b.cu_seqlens_padded[i + 1]), len(seq)
        # Every real token appears exactly once, in order, at the start of its slot.
        assert b.input_ids[s : s + n].tolist() == seq
        assert (b.input_ids[s + n : e] == PAD).all()
        # Positions restart at 0 per sequence and step by 1.
        assert b.position_ids[s:e].tolist() == list(range(e - s))
        # Labels are the next token of the same sequence; never across a boundary.
        assert b.labels[s : s + n - 1].tolist() == seq[1:]
        # Loss mask: on every token with a next token, off on the last real token and padding.
        assert b.loss_mask[s : s + n - 1].eq(1).all()
        assert b.loss_mask[s + n - 1 : e].eq(0).all()
    assert int(b.loss_mask.sum()) == sum(n - 1 for n in lengths)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([1, 2, 4]), budget=st.integers(300, 1200))
def test_micro_batches_hold_the_budget_and_every_sequence_once(lengths, cp, budget):
    alignment = 2 * cp if cp > 1 else 1
    plan = plan_micro_batches(lengths, alignment, cp, budget)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lengths)))
    for mb in plan:
        assert mb, "no empty micro-batches"
        per_rank = sum(aligned_length(lengths[i], alignment) for i in mb) // cp
        assert per_rank <= budget
    # As few as the budget allows: at least the volume lower bound ...
    volume = sum(aligned_length(n, alignment) for n in lengths)
    lower = -(-volume // (budget * cp))
    assert len(plan) >= lower
    # ... and no two micro-batches could have been merged.
    loads = sorted(sum(aligned_length(lengths[i], alignment) for i in mb) for mb in plan)
    if len(loads) > 1:
        assert loads[0] + loads[1] > budget * cp


def test_micro_batches_are_balanced():
    lengths = [100] * 10
    plan = plan_micro_batches(lengths, 1, 1, 500)
    assert sorted(len(mb) for mb in plan) == [5, 5]
    plan = plan_micro_batches([100] * 9, 1, 1, 500)
    assert sorted(len(mb) for mb in plan) == [4, 5]


def test_too_long_sequence_names_the_budget():
    import pytest

    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        plan_micro_batches([50, 2000], 4, 2, 512)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=4, max_size=40), dp=st.sampled_from([1, 2, 4])
)
def test_data_parallel_split_is_a_balanced_partition(lengths, dp):
    parts = split_across_ranks(lengths, dp, 4)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(aligned_length(lengths[i], 4) for i in p) for p in parts]
    # Longest-first keeps the spread within one item's size.
    assert max(loads) - min(loads) <= max(aligned_length(n, 4) for n in lengths)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=30),
    budget=st.integers(200, 800),
    seed=st.integers(0, 5),
)
def test_steps_take_whole_sequences_up_to_the_token_budget(lengths, budget, seed):
    seqs = _sequences(lengths)
    stream = iter(StepStream(seqs, budget, seed))
    seen = []
    for _ in range(len(seqs) * 2):
        step = next(stream)
        total = sum(len(s) for s in step)
        assert 1 <= len(step) and total <= budget
        seen.extend(step)
        if len(seen) >= len(seqs):
            break
    # The first epoch is a permutation of all sequences (whole, unmodified).
    first_epoch = sorted(map(tuple, seen[: len(seqs)]))
    assert first_epoch == sorted(map(tuple, seqs))


def test_data_order_is_seeded():
    seqs = _sequences([50, 120, 7, 300, 33, 90, 250, 11])

    def first_steps(seed):
        stream = iter(StepStream(seqs, 400, seed))
        return [next(stream) for _ in range(3)]

    assert first_steps(3) == first_steps(3)
    assert any(first_steps(3) != first_steps(s) for s in (4, 5, 6))


def _reference_steps(seqs, budget, seed):
    """The step stream written as the plain generator it replaces: one endless seeded order,
    cut greedily by the token budget."""
    import random

    def in_order():
        epoch = 0
        while True:
            order = list(range(len(seqs)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            yield from (seqs[i] for i in order)
            epoch += 1

    step, total = [], 0
    for seq in in_order():
        if step and total + len(seq) > budget:
            yield step
            step, total = [], 0
        step.append(seq)
        total += len(seq)


@settings(max_examples=80, deadline=None)
@given(
    lengths=lengths_st,
    budget=st.integers(min_value=300, max_value=2000),
    seed=st.integers(0, 10),
    cut=st.integers(0, 30),
)
def test_step_stream_resumes_exactly_from_its_state(lengths, budget, seed, cut):
    seqs = _sequences(lengths)
    reference = _reference_steps(seqs, budget, seed)
    expected = [next(reference) for _ in range(cut + 10)]
    stream = StepStream(seqs, budget, seed)
    before = [next(stream) for _ in range(cut)]
    state = stream.state_dict()
    resumed = StepStream(seqs, budget, seed)
    resumed.load_state_dict(state)
    after = [next(resumed) for _ in range(10)]
    assert before + after == expected


def test_step_stream_refuses_a_state_from_other_data():
    stream = StepStream(_sequences([10, 20, 30]), 100, 0)
    with pytest.raises(ValueError, match="position=7 does not fit a corpus of 3 sequences"):
        stream.load_state_dict({"epoch": 0, "position": 7})
