"""The released CP functions of verl and Megatron-Bridge, loaded from their PyPI wheels.

Each finding that docs/upstream.md reports is pinned here by a direct call on the case the
checker shrank it to, so a test fails if a release, an adapter or the ground truth changes what
the check sees; each adapter's negative control (the function's own source with the back chunk's
start moved by one) must be flagged on a case the original passes, so no adapter can pass
everything. The wheels are fetched once by pip into the cache (`$RECIPE_UPSTREAM_CACHE`, default
`~/.cache/recipe/upstream`): these tests start pip, so they are marked `launches`.
"""

from __future__ import annotations

import pytest

from recipe.check_upstream import check_target, main
from recipe.parallel.cp.contract import first_mismatch
from recipe.upstream.adapters import (
    LIBRARIES,
    is_preprocess_spec,
    load,
    parse_preprocess_spec,
)
from recipe.upstream.source import UpstreamUnavailable

pytestmark = pytest.mark.launches

VERL_RELEASES = ("0.7.1", "0.8.0", "0.9.1")
BRIDGE = "0.6.2"
THD, PACKED = LIBRARIES["verl"].targets
QWEN3_VL, EXAONE45 = LIBRARIES["megatron-bridge"].targets


def _loaded(library: str, version: str, target):
    return load(library, version, target)


def _finding(loaded, lengths, cp=2, tp=1, **options) -> str | None:
    """What the checker says of one case: a mismatch, a raise, or None."""
    try:
        mismatch = first_mismatch(loaded.contract_function(options), lengths, cp, tp)
    except Exception as err:  # noqa: BLE001 (a raise on valid input is the finding)
        return f"raises {type(err).__name__}: {err}"
    return None if mismatch is None else mismatch.describe()


def test_verl_071_carries_the_pre_fix_position_formula():
    """The last release before PR #6267: rank 1's back chunk starts one position late."""
    loaded = _loaded("verl", "0.7.1", THD)
    assert loaded.function_name == "preprocess_thd_no_padding"  # renamed in 0.8.0
    assert _finding(loaded, [3]) == (
        "lengths=[3] cp=2 tp=1: rank 1, local slot 1 (sequence 0, position 2, chunk 2 = back): "
        "position_ids expected 2, got 3"
    )


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_verl_releases_with_the_fix_pass_at_their_defaults(version):
    loaded = _loaded("verl", version, THD)
    assert loaded.function_name == "preprocess_thd_engine"
    for lengths in ([3], [1], [8, 16], [9, 16, 24], [4803]):
        assert _finding(loaded, lengths) is None, lengths
    finding, ran = check_target(loaded, cases=40, seed=0, fixed={}, drawn=False)
    assert finding is None and ran == 40


@pytest.mark.parametrize("version", ["0.7.1", "0.8.0"])
def test_verl_fp8_padding_raises_on_a_short_sequence(version):
    """fp8 padding pads each sequence to lcm(16, 2*cp*tp) and the last to 2*cp*tp*128, but the
    sequence's tokens only to align_size: the copy into the back chunk cannot broadcast."""
    finding = _finding(_loaded("verl", version, THD), [1], use_fp8_padding=True)
    assert finding is not None and finding.startswith("raises RuntimeError: The expanded size")
    assert "(128) must match the existing size (16)" in finding


def test_verl_091_fixes_fp8_padding_but_its_minimum_rows_break_the_zigzag_split():
    loaded = _loaded("verl", "0.9.1", THD)
    assert _finding(loaded, [1], use_fp8_padding=True) is None
    for option in ({"min_local_rows": 3}, {"pad_to_length_bucket": 6}):
        assert _finding(loaded, [1], **option) == (
            "lengths=[1] cp=2 tp=1: rank 0: sequence 0's padded length 6 is not a multiple of "
            "2*cp=4: the zigzag chunks of megatron's CP attention cannot split it (and the "
            "function leaves rows of it on no rank)"
        ), option
    assert _finding(loaded, [1], min_local_rows=2, pad_to_length_bucket=4) is None


@pytest.mark.parametrize(
    "library, version, target",
    [("verl", "0.7.1", PACKED), ("megatron-bridge", BRIDGE, QWEN3_VL),
     ("megatron-bridge", BRIDGE, EXAONE45)],
    ids=["verl-0.7.1", "bridge-qwen3_vl", "bridge-exaone45"],
)  # fmt: skip
def test_packed_seqs_copies_with_an_unclamped_front_slice_raise_on_a_short_sequence(
    library, version, target
):
    """`d[half*r : half*(r+1)]` is empty on rank 1 for a one-token sequence at cp=2."""
    loaded = _loaded(library, version, target)
    assert _finding(loaded, [1]) == (
        "raises RuntimeError: The expanded size of the tensor (1) must match the existing size "
        "(0) at non-singleton dimension 0.  Target sizes: [1].  Tensor sizes: [0]"
    )
    assert _finding(loaded, [8, 16]) is None


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_verl_packed_seqs_reads_an_integer_mask_as_indices(version):
    """A 0/1 int64 attention mask indexes rows 0 and 1 instead of selecting the masked ones."""
    loaded = _loaded("verl", version, PACKED)
    assert _finding(loaded, [3], mask_dtype="bool") is None
    assert _finding(loaded, [3], mask_dtype="bool", mask_side="left") is None
    assert _finding(loaded, [3], mask_dtype="int64") == (
        "lengths=[3] cp=2 tp=1: rank 0, local slot 0 (sequence 0, position 0, chunk 0 = front): "
        "input_ids expected 1, got 2"
    )


def test_bridge_qwen3_vl_casts_the_mask_to_bool():
    assert _finding(_loaded("megatron-bridge", BRIDGE, QWEN3_VL), [3], mask_dtype="int64") is None


@pytest.mark.parametrize(
    "library, version, target",
    [*[("verl", v, t) for v in VERL_RELEASES for t in (THD, PACKED)],
     ("megatron-bridge", BRIDGE, QWEN3_VL), ("megatron-bridge", BRIDGE, EXAONE45)],
    ids=lambda v: getattr(v, "name", v),
)  # fmt: skip
def test_every_adapter_flags_its_broken_copy(library, version, target):
    """The negative control: on a case the release passes, its broken copy is flagged."""
    loaded = _loaded(library, version, target)
    case = [8, 16]  # no release has a finding here (the 0.7.1 THD one is in its positions)
    broken = _finding(loaded.broken_copy(), case)
    assert broken == (
        "lengths=[8, 16] cp=2 tp=1: rank 0, local slot 2 (sequence 0, position 6, chunk 3 = "
        "back): input_ids expected 7, got 8"
    )
    if (library, version, target) != ("verl", "0.7.1", THD):
        assert _finding(loaded, case) is None


def test_the_cli_exit_codes(capsys):
    assert main(["verl@0.7.1", "--function", "preprocess_thd_engine", "--cases", "30"]) == 1
    out = capsys.readouterr().out
    assert "(named preprocess_thd_no_padding in this release)" in out
    assert "FAIL default options" in out and "position_ids expected" in out
    fixed = ["--fixed", "min_local_rows=none", "--fixed", "pad_to_length_bucket=none"]
    assert main(["verl@0.9.1", "--function", "preprocess_thd_engine", "--cases", "25", *fixed]) == 0
    out = capsys.readouterr().out
    assert "PASS default options: 25 cases" in out and "PASS options drawn" in out
    assert "not drawn: cp_layout: zigzag only" in out
    control = ["verl@0.9.1", "--function", "preprocess_thd_engine", "--cases", "25", "--control"]
    assert main([*control, *fixed]) == 1
    assert "[broken copy]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nosuchlib"], "unknown library 'nosuchlib'"),
        (["verl@0.9.1", "--function", "nope"], "no checked function 'nope'"),
        (["verl@0.9.1", "--fixed", "use_fp8=true"], "not a drawn option"),
        (["verl@0.9.1", "--fixed", "oops"], "write KEY=VALUE"),
        (["verl@0.0.0"], "pip cannot fetch verl==0.0.0"),
    ],
)
def test_the_cli_cannot_run_exits_2_naming_the_problem(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_option_the_adapter_does_not_know_stops_the_check(monkeypatch, tmp_path):
    """A new option may change the layout: the check refuses instead of ignoring it."""
    source = tmp_path / "util.py"
    source.write_text("def preprocess_thd_engine(input_ids, new_layout_knob=1):\n    pass\n")
    monkeypatch.setattr(
        "recipe.upstream.adapters.source_file", lambda dist, version, rel: (source, "9.9")
    )
    with pytest.raises(UpstreamUnavailable, match="option the adapter does not know"):
        load("verl", "9.9", THD)


def test_training_spellings_of_a_released_function():
    assert parse_preprocess_spec("verl@0.7.1")[:2] == ("verl", "0.7.1")
    assert parse_preprocess_spec("verl@0.7.1")[2] is THD
    assert parse_preprocess_spec("verl@installed")[:2] == ("verl", None)
    spec = "megatron-bridge@0.6.2/exaone45.preprocess_packed_seqs"
    assert parse_preprocess_spec(spec)[2] is EXAONE45
    assert is_preprocess_spec("verl@0.7.1") and not is_preprocess_spec("my.module:fn")
    for bad, why in [("verl@", "names no version"), ("nope@1", "unknown library"),
                     ("verl@0.9.1/nope", "no checked function")]:  # fmt: skip
        with pytest.raises(UpstreamUnavailable, match=why):
            parse_preprocess_spec(bad)
