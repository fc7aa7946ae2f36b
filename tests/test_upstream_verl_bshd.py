"""verl's BSHD engine path (`recipe/checks/upstream/libraries/verl/`), loaded from the released
wheels.

`preprocess_bshd_engine` (0.9.1 `verl/models/mcore/util.py:658`, 0.8.0 `:564`) pads every row of
the nested batch to one length M and splits each row as one zigzag sequence; with its attention
mask and the round trip through `postprocess_bshd_engine` (0.9.1 `:775`, 0.8.0 `:671`) it passes
every case drawn (200 per mode, seed 0, in the report): no finding to pin. 0.7.1 has only
`preprocess_bshd_no_padding` (`:502`), which asserts cp_size == 1 (`:511`). The wheels come
from pip into the upstream cache, so these tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest
import torch
from hypothesis import strategies as st

from recipe.checks.assess import Impact, micro_batches
from recipe.checks.search import search
from recipe.checks.upstream.kit.checked import Finding
from recipe.checks.upstream.libraries import verl as verl_bshd
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

TARGET = verl_bshd.TARGETS[0]


@pytest.fixture(scope="module")
def released():
    return {v: TARGET.load("verl", "verl", v) for v in verl_bshd.RELEASES}


def test_0_7_1_refuses_cp_so_it_is_not_a_release_checked():
    with pytest.raises(UpstreamUnavailable, match=r"preprocess_bshd_no_padding .*:502\) asserts"):
        TARGET.load("verl", "verl", "0.7.1")
    assert verl_bshd.RELEASES == ("0.8.0", "0.9.1")


def test_the_released_lines_and_options(released):
    assert released["0.8.0"].line == 564 and released["0.9.1"].line == 658
    assert "forced_max_seqlen" not in released["0.8.0"].drawn  # added in 0.9.1
    assert set(released["0.9.1"].drawn) == {"use_fp8_padding", "forced_max_seqlen", "output_width"}
    assert set(released["0.9.1"].skipped) == {"input_ids", "pre_process", "need_roll"}


def test_each_row_is_one_zigzag_sequence_padded_to_the_longest():
    """A direct call on lengths [3, 8] at cp=2: M = 8, chunks of 2, rank 1 holds positions
    2-5 of each row; the mask marks the one real token of row 0 there."""
    module = TARGET.load("verl", "verl", "0.9.1").module
    module.mpu = ParallelStateStandIn(2, 1, 1)
    ids = torch.nested.as_nested_tensor(
        [torch.arange(1, 4), torch.arange(10, 18)], layout=torch.jagged
    )
    tokens, mask, positions = module.preprocess_bshd_engine(ids)
    assert tokens.tolist() == [[3, 0, 0, 0], [12, 13, 14, 15]]
    assert mask.tolist() == [[True, False, False, False], [True] * 4]
    assert positions.tolist() == [[2, 3, 4, 5]] * 2


@pytest.mark.parametrize("version", verl_bshd.RELEASES)
@pytest.mark.parametrize(
    "lengths, options",
    [([1], {}), ([3, 8], {}), ([5, 1, 17], {"use_fp8_padding": True}),
     ([3, 8], {"output_width": 3})],
)  # fmt: skip
def test_the_releases_pass(released, version, lengths, options):
    assert released[version].finding((lengths, 2, 2), options) is None


def test_forced_max_seqlen_passes(released):
    checked = released["0.9.1"]
    for forced in ("longest", "longest+1", "longest+7"):
        assert checked.finding(([3, 8], 4, 1), {"forced_max_seqlen": forced}) is None, forced


def test_a_short_search_with_options_drawn_passes(released):
    checked = released["0.9.1"]
    options = st.fixed_dictionaries({k: st.sampled_from(v) for k, v in checked.drawn.items()})
    strategy = st.tuples(micro_batches(max_sequences=4, max_length=40), options)

    def one(case):
        return checked.finding(case[0], {k: v for k, v in case[1].items() if v is not None})

    assert search(strategy, one, cases=12, seed=0) == (None, 12)


@pytest.mark.parametrize("version", verl_bshd.RELEASES)
def test_the_broken_copies_are_flagged(released, version):
    """On a case the release passes: the front chunk one row late (`first_start + 1`) leaves
    each row's first token on no rank; the gather taking the back half's mask from the front
    half returns the wrong tokens. The function's copy at the newest release is
    tests/test_upstream_plugins.py's."""
    checked = released[version]
    case = ([8, 16], 2, 1)
    assert checked.finding(case, {}) is None
    if version != verl_bshd.RELEASES[-1]:
        function = checked.broken_copy("function").finding(case, {})
        assert function.impact is Impact.LOST
        assert function.what == (
            "lengths=[8, 16] cp=2 tp=1: 2 of 24 real tokens are on no rank (sequence 0 position "
            "0, sequence 1 position 0): they never train"
        )
    inverse = checked.broken_copy("inverse").finding(case, {})
    assert inverse.impact is Impact.MISPLACED
    assert inverse.what.startswith(
        "lengths=[8, 16] cp=2 tp=1: rank 0: postprocess_bshd_engine gives sequence 0 back as"
    )


def _script(tmp_path, source):
    path = tmp_path / "repro.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("repro_verl_bshd", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_the_reproducer_passes_on_the_release_and_judges_like_the_ground_truth(tmp_path, released):
    checked = released["0.9.1"]
    options = {"use_fp8_padding": True, "forced_max_seqlen": "longest+7", "output_width": 3}
    finding = Finding({"lengths": [3, 8], "cp": 2, "tp": 1}, tuple(sorted(options.items())),
                      Impact.PADDING, "a passing case")  # fmt: skip
    path, script = _script(tmp_path, checked.reproducer(finding))
    wheel = next((cache_root() / "verl-0.9.1").glob("*.whl"))
    done = subprocess.run([sys.executable, str(path), "--wheel", str(wheel)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    truth = checked.truth_outputs(finding)
    assert script.problems(truth) == []
    truth["ranks"][1]["attention_mask"][0] = 0
    truth["round_trip"][0][1][0] = [0.0, 0.0, 0.0]
    assert script.problems(truth) == [
        "rank 1, local slot 0 (sequence 0, position 1): attention_mask expected 1, got 0",
        "rank 0: the round trip gives sequence 1 back as [[0.0, 0.0, 0.0], [11.0, 11.25, 11.5], "
        "[12.0, 12.25, 12.5], [13.0, 13.25, 13.5], [14.0, 14.25, 14.5], [15.0, 15.25, 15.5]], "
        "sharded from [[10.0, 10.25, 10.5], [11.0, 11.25, 11.5], [12.0, 12.25, 12.5], "
        "[13.0, 13.25, 13.5], [14.0, 14.25, 14.5], [15.0, 15.25, 15.5]]",
    ]


def _with_function(monkeypatch, replace):
    """Load the release with its preprocess_bshd_engine replaced by `replace(original)`."""
    real = verl_bshd.load_module

    def load_module(*args, **kwargs):
        module = real(*args, **kwargs)
        module.preprocess_bshd_engine = replace(module.preprocess_bshd_engine)
        return module

    monkeypatch.setattr(verl_bshd, "load_module", load_module)


def test_an_unknown_option_refuses(monkeypatch):
    def replace(original):
        def preprocess_bshd_engine(input_ids, pre_process=True, need_roll=False, pad_to=None):
            return original(input_ids, pre_process, need_roll)

        return preprocess_bshd_engine

    _with_function(monkeypatch, replace)
    with pytest.raises(UpstreamUnavailable, match="option the checker does not know: 'pad_to'"):
        TARGET.load("verl", "verl", "0.9.1")


def test_a_release_reading_pre_process_refuses(monkeypatch, tmp_path):
    def replace(original):
        source = inspect.getsource(original).replace(
            "cp_size = mpu.get_context_parallel_world_size()",
            "cp_size = mpu.get_context_parallel_world_size() if pre_process else 1",
        )
        path = tmp_path / "changed.py"  # a file, so that the checker can read the source
        path.write_text(source)
        namespace = dict(original.__globals__)
        exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 (one line changed)
        return namespace["preprocess_bshd_engine"]

    _with_function(monkeypatch, replace)
    with pytest.raises(UpstreamUnavailable, match="now reads pre_process"):
        TARGET.load("verl", "verl", "0.9.1")
