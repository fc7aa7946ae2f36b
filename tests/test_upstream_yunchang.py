"""yunchang 0.6.4's sequence-parallel shard functions (recipe/checks/upstream/libraries/
yunchang/), read from its PyPI wheel: `zigzag_extract_local`, `stripe_extract_local`,
`basic_extract_local` in yunchang/comm/extract_local.py, with the groups of
`set_seq_parallel_pg` (yunchang/globals.py).

Each finding is pinned twice: as the checker's search shrinks it (seed 0, a bounded case count),
and by a direct call of the released function on the minimal case, with the released file:line
that causes it. A broken copy has no reproducer and no inverse part (its finding is
tests/test_upstream_plugins.py's); each reproducer exits 1 on the release and accepts the ground
truth. The wheel is fetched once by pip into the cache (`$RECIPE_UPSTREAM_CACHE`): the tests that
need it are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.libraries import yunchang
from recipe.checks.upstream.libraries.yunchang import ranks, targets, truth
from recipe.upstream.source import UpstreamUnavailable, cache_root

VERSION = "0.6.4"
ZIGZAG, STRIPE, BASIC = (t.name for t in yunchang.LIBRARY.targets)
wheel_needed = pytest.mark.launches  # pip fetches the wheel on a cold cache


@pytest.fixture(scope="module")
def released():
    return {
        t.name: t.load("yunchang", yunchang.DISTRIBUTION, VERSION) for t in yunchang.LIBRARY.targets
    }


def _case(length, ring, ulysses, features=(), batch=1):
    return {
        "batch": batch,
        "length": length,
        "features": list(features),
        "ring": ring,
        "ulysses": ulysses,
    }


def _search(checked, cases, drawn, worst_from=None):
    """The checker's search: (minimal finding or None, cases run); `worst_from` keeps only
    findings of that impact class or worse (a way past a milder one)."""
    from hypothesis import strategies as st

    if drawn:
        options = st.fixed_dictionaries({k: st.sampled_from(v) for k, v in checked.drawn.items()})
    else:
        options = st.just({})

    def one(case):
        found = checked.finding(*case)
        if found is not None and worst_from is not None and found.impact < worst_from:
            return None
        return found

    return search(st.tuples(checked.cases(), options), one, cases, 0)


# The ground truth, by hand (no wheel needed).


def test_the_truth_lays_out_each_ring_layout_by_hand():
    """8 positions over ring 2 x ulysses 2, ulysses-low ranks (g = 2 * ring rank + ulysses rank):
    a ring rank's positions are cut in two, in order, among its ulysses ranks."""

    def positions(layout, low=True):
        shards = truth.truth_outputs(layout, _case(8, 2, 2), {"use_ulysses_low": low})
        return [[token - 1 for token in shard["ids"]] for shard in shards]

    assert positions("basic") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert positions("zigzag") == [[0, 1], [6, 7], [2, 3], [4, 5]]  # chunks 0+3, 1+2
    assert positions("stripe") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    # ring-low ranks (g = 2 * ulysses rank + ring rank): ranks 1 and 2 trade shards
    assert positions("basic", low=False) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    # a length the layout cannot split: padded at its tail (0 = padding, -1 here)
    shards = truth.truth_outputs("basic", _case(3, 2, 1), {})
    assert [s["ids"] for s in shards] == [[1, 2], [3, 0]]
    assert truth.layout_unit("zigzag", 2, 3) == 12 and truth.layout_unit("zigzag", 1, 3) == 3


def _fake_release(tmp_path, monkeypatch, extract_signature, pg_signature):
    """A release whose functions have these signatures (no wheel: source_file is faked)."""
    extract = tmp_path / "extract_local.py"
    body = "\n".join(f"def {name}({extract_signature}):\n    pass\n" for name in targets.LAYOUTS)
    extract.write_text(body)
    groups = tmp_path / "globals.py"
    groups.write_text(f"PROCESS_GROUP = None\ndef set_seq_parallel_pg({pg_signature}):\n    pass\n")
    files = {targets.EXTRACT_FILE: extract, targets.GLOBALS_FILE: groups}
    monkeypatch.setattr(
        "recipe.checks.upstream.libraries.yunchang.targets.source_file",
        lambda dist, version, rel: (files[rel], "9.9"),
    )


PG = "sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True"


@pytest.mark.parametrize(
    "extract_signature, pg_signature, unknown",
    [
        ("value, rank, world_size, rd, ud, dim=1, pad_to=None", PG, "'pad_to'"),
        ("value, rank, world_size, rd, ud", PG + ", use_ring_low=False", "'use_ring_low'"),
    ],
)
def test_an_option_the_checker_does_not_know_stops_the_check(
    tmp_path, monkeypatch, extract_signature, pg_signature, unknown
):
    """A new option of the functions or of set_seq_parallel_pg may change the layout."""
    _fake_release(tmp_path, monkeypatch, extract_signature, pg_signature)
    with pytest.raises(UpstreamUnavailable, match=f"option the checker does not know: {unknown}"):
        targets.ExtractTarget(ZIGZAG).load("yunchang", "yunchang", "9.9")


# The release.


def _play(checked, rank, ring, ulysses, low=True):
    """Rank `rank` of a ring x ulysses group for the released module, as the checker plays it:
    the release's set_seq_parallel_pg builds the groups; returns its PROCESS_GROUP."""
    checked.groups.torch = ranks.GroupMaker()
    checked.groups.set_seq_parallel_pg(ulysses, ring, rank, ring * ulysses, use_ulysses_low=low)
    checked.module.dist = ranks.DistOfRank(rank)
    return checked.groups.PROCESS_GROUP


@wheel_needed
def test_what_is_drawn_and_fixed(released):
    assert released[ZIGZAG].drawn == {"dim": (1, 2), "use_ulysses_low": (True, False)}
    assert released[STRIPE].drawn == released[BASIC].drawn == {"use_ulysses_low": (True, False)}
    assert "rd" not in released[BASIC].skipped  # basic takes rd, ud in **kwargs
    assert (released[STRIPE].line, released[BASIC].line, released[ZIGZAG].line) == (7, 25, 29)


@wheel_needed
@pytest.mark.parametrize("low", [True, False])
def test_the_releases_groups_are_the_ones_the_truth_assumes(released, low):
    """set_seq_parallel_pg (globals.py:22-81) with its own loops: the stand-in new_group records
    each group's ranks, and every rank's (ring, ulysses) ranks match the truth's model."""
    for ring, ulysses in targets.DEGREES:
        for rank in range(ring * ulysses):
            made = _play(released[ZIGZAG], rank, ring, ulysses, low)
            got = (made.RING_PG.ranks.index(rank), made.ULYSSES_PG.ranks.index(rank))
            assert got == truth.group_ranks(rank, ring, ulysses, low)


@wheel_needed
@pytest.mark.parametrize("name", [ZIGZAG, STRIPE, BASIC])
def test_every_function_lays_out_a_divisible_length_right_at_its_defaults(released, name):
    """No finding worse than a raise in 100 drawn cases (the raises are on lengths the layout
    cannot split, pinned below)."""
    found, ran = _search(released[name], 100, drawn=False, worst_from=Impact.MISPLACED)
    assert found is None and ran == 100
    for case in (_case(8, 2, 2, [2]), _case(24, 2, 3, [2, 3], batch=2), _case(12, 3, 2)):
        assert released[name].finding(case, {}) is None, case


@wheel_needed
@pytest.mark.parametrize(
    "name, minimal",
    [
        (ZIGZAG, "rank 0 raises IndexError: tuple index out of range"),
        (
            STRIPE,
            "rank 0 raises RuntimeError: shape '[1, 0, 2, -1]' is invalid for input of size 1",
        ),
        (BASIC, "rank 1 raises IndexError: tuple index out of range"),
    ],
)
def test_at_the_defaults_a_length_the_layout_cannot_split_raises(released, name, minimal):
    """The search's minimal case (seed 0): one element over ring 2. zigzag: chunk(4) of one
    position gives one chunk, and value_chunks[2 * rd - r_rank - 1] (extract_local.py:45) has no
    chunk 3; stripe: the reshape to (b, seqlen // rd, rd, -1) (:17) of 1 element; basic:
    chunk(2) gives one chunk, rank 1 has none (:26)."""
    found, _ = _search(released[name], 60, drawn=False)
    assert found.impact is Impact.RAISES
    assert found.what == f"batch=1 length=1 features=[] ring=2 ulysses=1: {minimal}"


@wheel_needed
def test_direct_basic_hands_out_unequal_shards_on_a_length_it_cannot_split(released):
    """basic_extract_local is `value.chunk(world_size, dim=1)[rank]` (extract_local.py:26):
    torch.chunk makes ceil(s / N)-long chunks, so 3 positions over 2 ranks are [0, 1] and [2],
    and 7 over 4 are 2, 2, 2, 1. Every position sits where the tail-padded layout puts it; the
    shard lengths differ, which yunchang's exchanges (empty_like of the local shard,
    ring/utils.py:94; all_to_all_single, comm/all_to_all.py:54) do not expect. The other two
    raise on such lengths (extract_local.py:17 and :49 reshape to seqlen // world_size)."""
    basic = released[BASIC].module.basic_extract_local
    value = torch.tensor([[10, 11, 12]])
    assert [basic(value, g, 2).tolist() for g in range(2)] == [[[10, 11]], [[12]]]
    assert [basic(torch.arange(7)[None], g, 4).shape[1] for g in range(4)] == [2, 2, 2, 1]
    found = released[BASIC].finding(_case(3, 2, 1), {})
    assert found.impact is Impact.PADDING
    assert found.what == (
        "batch=1 length=3 features=[] ring=2 ulysses=1: rank 1 (ring 1, ulysses 0) holds 1 "
        "position(s) where its shard has 2, the rest padding: its real elements sit right, but "
        "the ranks' shards are of unequal length"
    )
    for name in (ZIGZAG, STRIPE):
        assert released[name].finding(_case(3, 2, 1), {}).impact is Impact.RAISES


@wheel_needed
@pytest.mark.parametrize(
    "name, minimal",
    [
        (STRIPE, "rank 1 (ring 1, ulysses 0), local slot (0, 0): expected batch 0 position 1 "
                 "(id 2), got batch 0 position 2 (id 3)"),
        (BASIC, "rank 1 (ring 1, ulysses 0), local slot (0, 0): expected batch 0 position 3 "
                "(id 4), got batch 0 position 1 (id 2)"),
    ],
)  # fmt: skip
def test_with_ring_low_ranks_basic_and_stripe_put_shards_on_the_wrong_rank(released, name, minimal):
    """With options drawn the search (seed 0) past the raises finds use_ulysses_low=False: the
    minimal case it shrinks to is 6 positions over ring 2 x ulysses 3."""
    found, _ = _search(released[name], 100, drawn=True, worst_from=Impact.MISPLACED)
    assert found.impact is Impact.MISPLACED
    assert found.options == (("use_ulysses_low", False),)
    assert found.what == f"batch=1 length=6 features=[] ring=2 ulysses=3: {minimal}"
    assert _search(released[name], 100, drawn=True, worst_from=Impact.LOST) == (None, 100)


@wheel_needed
def test_direct_ring_low_ranks(released):
    """set_seq_parallel_pg(2, 2, g, 4, use_ulysses_low=False) makes ring groups {0, 1}, {2, 3}
    and ulysses groups {0, 2}, {1, 3} (globals.py:59-78): rank 1 is ring rank 1, ulysses rank 0,
    and LongContextAttention's all-to-all gives ring rank 1 the shards of ranks 1 and 3. For
    basic, ring rank 1 must hold positions 4-7, so rank 1 holds 4-5; basic_extract_local and
    stripe_extract_local take chunk `rank` of the sequence (extract_local.py:26 and :19), the
    order of ulysses-low ranks, and hand rank 1 positions 2-3. zigzag reads its ring and
    ulysses ranks from the groups (:38-39) and is right either way."""
    value = torch.arange(8)[None]
    made = _play(released[BASIC], 1, ring=2, ulysses=2, low=False)
    assert (made.RING_PG.ranks, made.ULYSSES_PG.ranks) == ([0, 1], [1, 3])
    basic = released[BASIC].module.basic_extract_local
    assert basic(value, 1, world_size=4, rd=2, ud=2).tolist() == [[2, 3]]
    _play(released[STRIPE], 1, ring=2, ulysses=2, low=False)
    stripe = released[STRIPE].module.stripe_extract_local
    assert stripe(value, 1, 4, 2, 2).tolist() == [[4, 6]]  # its shard: [1, 3] of 1, 3, 5, 7
    _play(released[ZIGZAG], 1, ring=2, ulysses=2, low=False)
    zigzag = released[ZIGZAG].module.zigzag_extract_local
    assert zigzag(value, 1, 4, 2, 2).tolist() == [[2, 3]]  # ring rank 1: chunks 1 + 2
    assert released[ZIGZAG].finding(_case(8, 2, 2), {"use_ulysses_low": False}) is None


@wheel_needed
def test_zigzag_on_dim_2_reshapes_across_the_feature_and_sequence_axes(released):
    """zigzag_extract_local chunks `dim` (extract_local.py:37, :44-46) but takes seqlen from
    value.shape[1] (:35) and reshapes to [batch, shape[1] // world_size, *shape[2:]] (:48-49):
    with the sequence on dim 2 the shard keeps its elements in order but comes back in the wrong
    shape when shape[1] divides by the world size, and raises otherwise. The search with options
    drawn (seed 0) finds the raise first, past it this (no element is lost: 100 cases)."""
    checked = released[ZIGZAG]
    found, _ = _search(checked, 60, drawn=True)
    assert found.impact is Impact.RAISES and ("dim", 2) in found.options
    found, _ = _search(checked, 100, drawn=True, worst_from=Impact.MISPLACED)
    assert found.options == (("dim", 2), ("use_ulysses_low", True))
    assert found.what == (
        "batch=1 length=4 features=[2] ring=2 ulysses=1 (value shape [1, 2, 4], chunked on dim "
        "2): rank 0 (ring 0, ulysses 0) returns shape [1, 1, 4]; its shard is [1, 2, 2]"
    )
    assert _search(checked, 100, drawn=True, worst_from=Impact.LOST) == (None, 100)
    _play(checked, 0, ring=2, ulysses=1)
    value = torch.arange(8).reshape(1, 2, 4)  # [batch, feature, seqlen]
    shard = checked.module.zigzag_extract_local(value, 0, 2, 2, 1, dim=2)
    assert shard.tolist() == [[[0, 3, 4, 7]]]  # [[0, 3], [4, 7]] (chunks 0 and 3) as [1, 1, 4]


@wheel_needed
@pytest.mark.parametrize("name", [ZIGZAG, STRIPE, BASIC])
def test_a_broken_copy_has_no_reproducer_and_no_inverse_to_break(released, name):
    """A reproducer runs the release from its wheel, never a broken copy; the functions have no
    inverse. (That the copy is flagged where the release passes: tests/test_upstream_plugins.py.)"""
    broken = released[name].broken_copy()
    assert broken.reproducer(broken.finding(_case(8, 2, 2, [2]), {})) is None
    with pytest.raises(UpstreamUnavailable, match="no inverse to break"):
        released[name].broken_copy("inverse")


# The reproducers: (function, case, options) of each finding above.
REPRODUCED = [
    (ZIGZAG, _case(1, 2, 1), {}),
    (ZIGZAG, _case(4, 2, 1, [2]), {"dim": 2, "use_ulysses_low": True}),
    (STRIPE, _case(1, 2, 1), {}),
    (STRIPE, _case(6, 2, 3), {"use_ulysses_low": False}),
    (BASIC, _case(3, 2, 1), {}),
    (BASIC, _case(6, 2, 3), {"use_ulysses_low": False}),
]
# Runs each script as __main__ with --wheel in one interpreter (torch imported once), recording
# its exit code: a process per script would cost a torch import each.
RUN_SCRIPTS = textwrap.dedent(
    """
    import json, runpy, sys
    wheel, scripts, codes = sys.argv[1], sys.argv[2:], []
    for script in scripts:
        sys.argv = [script, "--wheel", wheel]
        try:
            runpy.run_path(script, run_name="__main__")
            codes.append(0)
        except SystemExit as done:
            codes.append(done.code)
    print(json.dumps(codes))
    """
)


@wheel_needed
def test_each_reproducer_exits_1_on_the_release_and_accepts_the_truth(released, tmp_path):
    scripts = []
    for i, (name, case, options) in enumerate(REPRODUCED):
        checked = released[name]
        found = checked.finding(case, options)
        assert found is not None, (name, case, options)
        script = tmp_path / f"repro_{i}.py"
        script.write_text(checked.reproducer(found))
        scripts.append(str(script))
        spec = importlib.util.spec_from_file_location(f"repro_{i}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.problems(checked.truth_outputs(found)) == []
        assert found.what in module.problems(checked.outputs(case, options))
    wheel = next((cache_root() / f"yunchang-{VERSION}").glob("*.whl"))
    done = subprocess.run(
        [sys.executable, "-c", RUN_SCRIPTS, str(wheel), *scripts],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [1] * len(scripts)
    assert done.stdout.count(f"yunchang {VERSION}: REPRODUCED") == len(scripts)
