"""fla-core 0.6.0's `get_cp_cu_seqlens`, checked per rank.

The release passes: on every drawn case (lengths, world size 2/4/8, the contiguous and the
whole-stream zigzag layout, the padding as a sequence of its own or added to the last one) each
rank's local cu_seqlens and its state/conv metadata agree with the split
(`fla/ops/cp/context.py:174-274`). The tests pin that, the values worked out by hand
(lengths 5 and 11), that the negative control (`last_pos` one token late, context.py:163; its
finding is tests/test_upstream_plugins.py's) needs its line, and the reproducer end to end. The
wheel is fetched once by pip into the cache: marked `launches`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile

import pytest
import torch

from recipe.checks.search import search
from recipe.checks.upstream.libraries.fla import (
    CONTROL_LINE,
    CONTROL_REPLACEMENT,
    FILE,
    LIBRARY,
    call_outputs,
    context_problems,
    packed_cu_seqlens,
    reference_outputs,
    signature_options,
)
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

VERSION = "0.6.0"


@pytest.fixture(scope="module")
def checked():
    return LIBRARY.targets[0].load("fla-core", LIBRARY.distribution, VERSION)


def _search(checked, cases: int, drawn: bool):
    from hypothesis import strategies as st

    options = (
        st.fixed_dictionaries({k: st.sampled_from(v) for k, v in checked.drawn.items()})
        if drawn
        else st.just({})
    )
    return search(
        st.tuples(checked.cases(), options), lambda c: checked.finding(c[0], c[1]), cases, seed=0
    )


def test_the_release_is_loaded_with_its_options_drawn_or_fixed(checked):
    assert checked.line == 174  # `@tensor_cache` above `def get_cp_cu_seqlens` (175)
    assert checked.drawn == {
        "layout": ("contiguous", "zigzag"),
        "padding": ("own_sequence", "last_sequence"),
    }
    assert set(checked.skipped) == {
        "cu_seqlens", "cu_seqlens_cpu", "world_size", "rank", "group", "conv1d_kernel_size",
        "use_tf32x3_affine_chain", "kwargs",
    }  # fmt: skip


@pytest.mark.parametrize("drawn", [False, True], ids=["defaults", "drawn"])
def test_the_release_passes_a_short_search(checked, drawn):
    finding, ran = _search(checked, 40, drawn)
    assert finding is None and ran == 40


def test_the_hand_checked_values_of_lengths_5_and_11(checked):
    """Lengths 5 and 11 worked out by hand (T=16, W=2), by a direct call of the release."""
    bounds = torch.tensor([0, 5, 16], dtype=torch.int32)
    rank0 = checked.function(bounds, world_size=2, rank=0)
    rank1 = checked.function(bounds, world_size=2, rank=1)
    assert rank0.cu_seqlens.tolist() == [0, 5, 8] and rank0.post_num_ranks == 1
    assert rank1.cu_seqlens.tolist() == [0, 8] and rank1.pre_num_conv_tokens == 3
    zig = checked.function(bounds, world_size=2, rank=1, layout="zigzag")
    assert zig.cu_seqlens.tolist() == [0, 1, 4, 8] and zig.front_num_seqs == 2
    assert zig.pre_num_ranks_by_part == (1, 1) and zig.post_num_ranks_by_part == (2, 1)
    for layout in ("contiguous", "zigzag"):
        assert checked.finding(([5, 11], 2), {"layout": layout}) is None


def test_a_sequence_across_many_zigzag_slots(checked):
    """One 16-token sequence over 8 zigzag slots (W=4): rank 1 holds slots 1 and 6, whose
    states come from 1 and 6 earlier slots; the truth agrees with the release."""
    out = call_outputs(checked.function, [0, 16], 4, "zigzag")
    assert out[1]["pre_num_ranks_by_part"] == [1, 6]
    assert out[1]["post_num_ranks_by_part"] == [6, 1]
    assert out == reference_outputs([0, 16], 4, "zigzag")


def test_the_caller_pads_to_the_part_count():
    assert packed_cu_seqlens([5, 6], 4, "own_sequence") == [0, 5, 11, 12]
    assert packed_cu_seqlens([5, 6], 4, "last_sequence") == [0, 5, 12]
    assert packed_cu_seqlens([5, 7], 4, "own_sequence") == [0, 5, 12]


def test_the_broken_copy_needs_its_line(checked, monkeypatch):
    monkeypatch.setattr("recipe.checks.upstream.libraries.fla.CONTROL_LINE", "no such line")
    with pytest.raises(UpstreamUnavailable, match="negative control's line"):
        checked.broken_copy()


def test_an_unknown_option_refuses():
    def get_cp_cu_seqlens(cu_seqlens, world_size=None, rank=None, chunk_size=64):
        raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match="'chunk_size'"):
        signature_options(get_cp_cu_seqlens, "fla-core@9.9 get_cp_cu_seqlens")


def test_the_problems_name_a_lost_token():
    want = reference_outputs([0, 3, 8], 2, "contiguous")
    want[1]["cu_seqlens"] = [0, 3]  # one of rank 1's four tokens in no segment
    found = context_problems(want, [3, 5], [0, 3, 8], 2, "contiguous")
    assert found == [
        (4, "rank 1: cu_seqlens [0, 3] leaves local tokens 3..3 in no segment (expected [0, 4])")
    ]


def test_the_reproducer_runs_the_released_file(checked, tmp_path):
    """The release has no finding, so the reproducer is checked on the control's: it passes on
    the released wheel (in process), reproduces on a wheel carrying the control's line (exit 1,
    the one subprocess), and accepts the ground truth's outputs."""
    finding = checked.broken_copy().finding(([1], 2), {})
    path = tmp_path / "repro.py"
    path.write_text(checked.reproducer(finding))
    assert "import recipe" not in path.read_text()
    spec = importlib.util.spec_from_file_location("fla_repro", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.problems(checked.truth_outputs(finding)) == []
    wheel = next((cache_root() / f"fla-core-{VERSION}").glob("*.whl"))
    assert script.problems(script.release_outputs(wheel)) == []
    broken_wheel = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(broken_wheel, "w") as target:
        text = source.read(FILE).decode()
        assert CONTROL_LINE in text
        target.writestr(FILE, text.replace(CONTROL_LINE, CONTROL_REPLACEMENT))
    done = subprocess.run([sys.executable, str(path), "--wheel", str(broken_wheel)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 0: is_last_rank False, expected True" in done.stdout
    assert "REPRODUCED" in done.stdout
