"""3-D (mrope) positions of packed streams with images: golden values, an independent loop
reference, and megatron-core's rope tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.model.mrope import image_token_grid, stream_mrope_positions

PROPERTY = settings(max_examples=150, deadline=None)


def _stream(sequences: list[list[object]], alignment: int):
    """Build (cu_seqlens_padded, image_slot, grids) from sequences written as lists of 't'
    (a text token) and (h, w) tuples (an image of h x w merged patches)."""
    slots, grids, cu, next_slot = [], [], [0], 0
    for seq in sequences:
        length = 0
        for item in seq:
            if item == "t":
                slots.append(-1)
                length += 1
            else:
                h, w = item
                grids.append((h, w))
                slots.extend(range(next_slot, next_slot + h * w))
                next_slot += h * w
                length += h * w
        padded = -(-length // alignment) * alignment
        slots.extend([-1] * (padded - length))
        cu.append(cu[-1] + padded)
    return (
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(grids, dtype=torch.int64).reshape(-1, 2),
    )


def _loop_reference(sequences: list[list[object]], alignment: int) -> torch.Tensor:
    """Qwen2-VL's rule written out token by token: text advances all three axes by one; an image
    of h x w patches starting at p gives patch (r, c) the ids (p, p + r, p + c) and the text after
    it continues at p + max(h, w); padding counts on like text; every sequence restarts at 0."""
    out = []
    for seq in sequences:
        p, length = 0, 0
        for item in seq:
            if item == "t":
                out.append((p, p, p))
                p += 1
                length += 1
            else:
                h, w = item
                for r in range(h):
                    for c in range(w):
                        out.append((p, p + r, p + c))
                p += max(h, w)
                length += h * w
        for _ in range(-(-length // alignment) * alignment - length):
            out.append((p, p, p))
            p += 1
    return torch.tensor(out, dtype=torch.int64).T


def test_golden_two_sequences_one_with_an_image():
    # Sequence A: three text tokens, padded to 4. Sequence B: BOS, a 2 x 3 image, two text
    # tokens (9 tokens), padded to 12. Worked by hand from the rule above.
    cu, slots, grids = _stream([["t", "t", "t"], ["t", (2, 3), "t", "t"]], alignment=4)
    ids = stream_mrope_positions(cu, slots, grids)
    expected_t = [0, 1, 2, 3] + [0, 1, 1, 1, 1, 1, 1, 4, 5, 6, 7, 8]
    expected_h = [0, 1, 2, 3] + [0, 1, 1, 1, 2, 2, 2, 4, 5, 6, 7, 8]
    expected_w = [0, 1, 2, 3] + [0, 1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8]
    assert ids.tolist() == [expected_t, expected_h, expected_w]


def test_text_only_stream_gives_three_equal_axes_of_1d_positions():
    cu, slots, grids = _stream([["t"] * 5, ["t"] * 2], alignment=4)
    ids = stream_mrope_positions(cu, slots, grids)
    positions = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert ids.tolist() == [positions] * 3


def test_image_token_grid_is_row_major_within_each_image():
    grids = torch.tensor([[2, 3], [1, 2]])
    image, row, col = image_token_grid(torch.arange(8), grids)
    assert image.tolist() == [0] * 6 + [1] * 2
    assert row.tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert col.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


@st.composite
def streams(draw):
    n = draw(st.integers(1, 4))
    sequences = []
    for _ in range(n):
        items = draw(
            st.lists(
                st.one_of(
                    st.just("t"),
                    st.tuples(st.integers(1, 4), st.integers(1, 5)),
                ),
                min_size=1,
                max_size=8,
            )
        )
        sequences.append(items)
    return sequences, draw(st.sampled_from([1, 2, 4, 8]))


@PROPERTY
@given(streams())
def test_positions_equal_the_token_by_token_rule(case):
    sequences, alignment = case
    cu, slots, grids = _stream(sequences, alignment)
    # Two images directly after each other must still be told apart: the loop reference does.
    expected = _loop_reference(sequences, alignment)
    assert torch.equal(stream_mrope_positions(cu, slots, grids), expected)


def test_rejects_slots_that_do_not_match_the_grids():
    cu, slots, grids = _stream([["t", (2, 2)]], alignment=1)
    with pytest.raises(ValueError, match="image tokens"):
        stream_mrope_positions(cu, slots, grids[:, :1].repeat(1, 2) * 0 + 1)
