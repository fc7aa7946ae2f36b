"""The varlen plan (one attention call per layer): every query row is paired with exactly its
causal prefix, checked against the zigzag index on its own, and the plan run entry by entry
computes what the per-sequence path computes, forward and backward, at cp 1/2/4/8, with GQA and
real offsets: bit for bit at cp=1, within 5e-7 in fp32 at cp > 1 (a chunk is its own call)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.model.attention import stream_layout, varlen_causal_attention
from recipe.model.varlen_plan import attend_by_plan_reference, varlen_plan
from recipe.parallel.cp.zigzag import zigzag_index


@st.composite
def streams(draw):
    """(padded lengths, real lengths or None, cp, rank): padded lengths multiples of 2*cp, real
    ones anywhere from 0 to the padded length."""
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    rank = draw(st.integers(0, cp - 1))
    units = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    padded = [u * 2 * cp for u in units]
    if draw(st.booleans()):
        return padded, None, cp, rank
    real = [draw(st.integers(0, n)) for n in padded]
    return padded, real, cp, rank


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@settings(max_examples=300, deadline=None)
@given(streams())
def test_each_query_row_attends_to_exactly_its_causal_prefix(stream):
    padded, real, cp, rank = stream
    cu = _cu(padded)
    plan = varlen_plan(cu.tolist(), cp, rank, real)
    # the reference: the global position of every local row, from the zigzag index itself
    position = zigzag_index(cu, cp, rank).tolist() if cp > 1 else list(range(int(cu[-1])))
    starts = cu.tolist()

    def sequence_of(global_position):
        return max(i for i in range(len(padded)) if starts[i] <= global_position)

    rows, keys = plan.query_rows.tolist(), plan.key_rows.tolist()
    cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
    assert len(set(rows)) == len(rows), "a row is asked twice"
    covered = set()
    for e in range(plan.entries):
        entry_rows = rows[cu_q[e] : cu_q[e + 1]]
        entry_keys = keys[cu_k[e] : cu_k[e + 1]]
        shift = len(entry_keys) - len(entry_rows)
        assert shift >= 0
        seq = sequence_of(position[entry_rows[0]])
        for j, row in enumerate(entry_rows):
            own = position[row]
            # bottom-right causal: query j sees keys 0..shift+j, the last of them its own token
            assert entry_keys[: shift + j + 1] == list(range(starts[seq], own + 1))
        covered.update(entry_rows)
    lengths = real or padded
    expected = {
        row
        for row, pos in enumerate(position)
        if pos - starts[sequence_of(pos)] < lengths[sequence_of(pos)]
    }
    assert covered == expected, "every real row once, no padding row"
    assert plan.local_rows == len(position)
    assert plan.max_q == max(cu_q[e + 1] - cu_q[e] for e in range(plan.entries)) if rows else True


def _inputs(padded, real, heads, groups, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(padded)
    key = torch.randn(total, groups, dim, generator=generator, requires_grad=True)
    value = torch.randn(total, groups, dim, generator=generator, requires_grad=True)
    query = torch.randn(total, heads, dim, generator=generator)
    return query, key, value


def _compare(padded, real, cp, heads, groups):
    cu = _cu(padded)
    cu_real = None if real is None else _cu(real)
    full_query, key, value = _inputs(padded, real, heads, groups)
    for rank in range(cp):
        local = zigzag_index(cu, cp, rank) if cp > 1 else torch.arange(int(cu[-1]))
        query = full_query[local].clone().requires_grad_(True)
        reference = varlen_causal_attention(query, key, value, cu, cp, rank, cu_seqlens=cu_real)
        layout = stream_layout(cu, cp, rank, cu_real)
        plan = varlen_plan(layout.bounds, cp, rank, layout.real_lengths)
        got = attend_by_plan_reference(query, key, value, plan).reshape(reference.shape)
        if cp == 1:  # one entry per sequence, the same SDPA call as the per-sequence path
            assert torch.equal(got, reference)
        else:  # each chunk against its own key prefix: 2-4e-7 apart in fp32 (a sequence's two
            # chunks in one masked call there, so the kernel sums over other key blocks)
            torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
        upstream = torch.randn_like(reference)
        expected = torch.autograd.grad(reference, (query, key, value), upstream)
        grads = torch.autograd.grad(got, (query, key, value), upstream)
        for name, g, e in zip(("query", "key", "value"), grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"{name} grad, rank {rank}")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("offsets", ["padded", "real"])
def test_the_plan_computes_what_the_per_sequence_path_computes(cp, heads, groups, offsets):
    padded = [u * 2 * cp for u in (3, 1, 5, 2)]
    real = (
        None if offsets == "padded" else [n - k for n, k in zip(padded, (1, 0, 2 * cp + 1, 2 * cp))]
    )
    _compare(padded, real, cp, heads, groups)


def test_a_sequence_of_padding_only_and_an_empty_stream_output_zeros():
    padded, real = [8, 8], [0, 5]
    _compare(padded, real, 2, 2, 1)
    plan = varlen_plan([0, 8], 2, 1, [0])
    assert plan.entries == 0 and plan.local_rows == 4
    out = attend_by_plan_reference(
        torch.ones(4, 2, 3), torch.ones(8, 1, 3), torch.ones(8, 1, 3), plan
    )
    assert torch.equal(out, torch.zeros(4, 2, 3))


def test_a_length_that_cp_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="sequence 1 is 6, not a multiple of 2\\*cp_size=4"):
        varlen_plan([0, 8, 14], 2, 0)
