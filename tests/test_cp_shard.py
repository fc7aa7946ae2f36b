"""recipe.parallel.cp: zigzag index math against verl's formula and megatron-core's RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.data.thd import cu_seqlens_from_lengths, padded_lengths
from recipe.parallel.cp.verl import VERL_VARIANTS, verl_preprocess, verl_shard_values
from recipe.parallel.cp.zigzag import (
    index_preprocess,
    local_token_identity,
    real_token_mask,
    shard_tensors,
    unshard,
    zigzag_index,
)

PROPERTY = settings(max_examples=100, deadline=None)


@dataclass
class Packed:
    """A packed global stream built with plain loops, independent of the code under test."""

    cp: int
    lengths: list[int]
    padded: list[int]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    sequences: list[torch.Tensor]
    input_ids: torch.Tensor
    position_ids: torch.Tensor

    @property
    def total(self) -> int:
        return sum(self.padded)


def pack(lengths: list[int], cp: int, extra_chunks: list[int] | None = None, tp: int = 1) -> Packed:
    alignment = 2 * cp * tp
    extra_chunks = extra_chunks or [0] * len(lengths)
    padded = [
        -(-length // alignment) * alignment + e * alignment
        for length, e in zip(lengths, extra_chunks, strict=True)
    ]
    sequences, ids, positions, offset = [], [], [], 0
    for length, p in zip(lengths, padded, strict=True):
        # Distinct, non-zero ids so any misplaced token shows up and padding (0) is recognisable.
        seq = torch.arange(offset + 1, offset + 1 + length)
        sequences.append(seq)
        ids.append(torch.cat([seq, torch.zeros(p - length, dtype=torch.int64)]))
        positions.append(torch.arange(p))
        offset += p
    return Packed(
        cp=cp,
        lengths=lengths,
        padded=padded,
        cu_seqlens=cu_seqlens_from_lengths(torch.tensor(lengths)),
        cu_seqlens_padded=cu_seqlens_from_lengths(torch.tensor(padded)),
        sequences=sequences,
        input_ids=torch.cat(ids),
        position_ids=torch.cat(positions),
    )


@st.composite
def packed_batches(draw) -> Packed:
    cp = draw(st.sampled_from([2, 4, 8]))
    # Mix lengths below one chunk-pair (< 2*cp, including 1 and empty) with longer and odd ones.
    length = st.one_of(st.integers(0, 2 * cp), st.integers(1, 300))
    lengths = draw(st.lists(length, min_size=1, max_size=8))
    # Occasionally pad by more than the minimum, as a fixed-bucket packer would.
    extra = draw(st.lists(st.integers(0, 1), min_size=len(lengths), max_size=len(lengths)))
    return pack(lengths, cp, extra)


def legacy_breaks_rank(batch: Packed, rank: int) -> bool:
    """Derived from the two formulas: the legacy positions of the back chunk's real tokens are
    arange(P - remain_len, P) instead of arange(remain_start, remain_end), i.e. shifted by
    P - remain_end. That shift is zero only when remain_end == P, which needs rank 0 and L == P.
    So the legacy output is wrong on some real token iff some sequence has a real token in this
    rank's back chunk (P - c*(rank+1) < L) and is not (rank 0 and unpadded)."""
    for length, p in zip(batch.lengths, batch.padded, strict=True):
        chunk = p // (2 * batch.cp)
        back_has_real = p - chunk * (rank + 1) < length
        if back_has_real and (rank > 0 or length < p):
            return True
    return False


# --- the index math on a hand-checkable example ------------------------------------------------


def test_zigzag_index_small_example():
    # Sequences of padded lengths 8 and 4 at cp=2: chunks of 2 and 1 tokens.
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert zigzag_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_empty_sequences_and_empty_batches():
    # Zero-length sequences make empty chunks, including trailing ones that start at the end.
    cu = torch.tensor([0, 0, 4, 4, 8, 8])
    assert zigzag_index(cu, 2, 0).tolist() == [0, 3, 4, 7]
    assert zigzag_index(cu, 2, 1).tolist() == [1, 2, 5, 6]
    assert zigzag_index(torch.tensor([0]), 4, 3).numel() == 0
    assert unshard([torch.zeros(0)] * 2, torch.tensor([0, 0]), 2).numel() == 0


def test_cp_size_one_is_identity_and_needs_no_alignment():
    cu = torch.tensor([0, 3, 8])
    assert torch.equal(zigzag_index(cu, 1, 0), torch.arange(8))
    values = torch.randn(8, 2)
    assert torch.equal(unshard([values], cu, 1), values)


# --- properties over random packings -----------------------------------------------------------


@PROPERTY
@given(packed_batches())
def test_index_path_matches_verl_fixed_on_real_tokens(batch: Packed):
    for rank in range(batch.cp):
        ids, pos = index_preprocess(
            batch.input_ids, batch.position_ids, batch.cu_seqlens_padded, batch.cp, rank
        )
        ref_ids, ref_pos = verl_preprocess(
            batch.sequences, batch.cu_seqlens_padded, batch.cp, rank, "verl_fixed"
        )
        real = real_token_mask(batch.cu_seqlens, batch.cu_seqlens_padded, batch.cp, rank)
        assert torch.equal(ids[real], ref_ids[real])
        assert torch.equal(pos[real], ref_pos[real])
        # verl leaves padding slots at 0 and real ids are non-zero, so this also checks the mask.
        assert torch.equal(real, ref_ids != 0)
        # Padding ids are 0 in the global stream too, so input_ids agree everywhere.
        assert torch.equal(ids, ref_ids)


@PROPERTY
@given(packed_batches())
def test_verl_legacy_is_wrong_exactly_where_predicted(batch: Packed):
    if batch.cp == 2 and any(2 * n > p for n, p in zip(batch.lengths, batch.padded, strict=True)):
        # L > P/2 puts a real token in rank 1's back chunk, which legacy always gets wrong.
        assert legacy_breaks_rank(batch, 1)
    for rank in range(batch.cp):
        fixed_ids, fixed_pos = verl_preprocess(
            batch.sequences, batch.cu_seqlens_padded, batch.cp, rank, "verl_fixed"
        )
        legacy_ids, legacy_pos = verl_preprocess(
            batch.sequences, batch.cu_seqlens_padded, batch.cp, rank, "verl_legacy"
        )
        real = real_token_mask(batch.cu_seqlens, batch.cu_seqlens_padded, batch.cp, rank)
        assert torch.equal(legacy_ids, fixed_ids), "the bug is in positions only"
        differs = bool((legacy_pos[real] != fixed_pos[real]).any())
        assert differs == legacy_breaks_rank(batch, rank)


@PROPERTY
@given(packed_batches())
def test_ranks_partition_the_stream_in_per_sequence_slices(batch: Packed):
    cu = batch.cu_seqlens_padded.tolist()
    indices = [zigzag_index(batch.cu_seqlens_padded, batch.cp, r) for r in range(batch.cp)]
    assert torch.equal(torch.cat(indices).sort().values, torch.arange(batch.total))
    for index in indices:
        assert index.numel() == batch.total // batch.cp
        for i in range(len(batch.lengths)):
            local = index[cu[i] // batch.cp : cu[i + 1] // batch.cp]
            assert bool(((local >= cu[i]) & (local < cu[i + 1])).all())


@PROPERTY
@given(packed_batches(), st.integers(0, 2**31 - 1))
def test_shard_then_unshard_is_identity(batch: Packed, seed: int):
    generator = torch.Generator().manual_seed(seed)
    global_tensors = {
        "input_ids": batch.input_ids,
        "hidden": torch.randn(batch.total, 3, generator=generator),
        "mrope_position_ids": torch.randint(0, 100, (3, batch.total), generator=generator),
    }
    token_dims = {"mrope_position_ids": -1}
    per_rank = [
        shard_tensors(
            global_tensors, zigzag_index(batch.cu_seqlens_padded, batch.cp, r), token_dims
        )
        for r in range(batch.cp)
    ]
    for name, tensor in global_tensors.items():
        dim = token_dims.get(name, 0)
        rebuilt = unshard(
            [local[name] for local in per_rank], batch.cu_seqlens_padded, batch.cp, token_dim=dim
        )
        assert torch.equal(rebuilt, tensor)


@PROPERTY
@given(packed_batches())
def test_real_token_mask_counts_every_real_token_once(batch: Packed):
    masks = [
        real_token_mask(batch.cu_seqlens, batch.cu_seqlens_padded, batch.cp, r)
        for r in range(batch.cp)
    ]
    assert sum(int(m.sum()) for m in masks) == sum(batch.lengths)
    assert torch.equal(unshard(masks, batch.cu_seqlens_padded, batch.cp), batch.input_ids != 0)


@PROPERTY
@given(packed_batches())
def test_verl_shard_values_matches_verl_preprocess_ids(batch: Packed):
    for rank in range(batch.cp):
        ids, _ = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, batch.cp, rank)
        values = verl_shard_values(batch.sequences, batch.cu_seqlens_padded, batch.cp, rank)
        assert torch.equal(values, ids)


@pytest.mark.stack_dependent
@PROPERTY
@given(packed_batches())
def test_matches_megatron_thd_rope_sharding(batch: Packed):
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    # With freqs = arange(total), the frequency rows megatron picks for each token are its
    # global index. offset=0 for the first sequence is its "traditional" mode, which slices from
    # position 0: also the right global offset for that sequence.
    freqs = torch.arange(batch.total, dtype=torch.float64)
    cu = batch.cu_seqlens_padded.tolist()
    for rank in range(batch.cp):
        picked = [
            rope_utils._get_thd_freqs_on_this_cp_rank(
                rank, batch.cp, torch.empty(p // batch.cp), freqs, cu[i]
            )
            for i, p in enumerate(batch.padded)
        ]
        expected = torch.cat(picked).to(torch.int64)
        assert torch.equal(zigzag_index(batch.cu_seqlens_padded, batch.cp, rank), expected)


# --- the verl PR #6267 bug on a concrete sequence ----------------------------------------------


def test_single_sequence_of_4803_tokens_at_cp2():
    """L=4803 is padded to P=4804 at cp=2, so c = half = 1201 and the chunks are
    [0,1201) [1201,2402) [2402,3603) [3603,4804); rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.

    Bug 1 (rank 0): the back chunk has remain_len = 4803 - 3603 = 1200 real tokens, whose true
    positions are 3603..4802; legacy numbers them back from P, giving 3604..4803 (off by one,
    i.e. by the padding amount).
    Bug 2 (rank 1): the back chunk is [2402, 3603), all real, true positions 2402..3602; legacy
    gives arange(P - 1201, P) = 3603..4803, rank 0's back-chunk range (off by a whole chunk)."""
    length, cp = 4803, 2
    batch = pack([length], cp)
    assert batch.padded == [4804]
    padded, half = 4804, 4804 // cp // 2
    assert half == 1201

    for rank in range(cp):
        ids, pos = index_preprocess(
            batch.input_ids, batch.position_ids, batch.cu_seqlens_padded, cp, rank
        )
        fixed_ids, fixed_pos = verl_preprocess(
            batch.sequences, batch.cu_seqlens_padded, cp, rank, "verl_fixed"
        )
        _, legacy_pos = verl_preprocess(
            batch.sequences, batch.cu_seqlens_padded, cp, rank, "verl_legacy"
        )
        real = real_token_mask(batch.cu_seqlens, batch.cu_seqlens_padded, cp, rank)
        assert torch.equal(ids[real], fixed_ids[real])
        assert torch.equal(pos[real], fixed_pos[real])

        remain_start = padded - half * (rank + 1)
        remain_end = min(padded - half * rank, length)
        remain_len = remain_end - remain_start
        back = slice(half, half + remain_len)
        assert torch.equal(legacy_pos[:half], fixed_pos[:half]), "front chunk is unaffected"
        assert torch.equal(fixed_pos[back], torch.arange(remain_start, remain_end))
        assert torch.equal(legacy_pos[back], torch.arange(padded - remain_len, padded))

    _, legacy0 = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, cp, 0, "verl_legacy")
    _, fixed0 = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, cp, 0, "verl_fixed")
    assert torch.equal(
        legacy0[half : 2 * half - 1] - fixed0[half : 2 * half - 1],
        torch.ones(half - 1, dtype=torch.int64),
    )
    _, legacy1 = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, cp, 1, "verl_legacy")
    _, fixed1 = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, cp, 1, "verl_fixed")
    assert bool((legacy1[half:] != fixed1[half:]).all())
    assert torch.equal(legacy1[half:] - fixed1[half:], torch.full((half,), half))


# --- tensor parallelism: verl pads a short sequence before clamping -------------------------


def test_verl_references_at_tp2_on_a_sequence_shorter_than_the_alignment():
    """cp=2, tp=2: alignment 8, one sequence of 5 tokens padded to 8, chunks of 2 slots. Rank 1
    holds slots [2, 3] and [4, 5]; slot 4 is the last real token (true position 4). verl pads
    the 5 tokens to 8 before clamping the back chunk's end, so its pre-fix formula numbers the
    back chunk [6, 7], as verl's own function does; clamping at the real length instead would
    give [7, 0]. The fixed formula gives the true 4 either way."""
    batch = pack([5], cp=2, tp=2)
    _, legacy = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, 2, 1, "verl_legacy", 2)
    ids, fixed = verl_preprocess(batch.sequences, batch.cu_seqlens_padded, 2, 1, "verl_fixed", 2)
    assert legacy.tolist() == [2, 3, 6, 7]
    assert fixed.tolist() == [2, 3, 4, 0]
    assert ids.tolist() == [3, 4, 5, 0]  # tokens 3, 4, 5 (ids start at 1); slot 5 is padding
    # The same sequence at tp=1: 5 tokens are not shorter than the alignment (4), so verl clamps
    # at the real length and its pre-fix formula numbers the one real back slot from the end.
    batch1 = pack([5], cp=2)
    _, legacy1 = verl_preprocess(batch1.sequences, batch1.cu_seqlens_padded, 2, 1, "verl_legacy")
    assert legacy1.tolist() == [2, 3, 7, 0]


@PROPERTY
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    cp=st.sampled_from([2, 4]),
    tp=st.sampled_from([1, 2, 4]),
)
def test_index_path_matches_verl_fixed_on_real_tokens_at_every_tp(lengths, cp, tp):
    batch = pack(lengths, cp, tp=tp)
    for rank in range(cp):
        ids, pos = index_preprocess(
            batch.input_ids, batch.position_ids, batch.cu_seqlens_padded, cp, rank
        )
        ref_ids, ref_pos = verl_preprocess(
            batch.sequences, batch.cu_seqlens_padded, cp, rank, "verl_fixed", tp
        )
        values = verl_shard_values(batch.sequences, batch.cu_seqlens_padded, cp, rank, tp)
        real = real_token_mask(batch.cu_seqlens, batch.cu_seqlens_padded, cp, rank)
        assert torch.equal(ids, ref_ids), "verl leaves padding slots at 0, as the index path"
        assert torch.equal(values, ref_ids)
        assert torch.equal(pos[real], ref_pos[real])


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cp_size", "cp_rank", "message"),
    [
        (0, 0, "cp_size must be >= 1"),
        (2, 2, "0 <= cp_rank < cp_size=2"),
        (2, -1, "0 <= cp_rank < cp_size=2"),
    ],
)
def test_bad_cp_arguments(cp_size, cp_rank, message):
    with pytest.raises(ValueError, match=message):
        zigzag_index(torch.tensor([0, 8]), cp_size, cp_rank)


def test_unaligned_padded_length_names_the_sequence():
    cu = torch.tensor([0, 8, 14, 22])
    with pytest.raises(ValueError, match=r"sequence 1 is 6, not a multiple of 2\*cp_size=4"):
        zigzag_index(cu, 2, 0)
    with pytest.raises(ValueError, match="sequence 1 is 6"):
        verl_preprocess([torch.ones(5)] * 3, cu, 2, 0)


def test_malformed_cu_seqlens():
    with pytest.raises(ValueError, match="must start at 0"):
        zigzag_index(torch.tensor([4, 8]), 2, 0)
    with pytest.raises(ValueError, match="non-decreasing; sequence 1"):
        zigzag_index(torch.tensor([0, 8, 4]), 2, 0)
    with pytest.raises(ValueError, match="1-D"):
        zigzag_index(torch.tensor([[0, 8]]), 2, 0)


def test_verl_references_check_the_sequence_count():
    with pytest.raises(ValueError, match="got 1 sequences but cu_seqlens_padded describes 2"):
        verl_preprocess([torch.ones(4)], torch.tensor([0, 4, 8]), 2, 0)
    with pytest.raises(ValueError, match="got 1 sequences"):
        verl_shard_values([torch.ones(4)], torch.tensor([0, 4, 8]), 2, 0)


def test_unknown_variant_lists_valid_ones():
    with pytest.raises(ValueError, match="verl_fixed, verl_legacy"):
        verl_preprocess([torch.ones(4)], torch.tensor([0, 4]), 2, 0, variant="verl")
    assert VERL_VARIANTS == ("verl_fixed", "verl_legacy")


def test_unshard_checks_rank_count_and_lengths():
    cu = torch.tensor([0, 8])
    with pytest.raises(ValueError, match="one local tensor per rank"):
        unshard([torch.zeros(4)], cu, 2)
    with pytest.raises(ValueError, match="rank 1 tensor has 3 tokens"):
        unshard([torch.zeros(4), torch.zeros(3)], cu, 2)


def test_real_token_mask_rejects_real_longer_than_padded():
    with pytest.raises(ValueError, match="sequence 0 has real length 9 > padded length 8"):
        real_token_mask(torch.tensor([0, 9]), torch.tensor([0, 8]), 2, 0)


def test_shard_tensors_rejects_unknown_token_dim_names():
    with pytest.raises(ValueError, match="position_ids"):
        shard_tensors({"input_ids": torch.zeros(4)}, torch.arange(2), {"position_ids": -1})


# --- length helpers ----------------------------------------------------------------------------


def test_padded_lengths_rounds_up_to_alignment():
    lengths = torch.tensor([1, 4, 5, 8, 0])
    assert padded_lengths(lengths, 4).tolist() == [4, 4, 8, 8, 0]
    assert torch.equal(padded_lengths(lengths, 1), lengths)
    with pytest.raises(ValueError, match="alignment must be >= 1"):
        padded_lengths(lengths, 0)
    with pytest.raises(ValueError, match="non-negative"):
        padded_lengths(torch.tensor([-1]), 4)


def test_cu_seqlens_from_lengths_is_int32_with_leading_zero():
    cu = cu_seqlens_from_lengths(torch.tensor([3, 5, 2]))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 8, 10]
    assert cu_seqlens_from_lengths(torch.tensor([], dtype=torch.int64)).tolist() == [0]


def _identity_by_loops(batch: Packed, rank: int) -> tuple[list[int], list[int], list[int]]:
    """(sequence, position, chunk) of each of `rank`'s local slots, slot by slot: the front
    chunk `rank`, then the back chunk 2cp-1-rank, of each sequence in order."""
    sequences, positions, chunks = [], [], []
    for i, p in enumerate(batch.padded):
        chunk = p // (2 * batch.cp)
        for c in (rank, 2 * batch.cp - 1 - rank):
            for offset in range(chunk):
                sequences.append(i)
                positions.append(c * chunk + offset)
                chunks.append(c)
    return sequences, positions, chunks


@PROPERTY
@given(packed_batches())
def test_local_token_identity_names_each_slots_sequence_position_and_chunk(batch: Packed):
    for rank in range(batch.cp):
        sequence, position, chunk = local_token_identity(batch.cu_seqlens_padded, batch.cp, rank)
        assert (sequence.tolist(), position.tolist(), chunk.tolist()) == _identity_by_loops(
            batch, rank
        )


def test_local_token_identity_at_cp1_is_the_plain_stream():
    sequence, position, chunk = local_token_identity(torch.tensor([0, 3, 5]), 1, 0)
    assert sequence.tolist() == [0, 0, 0, 1, 1]
    assert position.tolist() == [0, 1, 2, 0, 1]
    assert chunk.tolist() == [0, 0, 0, 0, 0]
