"""megatron-core's MTP roll_tensor under THD + CP on real gloo ranks (recipe/checks/mtp_roll.py).

What megatron does was measured on both supported releases and is asserted here as found:
with the padded offsets in cu_seqlens_q (verl's way, and the recipe's) the roll is right; with the
real offsets (Megatron-Bridge's packed SFT) it rolls the wrong slots or raises, and which of the two
depends on the release (0.19.2 skips a sequence whose local slice is empty, 0.16.1 raises on it).
"""

from __future__ import annotations

import pytest

from recipe.checks import mtp_roll
from recipe.megatron.versions import megatron_version

# Lengths around the zigzag units at cp=2 (4) and cp=4 (8): 1, shorter than 2*cp, k*2cp-1,
# k*2cp, k*2cp+1, several sequences per micro-batch.
PADDED_CASES = [
    [1],
    [3, 2],
    [1, 1, 1],
    [5, 7, 1],
    [6, 6],
    [9, 13],
    [7, 1, 16, 17, 15, 2, 9, 4],
    [8, 3, 1, 12, 25, 2],
]
INDEX_ERROR = "roll_tensor(labels, cu_seqlens_q=unpadded) raised IndexError"


def _release(**by_version):
    return by_version[{"0.19.2": "current", "0.16.1": "legacy"}[megatron_version()]]


@pytest.mark.distributed
@pytest.mark.stack_dependent
@pytest.mark.parametrize("cp", [2, 4])
def test_padded_offsets_roll_right(worlds, cp):
    """verl's PackedSeqParams: every case right on every rank."""
    assert worlds.run(cp, mtp_roll.check_cases_on_rank, PADDED_CASES, cp, "padded") == (
        None,
        len(PADDED_CASES),
    )


@pytest.mark.distributed
@pytest.mark.stack_dependent
def test_unpadded_offsets_roll_the_wrong_slots(worlds):
    """Bridge's PackedSeqParams, one sequence of 5 at cp=2 (padded to 8, 4 slots a rank):
    megatron takes rank 0's slice as local slots [0, 5 // 2) instead of [0, 8 // 2), so it splits
    slots 0-1 as if they were the two zigzag chunks and slot 0 receives global slot 2's label."""
    finding = worlds.run(2, mtp_roll.check_roll_on_rank, [5], 2, "unpadded")
    assert finding is not None and not finding.note
    assert (finding.cp_rank, finding.field, finding.slot) == (0, "rolled labels", 0)
    assert (finding.sequence, finding.position, finding.chunk) == (0, 0, 0)
    # Token ids are 1..5, labels 2..5: the roll's truth at position 0 is position 2's token.
    assert (finding.expected, finding.got) == (3, 4)


@pytest.mark.distributed
@pytest.mark.stack_dependent
def test_unpadded_offsets_raise_alike_and_the_world_goes_on(worlds):
    """A sequence of 2 at cp=2: megatron's local slice [0, 1) is one slot, chunk(2) gives one
    chunk, and every rank raises IndexError (rank 0 before posting a send, rank 1 after one);
    the unmatched send is settled, so the next case in the same world rolls right."""
    raised, after = worlds.run(2, _raise_then_roll_right)
    assert raised.note.startswith(INDEX_ERROR + ": list index out of range")
    assert raised.cp_rank == 0
    assert after is None


def _raise_then_roll_right():
    return (
        mtp_roll.check_roll_on_rank([2], 2, "unpadded"),
        mtp_roll.check_roll_on_rank([3, 2], 2, "padded"),
    )


@pytest.mark.distributed
@pytest.mark.stack_dependent
def test_unpadded_offsets_shrink_to_one_sequence(worlds):
    """The greedy shrink inside the world keeps the failure's kind (here IndexError)."""
    finding, ran = worlds.run(2, mtp_roll.check_cases_on_rank, [[3, 1, 16, 2, 9]], 2, "unpadded")
    assert ran == 1
    assert finding.note.startswith(INDEX_ERROR)
    # 0.19.2 skips an empty local slice (a sequence of 1: [0 // 2, 1 // 2)), so [1] passes
    # there; 0.16.1 calls select(-1) on it and raises.
    assert finding.lengths == _release(current=(2,), legacy=(1,))


@pytest.mark.distributed
@pytest.mark.stack_dependent
def test_negative_control_is_flagged(worlds):
    """The copy with each local slice ending one slot late: a wrong value, not a crash."""
    finding = worlds.run(2, mtp_roll.check_roll_on_rank, [3, 2], 2, "padded", True)
    assert finding is not None and not finding.note
    assert (finding.cp_rank, finding.field, finding.slot, finding.expected, finding.got) == (
        0,
        "rolled labels",
        0,
        3,
        0,
    )


@pytest.mark.stack_dependent
def test_cp1_unpadded_offsets_count_padding_with_the_next_sequence(worlds):
    """cp=1 in this process, [3, 2] padded to [4, 2] (alignment 2): megatron rolls slots [0, 3)
    and [3, 5), so padding slot 3 takes slot 4's loss mask (1) and its label, the second token of
    the next sequence: loss on a padding slot, with a target from another sequence."""
    assert worlds.run(1, mtp_roll.check_roll_on_rank, [3, 2], 1, "padded") is None
    finding = worlds.run(1, mtp_roll.check_roll_on_rank, [3, 2], 1, "unpadded")
    assert (finding.cp_rank, finding.field, finding.slot) == (0, "rolled loss_mask", 3)
    assert (finding.sequence, finding.position, finding.expected, finding.got) == (0, 3, 0, 1)
    # No padding, no harm: the same offsets either way.
    assert worlds.run(1, mtp_roll.check_roll_on_rank, [4, 2], 1, "unpadded") is None


@pytest.mark.distributed
@pytest.mark.launches
@pytest.mark.stack_dependent
def test_check_roll_launches_a_world_and_shrinks():
    finding, ran = mtp_roll.check_roll(cp_sizes=(2,), cases=4, seed=0, cu_kind="unpadded")
    # The first drawn case fails on both releases; shrunk to one sequence in the world.
    assert ran == 1
    assert len(finding.lengths) == 1
    assert finding.describe() == _release(
        current="lengths=[9] cp=2 tp=1: rank 0, local slot 1 (sequence 0, position 1, chunk 0 = "
        "front): rolled labels expected 4, got 5",
        legacy=f"lengths=[1] cp=2 tp=1: rank 0: {INDEX_ERROR}: select(): index -1 out of range "
        "for tensor of size [1, 0] at dimension 1",
    )


@pytest.mark.distributed
@pytest.mark.stack_dependent
def test_cp4_unpadded_offsets_leave_an_empty_slice(worlds):
    """A sequence of 2 at cp=4 (8 padded slots, 2 a rank): megatron's local slice is
    [0 // 4, 2 // 4), empty. 0.19.2 skips it and leaves the values unrolled (slot 0 keeps its
    own loss mask 1); 0.16.1 calls select(-1) on it and raises."""
    finding = worlds.run(4, mtp_roll.check_roll_on_rank, [2], 4, "unpadded")
    got = (finding.note, finding.field, finding.slot, finding.expected, finding.got)
    assert got == _release(
        current=("", "rolled loss_mask", 0, 0, 1),
        legacy=(
            f"{INDEX_ERROR}: select(): index -1 out of range for tensor of size [1, 0] at "
            "dimension 1",
            "rolled labels",
            -1,
            0,
            0,
        ),
    )


def _rank0_raises_alone(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """A roll where rank 0 raises before sending and rank 1 waits for rank 0's message."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("rank 0 alone")
    dist.irecv(tensor=torch.zeros(1, dtype=tensor.dtype), src=0).wait()
    return tensor, tensor.sum()


@pytest.mark.distributed
def test_a_rank_raising_alone_is_reported_not_hung(worlds):
    """Rank 1's wait gives up after timeout_s; the finding comes back in the error, and the
    world (whose link gloo closed) is ended by the pool. Last: the next job starts a new world."""
    from tests.helpers.world import WorldFailed

    with pytest.raises(WorldFailed) as failed:
        worlds.run(
            2, mtp_roll.check_roll_on_rank, [3], 2, "padded", False, 2.0, _rank0_raises_alone
        )
    message = str(failed.value)
    assert "PointToPointTimeout" in message
    assert "rank 0: roll_tensor(labels, cu_seqlens_q=padded) raised ValueError: rank 0 alone" in (
        message
    )
    assert "waited 2 s" in message


@pytest.mark.stack_dependent
def test_negative_control_names_a_missing_line(monkeypatch):
    monkeypatch.setattr(mtp_roll, "MUTATED_LINE", "no such line")
    mtp_roll.broken_module.cache_clear()
    try:
        with pytest.raises(mtp_roll.CheckerError, match="no line `no such line`"):
            mtp_roll.broken_module()
    finally:
        mtp_roll.broken_module.cache_clear()


@pytest.mark.distributed
@pytest.mark.launches
@pytest.mark.stack_dependent
def test_the_cli_checks_the_installed_megatron_core(capsys):
    from recipe.checks.upstream.cli import main

    assert main(["megatron-core", "--cases", "4", "--fixed", "cu_seqlens_q=unpadded"]) == 1
    out = capsys.readouterr().out
    assert f"megatron-core@{megatron_version()} roll_tensor" in out
    assert "FAIL cu_seqlens_q = the real offsets" in out and "lengths=[" in out
    assert main(["megatron-core", "--cases", "4", "--fixed", "cu_seqlens_q=padded"]) == 0
    assert "PASS cu_seqlens_q = the padded offsets (as verl passes them): 8 cases" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["megatron-core@0.0.1"], "runs on real ranks with the installed release"),
        (["megatron-core", "--function", "x"], "no checked function 'x'"),
        (["megatron-core", "--control", "inverse"], "takes only --cases"),
        (["megatron-core", "--fixed", "cu_seqlens_q=other"], "one of padded, unpadded"),
    ],
)
def test_the_cli_refuses_what_megatron_core_cannot_check(argv, message, capsys):
    from recipe.checks.upstream.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
