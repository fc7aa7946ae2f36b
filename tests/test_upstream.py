"""The released CP functions of verl and Megatron-Bridge, loaded from their PyPI wheels.

Each finding that docs/upstream.md reports is pinned here by a direct call on the case the
checker shrank it to, so a test fails if a release, an adapter or the ground truth changes what
the check sees. Each adapter's negative control (the function's own source with the back chunk's
start moved by one) is proved at the newest release by tests/test_upstream_plugins.py; here only
at the older verl releases, which that module does not load. The wheels are fetched once by pip
into the cache (`$RECIPE_UPSTREAM_CACHE`, default `~/.cache/recipe/upstream`): these tests start
pip, so they are marked `launches`.
"""

from __future__ import annotations

import pytest

from recipe.checks.upstream.cli import main
from recipe.checks.upstream.kit.released import load
from recipe.checks.upstream.runner import case_finding, check_mode, check_target
from recipe.config.preprocess import parse_preprocess
from recipe.parallel.cp.contract import first_mismatch
from recipe.upstream.releases import LIBRARIES, ParallelStateStandIn, parse_preprocess_spec
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
    [("verl", v, t) for v in VERL_RELEASES[:-1] for t in (THD, PACKED)],
    ids=lambda v: getattr(v, "name", v),
)  # fmt: skip
def test_every_adapter_flags_its_broken_copy(library, version, target):
    """The negative control: on a case the release passes, its broken copy is flagged. At the
    older verl releases only: the newest one's, and Megatron-Bridge's, are
    tests/test_upstream_plugins.py's."""
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
    no_fp8 = ["--fixed", "use_fp8_padding=false"]  # its own finding, pinned above
    assert (
        main(["verl@0.7.1", "--function", "preprocess_thd_engine", "--cases", "10", *no_fp8]) == 1
    )
    out = capsys.readouterr().out
    assert "(named preprocess_thd_no_padding in this release)" in out
    assert "FAIL default options" in out and "position_ids expected" in out
    fixed = ["--fixed", "min_local_rows=none", "--fixed", "pad_to_length_bucket=none"]
    assert main(["verl@0.9.1", "--function", "preprocess_thd_engine", "--cases", "10", *fixed]) == 0
    out = capsys.readouterr().out
    assert "PASS default options: 10 cases" in out and "PASS options drawn" in out
    assert "not drawn: cp_layout: zigzag only" in out
    control = ["verl@0.9.1", "--function", "preprocess_thd_engine", "--cases", "10", "--control"]
    assert main([*control, *fixed]) == 1
    assert "[broken copy: function]" in capsys.readouterr().out


def test_a_release_missing_one_family_has_the_others_checked(capsys):
    """verl 0.7.1 has no BSHD engine function (its BSHD one refuses cp > 1): the THD families are
    still checked and the pre-#6267 finding printed, exit 1 as docs/upstream.md says; only when
    nothing at all can be checked is it exit 2."""
    assert main(["verl@0.7.1", "--cases", "10", "--fixed", "use_fp8_padding=false"]) == 1
    out = capsys.readouterr().out
    assert "CANNOT CHECK preprocess_bshd_engine: verl@0.7.1 has no preprocess_bshd_engine" in out
    assert "FAIL default options" in out and "position_ids expected 2, got 3" in out
    assert main(["verl@0.7.1", "--function", "preprocess_bshd_engine"]) == 2
    assert "asserts cp_size == 1: no CP split to check" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["file", "under a file"])
def test_a_report_folder_that_cannot_be_written_is_refused_before_the_search(
    what, tmp_path, capsys, monkeypatch
):
    """(A read-only folder takes the same path as one under a file, an OSError on the write
    probe; the tests run as root, which writes read-only folders.)"""
    report = tmp_path / "report"
    report.write_text("")
    expected = f"--report {report} is a file; give a folder"
    if what == "under a file":
        report = report / "findings"
        expected = f"--report {report} cannot be written (Not a directory)"
    monkeypatch.setattr(
        "recipe.checks.upstream.runner.load_targets",
        lambda *a: pytest.fail("the search ran before the report folder was checked"),
    )
    assert main(["verl@0.9.1", "--report", str(report)]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nosuchlib"], "unknown library 'nosuchlib'"),
        (["verl@0.9.1", "--function", "nope"], "no checked function 'nope'"),
        (["verl@0.9.1", "--fixed", "use_fp8=true"], "not a drawn option"),
        (["verl@0.9.1", "--fixed", "oops"], "write KEY=VALUE"),
        (["verl@0.0.0"], "pip cannot fetch verl==0.0.0: ERROR: Could not find a version"),
        (["verl@not-a-version"], "'not-a-version' is not a version number; write one as PyPI"),
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
        "recipe.upstream.releases.source_file", lambda dist, version, rel: (source, "9.9")
    )
    with pytest.raises(UpstreamUnavailable, match="option the checker does not know"):
        load("verl", "9.9", THD)


def _cache_with_a_cut_wheel(monkeypatch, tmp_path, fetched: bytes | None):
    """A cache whose verl 9.9 wheel was cut short; pip (faked: no network) fetches `fetched`
    (a whole wheel when None)."""
    import io
    import zipfile

    from recipe.upstream import source

    monkeypatch.setenv("RECIPE_UPSTREAM_CACHE", str(tmp_path))
    whole = io.BytesIO()
    with zipfile.ZipFile(whole, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("verl/utils.py", "X = 1\n" * 100)
    name = "verl-9.9-py3-none-any.whl"
    (tmp_path / "verl-9.9").mkdir()
    (tmp_path / "verl-9.9" / name).write_bytes(whole.getvalue()[:40])

    def download(distribution, version, folder):
        (folder / name).write_bytes(whole.getvalue() if fetched is None else fetched)
        return folder / name

    monkeypatch.setattr(source, "_download_wheel", download)
    return source


def test_a_corrupt_cached_wheel_is_deleted_and_fetched_again(monkeypatch, tmp_path, caplog):
    """A wheel cut short in the cache ended in zipfile's BadZipFile traceback, without its path."""
    source = _cache_with_a_cut_wheel(monkeypatch, tmp_path, fetched=None)
    path = source.fetched_file("verl", "9.9", "verl/utils.py")
    assert path.read_text() == "X = 1\n" * 100
    wheel = tmp_path / "verl-9.9" / "verl-9.9-py3-none-any.whl"
    assert f"{wheel} in the upstream cache is not a readable wheel" in caplog.text
    assert "deleted it, fetching verl==9.9 again" in caplog.text
    assert not list((tmp_path / "verl-9.9").glob(".extract-*")), "no scratch left behind"


@pytest.mark.parametrize("damage", ["garbled", "cut short", "checksum lost"])
def test_a_damaged_extracted_file_is_extracted_again_from_the_intact_wheel(
    damage, monkeypatch, tmp_path, caplog
):
    """A damaged extracted file was read as the release's code: a SyntaxError with exit 1 (the
    finding code) or a wrong release blamed with exit 2. The intact wheel is not fetched again."""
    source = _cache_with_a_cut_wheel(monkeypatch, tmp_path, fetched=None)
    path = source.fetched_file("verl", "9.9", "verl/utils.py")
    monkeypatch.setattr(source, "_download_wheel", lambda *a: pytest.fail("fetched again"))
    if damage == "garbled":
        path.write_text("X = (\n")  # no longer Python: the SyntaxError of the report
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:7])
    else:
        path.with_name(path.name + ".sha256").unlink()  # a cache from before checksums
    caplog.clear()
    assert source.fetched_file("verl", "9.9", "verl/utils.py") == path
    assert path.read_text() == "X = 1\n" * 100
    assert f"{path} in the upstream cache does not match the checksum" in caplog.text
    caplog.clear()
    source.fetched_file("verl", "9.9", "verl/utils.py")
    assert "does not match" not in caplog.text, "an intact file is read as it is"


def test_a_fetched_wheel_that_cannot_be_read_names_the_file_and_the_fix(monkeypatch, tmp_path):
    source = _cache_with_a_cut_wheel(monkeypatch, tmp_path, fetched=b"an error page, not a zip")
    wheel = tmp_path / "verl-9.9" / "verl-9.9-py3-none-any.whl"
    with pytest.raises(UpstreamUnavailable) as info:
        source.fetched_file("verl", "9.9", "verl/utils.py")
    assert str(info.value).startswith(f"{wheel}, just fetched by pip, is not a readable wheel")
    assert "delete it and run again" in str(info.value)


def test_training_spellings_of_a_released_function():
    assert parse_preprocess_spec("verl@0.7.1")[:2] == ("verl", "0.7.1")
    assert parse_preprocess_spec("verl@0.7.1")[2] is THD
    assert parse_preprocess_spec("verl@installed")[:2] == ("verl", None)
    spec = "megatron-bridge@0.6.2/exaone45.preprocess_packed_seqs"
    assert parse_preprocess_spec(spec)[2] is EXAONE45
    assert parse_preprocess("verl@0.7.1").kind == "release"
    assert parse_preprocess("my.module:fn").kind == "function"
    for bad, why in [("verl@", "names no version"), ("nope@1", "unknown library"),
                     ("verl@0.9.1/nope", "no checked function")]:  # fmt: skip
        with pytest.raises(UpstreamUnavailable, match=why):
            parse_preprocess_spec(bad)


def test_training_refuses_a_release_that_cannot_be_had_at_start_up():
    from recipe.errors import ConfigError
    from recipe.launch.preflight import check_preprocess_function

    check_preprocess_function("index")  # not a release: nothing to fetch
    with pytest.raises(ConfigError, match=r"cp.preprocess=verl@0.0.0: pip cannot fetch"):
        check_preprocess_function("verl@0.0.0")


def test_the_start_up_check_stops_a_wrong_release_and_names_the_checker():
    from recipe.parallel.cp.contract import global_batch
    from recipe.parallel.cp.shard import PreprocessMismatch, shard_batch
    from recipe.training.preprocess import load_preprocess

    batch = global_batch([[5, 6, 7], list(range(1, 10))], cp_size=2, tp_size=1)
    loaded = load_preprocess("verl@0.7.1")
    with pytest.raises(PreprocessMismatch) as caught:
        shard_batch(batch, 2, 1, "verl@0.7.1", check=True, loaded=loaded)
    assert "position_ids expected" in str(caught.value)
    assert "python -m recipe.check_upstream verl@0.7.1" in str(caught.value)


def test_in_training_the_function_reads_megatrons_real_rank():
    """Inside a run the released function reads megatron's parallel state, as in its library;
    sharding for a rank the state does not hold is refused, not silently mixed."""
    from recipe.launch.local import lone_world
    from recipe.parallel.cp.contract import global_batch
    from recipe.parallel.cp.shard import shard_batch
    from recipe.upstream.releases import training_preprocess

    batch = global_batch([[5, 6, 7]], cp_size=2, tp_size=1)
    sequences = [batch.input_ids[:3]]
    with lone_world():
        with pytest.raises(RuntimeError, match=r"parallel state says \(cp size, cp rank, tp size"):
            training_preprocess("verl@0.9.1")(sequences, batch.cu_seqlens_padded, 2, 1)
        assert shard_batch(batch, 1, 0, "verl@0.9.1") is batch  # cp=1: no sharding at all


@pytest.mark.parametrize("version", VERL_RELEASES)
@pytest.mark.parametrize("target", [THD, PACKED], ids=lambda t: t.name)
def test_verl_gathers_back_what_it_sharded(version, target):
    """postprocess_* on every rank (the all-gather played by a stand-in that hands back every
    rank's shard) returns each sequence as it was; its broken copy is caught by the round trip."""
    loaded = _loaded("verl", version, target)
    assert loaded.inverse_name.startswith("postprocess_")
    for lengths, cp in [([3, 8], 2), ([9, 16, 24], 2), ([5, 12, 17], 4), ([4803], 2)]:
        assert loaded.round_trip_problem(lengths, cp, 1, {}) is None, (lengths, cp)
    broken = loaded.broken_copy("inverse")
    assert _finding(broken, [16, 8, 8]) == _finding(loaded, [16, 8, 8])  # sharding: the release's
    assert broken.round_trip_problem([16, 8, 8], 2, 1, {}) == (
        f"lengths=[16, 8, 8] cp=2 tp=1: rank 0: {loaded.inverse_name} gives sequence 0 back as "
        "[2, 3, 4, 13, 6, 7] ... (16 values), sharded from [1, 2, 3, 4, 5, 6] ... (16 values)"
    )
    with pytest.raises(RuntimeError, match="expanded size"):  # reads past the last sequence
        broken.round_trip_problem([8, 16], 2, 1, {})
    if version != "0.7.1":  # where the sharding passes, the checker reports the raise
        raises = case_finding(broken, (8, 16), 2, 1, {}).what
        assert f"the round trip through {loaded.inverse_name} raises RuntimeError" in raises


# Each finding again by a direct call of the released function (not through the checker), with
# the lines that cause it (file and line in the release's wheel).


def _direct(library: str, version: str, target, cp: int, rank: int):
    """The released function itself, reading cp rank `rank` of `cp` from the stand-in."""
    loaded = _loaded(library, version, target)
    loaded.module.mpu = ParallelStateStandIn(cp, rank, 1)
    return loaded.function


def _nested(*sequences):
    import torch

    return torch.nested.as_nested_tensor([torch.tensor(s) for s in sequences], layout=torch.jagged)


def test_direct_verl_071_back_chunk_positions():
    """verl 0.7.1 util.py:397-399 builds the back chunk's positions as
    arange(seqlen_padded_i - remain_len, seqlen_padded_i) (the padded end, not remain_start at
    :387). One 3-token sequence, cp=2: padded to 4, rank 1 holds positions 1 (front) and 2
    (back), token 13 is at position 2; 0.7.1 says 3. 0.8.0 (util.py:441) starts at remain_start."""
    tokens, _, positions = _direct("verl", "0.7.1", THD, 2, 1)(_nested([11, 12, 13]))
    assert tokens.tolist() == [[12, 13]] and positions.tolist() == [[1, 3]]
    tokens, _, positions = _direct("verl", "0.8.0", THD, 2, 1)(_nested([11, 12, 13]))
    assert tokens.tolist() == [[12, 13]] and positions.tolist() == [[1, 2]]


@pytest.mark.parametrize("version", ["0.7.1", "0.8.0"])
def test_direct_verl_fp8_padding_raises(version):
    """use_fp8_padding pads each sequence to lcm(16, 2*cp*tp) = 16 and the last one on to a
    multiple of 2*cp*tp*128 = 512 (0.8.0 util.py:363), but pads the sequence's own tokens only to
    align_size = 16 (util.py:409): rank 0's front slice of 128 rows reads 16. 0.9.1 pads the
    tokens to the sequence's padded length (util.py:480)."""
    with pytest.raises(RuntimeError, match=r"expanded size of the tensor \(128\) must match the "):
        _direct("verl", version, THD, 2, 0)(_nested([7]), use_fp8_padding=True)
    tokens, params, _ = _direct("verl", "0.9.1", THD, 2, 0)(_nested([7]), use_fp8_padding=True)
    assert params.cu_seqlens_q_padded.tolist() == [0, 512] and tokens[0, 0] == 7


@pytest.mark.parametrize("option", [{"min_local_rows": 3}, {"pad_to_length_bucket": 6}])
def test_direct_verl_091_pads_to_a_length_zigzag_cannot_split(option):
    """min_local_rows pads the last sequence to cp * min_local_rows (util.py:397-400),
    pad_to_length_bucket to lcm(bucket, cp) (util.py:406): neither keeps it a multiple of
    2*cp, so its 4 zigzag chunks are 1.5 rows and rows 2-3 (padding) are on no rank."""
    _, params, _ = _direct("verl", "0.9.1", THD, 2, 0)(_nested([7]), **option)
    assert params.cu_seqlens_q_padded.tolist() == [0, 6]


@pytest.mark.parametrize(
    "library, version, target, line",
    [("verl", "0.7.1", PACKED, "util.py:104-106"),
     ("megatron-bridge", BRIDGE, QWEN3_VL, "modelling_qwen3_vl/utils.py:769-772"),
     ("megatron-bridge", BRIDGE, EXAONE45, "modelling_exaone45/utils.py:635-638")],
    ids=["verl-0.7.1", "bridge-qwen3_vl", "bridge-exaone45"],
)  # fmt: skip
def test_direct_unclamped_front_slice_raises(library, version, target, line):
    """`d[half_seqlen * cp_rank : half_seqlen * (cp_rank + 1)]` is not clamped to the sequence
    (the line named): a one-token sequence at cp=2 has half_seqlen 1, and rank 1's slice d[1:2]
    is empty. verl 0.8.0 clamps it (util.py:107, first_end)."""
    import torch

    rows, mask = torch.tensor([[7, 0, 0]]), torch.tensor([[True, False, False]])
    with pytest.raises(RuntimeError, match=r"expanded size of the tensor \(1\) .* size \(0\)"):
        _direct(library, version, target, 2, 1)(rows, mask, pre_process=True)
    tokens, _ = _direct("verl", "0.8.0", PACKED, 2, 1)(rows, mask, pre_process=True)
    assert tokens.tolist() == [[0, 0]]  # rank 1 holds padding only


def test_direct_verl_packed_seqs_indexes_with_an_integer_mask():
    """`input_ids[i, attention_mask[i]]` (0.9.1 util.py:123) selects with a bool mask but
    gathers rows 1,1,1,0,0 with an int64 one; Bridge's qwen3_vl copy casts to bool first
    (utils.py:719-720)."""
    import torch

    rows = torch.tensor([[11, 12, 13, 0, 0]])
    int_mask = torch.tensor([[1, 1, 1, 0, 0]])
    tokens, _ = _direct("verl", "0.9.1", PACKED, 2, 0)(rows, int_mask, pre_process=True)
    assert tokens.tolist() == [[12, 11]]  # rank 0 holds rows 0 and 3 of [12, 12, 12, 11, 11]
    tokens, _ = _direct("verl", "0.9.1", PACKED, 2, 0)(rows, int_mask.bool(), pre_process=True)
    assert tokens.tolist() == [[11, 0]]  # position 0 and padding
    tokens, _ = _direct("megatron-bridge", BRIDGE, QWEN3_VL, 2, 0)(rows, int_mask, pre_process=True)
    assert tokens.tolist() == [[11, 0]]


@pytest.mark.parametrize(
    "library, version, target, fixed, drawn, classes",
    [
        ("verl", "0.7.1", THD, {}, False, [
            "[real tokens misplaced] options: defaults; lengths=[3] cp=2 tp=1: rank 1, local slot "
            "1 (sequence 0, position 2): position_ids expected 2, got 3"]),
        ("verl", "0.9.1", THD, {"use_fp8_padding": False}, True, [
            "[real tokens lost] options: pad_to_length_bucket=3, use_fp8_padding=False; "
            "lengths=[1, 9] cp=2 tp=1: 2 of 10 real tokens are on no rank (sequence 1 position 6, "
            "sequence 1 position 7)",
            "[padding only] options: pad_to_length_bucket=3, use_fp8_padding=False; lengths=[1] "
            "cp=2 tp=1: rank 0: sequence 0's padded length 6 is not a multiple of 2*cp=4"]),
        ("verl", "0.8.0", PACKED, {"use_fp8_padding": False, "mask_side": "right"}, True, [
            "[real tokens lost] options: mask_dtype=int64, mask_side=right, use_fp8_padding=False; "
            "lengths=[3] cp=2 tp=1: 1 of 3 real tokens are on no rank (sequence 0 position 2)",
            "[real tokens misplaced] options: mask_dtype=int64, mask_side=right, "
            "use_fp8_padding=False; lengths=[1] cp=2 tp=1: rank 0, local slot 0 (sequence 0, "
            "position 0, chunk 0 = front): input_ids expected 1, got 0"]),
        ("megatron-bridge", BRIDGE, QWEN3_VL, {}, False, [
            "[raises] options: defaults; lengths=[1] cp=2 tp=1: rank 1 raises RuntimeError: The "
            "expanded size of the tensor (1) must match the existing size (0)"]),
    ],
    ids=["verl-0.7.1-positions", "verl-0.9.1-length-bucket", "verl-0.8.0-int-mask",
         "bridge-short-sequence"],
)  # fmt: skip
def test_the_checker_reports_each_finding_at_its_worst_impact(
    library, version, target, fixed, drawn, classes
):
    """What docs/upstream.md reports, as the checker finds it (seed 0, a bounded case count):
    the first finding shrunk, then a search for each worse class, the worst first. verl 0.9.1's
    length bucket first shrinks to a padding-only case; searching on finds real tokens lost."""
    result = check_mode(_loaded(library, version, target), "mode", 60, 0, fixed, drawn)
    assert len(result.findings) == len(classes), [f.describe() for f in result.findings]
    for finding, minimal in zip(result.findings, classes, strict=True):
        assert finding.describe().startswith(minimal)


@pytest.mark.parametrize(
    "option, lengths, lost",
    [("pad_to_length_bucket", [3], "1 of 3 real tokens are on no rank (sequence 0 position 2)"),
     ("min_local_rows", [3], "1 of 3 real tokens are on no rank (sequence 0 position 2)")],
)  # fmt: skip
def test_verl_091_buckets_lose_real_tokens(option, lengths, lost):
    """The case a user tries (the issue's): one sequence of 3 tokens, cp=2, a bucket (or minimum
    rows) of 3 pads it to 6 (`util.py:397-406`); zigzag chunks of 6/4 rows leave token 2 on no
    rank. A sequence of 4 with bucket 6 loses tokens 2 and 3."""
    loaded = _loaded("verl", "0.9.1", THD)
    found = loaded.finding((tuple(lengths), 2, 1), {option: 3})
    assert found.impact.label == "real tokens lost" and lost in found.what
    four = loaded.finding(((4,), 2, 1), {"pad_to_length_bucket": 6})
    assert four.impact.label == "real tokens lost"
    assert "(sequence 0 position 2, sequence 0 position 3)" in four.what


def test_a_report_reproduces_on_the_release_and_passes_on_the_ground_truth(tmp_path, capsys):
    """--report: each finding a folder with README.md and reproduce.py; the script fails (exit 1,
    the wrong slots) on the release's wheel and accepts the ground truth's outputs."""
    import importlib.util
    import os
    import subprocess
    import sys

    from recipe.upstream.source import cache_root

    argv = ["verl@0.9.1", "--function", "preprocess_thd_engine", "--cases", "10",
            "--fixed", "use_fp8_padding=false", "--fixed", "min_local_rows=none",
            "--report", str(tmp_path)]  # fmt: skip
    assert main(argv) == 1
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [f.name for f in folders] == [
        "verl-0.9.1-preprocess-thd-engine-drawn-padding-only",
        "verl-0.9.1-preprocess-thd-engine-drawn-real-tokens-lost",
    ]
    lost = folders[1]
    readme = (lost / "README.md").read_text()
    assert "verl/models/mcore/util.py:335" in readme and "**real tokens lost**" in readme
    wheel = next((cache_root() / "verl-0.9.1").glob("*.whl"))
    scratch = tmp_path / "scratch"  # the script's temporary folders, which it must remove
    scratch.mkdir()
    # torch's compile cache is torch's own, kept on purpose: any module with a @torch.compile
    # (megatron-core's MoE router, when the release's imports reach it) makes it under the temp
    # folder unless told where
    env = {**os.environ, "TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ti")}
    done = subprocess.run([sys.executable, str(lost / "reproduce.py"), "--wheel", str(wheel)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 1 and "REPRODUCED" in done.stdout, done.stdout + done.stderr
    assert "is on no rank" in done.stdout
    assert list(scratch.iterdir()) == [], "the reproducer left its temporary files behind"
    spec = importlib.util.spec_from_file_location("reproduce", lost / "reproduce.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    loaded = _loaded("verl", "0.9.1", THD)
    finding = loaded.finding(tuple(script.CASE[k] for k in ("lengths", "cp", "tp")), script.OPTIONS)
    assert script.problems(loaded.truth_outputs(finding)) == []
    assert script.problems(script.release_outputs(wheel)) != []
