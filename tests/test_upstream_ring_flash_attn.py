"""ring-flash-attn 0.1.8's `llama3_flash_attn_prepare_cu_seqlens`, checked as attention spans.

The release passes: on every drawn case (lengths, world size 2/4/8, causal or not, OpenRLHF's
padding or a padding sequence of its own) every local query gets exactly the keys of its own
sequence up to itself, as flash-attn's varlen kernel computes them from the five returned values
(`ring_flash_attn/llama3_flash_attn_varlen.py:10-60`). The tests pin that, the bottom-right
causal alignment the span model assumes (flash-attn's documented semantics), that the negative
control (`slice_right` one past the rank's end, line 47; its finding is
tests/test_upstream_plugins.py's) needs its line, and the reproducer end to end. The wheel is
fetched once by pip into the cache, so these tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile

import pytest
import torch

from recipe.checks.search import search
from recipe.checks.upstream.libraries.ring_flash_attn import (
    CONTROL_LINE,
    FILE,
    LIBRARY,
    call_outputs,
    kernel_spans,
    packed_cu_seqlens,
    reference_outputs,
    signature_options,
    span_problems,
)
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

VERSION = "0.1.8"


@pytest.fixture(scope="module")
def checked():
    return LIBRARY.targets[0].load("ring-flash-attn", LIBRARY.distribution, VERSION)


def _search(checked, cases: int, drawn: bool, keep=lambda finding: True):
    from hypothesis import strategies as st

    options = (
        st.fixed_dictionaries({k: st.sampled_from(v) for k, v in checked.drawn.items()})
        if drawn
        else st.just({})
    )

    def one(case):
        finding = checked.finding(case[0], case[1])
        return finding if finding is not None and keep(finding) else None

    return search(st.tuples(checked.cases(), options), one, cases, seed=0)


def test_the_release_is_loaded_with_its_options_drawn_or_fixed(checked):
    assert checked.line == 10  # the def line in the wheel
    assert checked.drawn == {"padding": ("last_sequence", "own_sequence"), "causal": (True, False)}
    assert set(checked.skipped) == {"cu_seqlens", "rank", "world_size"}


@pytest.mark.parametrize("drawn", [False, True], ids=["defaults", "drawn"])
def test_the_release_passes_the_span_search(checked, drawn):
    finding, ran = _search(checked, 80, drawn)
    assert finding is None and ran == 80


def test_a_sequence_across_the_rank_boundary_keeps_its_earlier_keys(checked):
    """[3, 2, 3] on 2 ranks (4 tokens each): rank 1's first query is token 4, position 1 of the
    sequence [3, 5). Its batch entry has 1 query and 2 keys (tokens 3 and 4 of the gathered
    stream, from local_k_slice 3:8); bottom-right alignment gives it both, and nothing else."""
    cu_q, cu_k, max_q, max_k, local = checked.function(
        torch.tensor([0, 3, 5, 8], dtype=torch.int32), True, 1, 2
    )
    assert (cu_q.tolist(), cu_k.tolist(), max_q, max_k, local) == (
        [0, 1, 4], [0, 2, 5], 3, 3, slice(3, 8)
    )  # fmt: skip
    outputs = call_outputs(checked.function, [0, 3, 5, 8], True, 2)
    spans, problems = kernel_spans(outputs[1], per_rank=4, total=8, causal=True)
    assert spans == [[(3, 5)], [(5, 6)], [(5, 7)], [(5, 8)]] and problems == []
    assert checked.finding(([3, 2, 3], 2), {}) is None


def test_openrlhf_padding_joins_the_last_sequence():
    """OpenRLHF pads the packed stream to a multiple of the ring size and adds the padding to
    the last sequence (`cu_seqlens[-1] += ring_attn_pad_len`)."""
    assert packed_cu_seqlens([3, 2], 4, "last_sequence") == [0, 3, 8]
    assert packed_cu_seqlens([3, 2], 4, "own_sequence") == [0, 3, 5, 8]
    assert packed_cu_seqlens([3, 1], 4, "own_sequence") == [0, 3, 4]


def test_the_span_model_aligns_causal_masks_bottom_right():
    """flash-attn's docstring (>= 2.1): seqlen_q=2, seqlen_k=5 keeps 1 1 1 1 0 / 1 1 1 1 1;
    seqlen_q=5, seqlen_k=2 keeps nothing in rows 0-2, then 1 0, then 1 1."""
    out = {"cu_seqlens_q": [0, 2], "cu_seqlens_k": [0, 5], "max_seqlen_q": 2,
           "max_seqlen_k": 5, "local_k_slice": [0, 5, None]}  # fmt: skip
    assert kernel_spans(out, per_rank=2, total=5, causal=True)[0] == [[(0, 4)], [(0, 5)]]
    out = {"cu_seqlens_q": [0, 5], "cu_seqlens_k": [0, 2], "max_seqlen_q": 5,
           "max_seqlen_k": 2, "local_k_slice": [0, 2, None]}  # fmt: skip
    spans = kernel_spans(out, per_rank=5, total=5, causal=True)[0]
    assert spans[:3] == [["no key (a zero output)"]] * 3 and spans[3:] == [[(0, 1)], [(0, 2)]]
    out["max_seqlen_q"] = 4  # the kernel launches 4 rows: the 5th query is never computed
    assert kernel_spans(out, per_rank=5, total=5, causal=True)[0][4] == []


def test_the_reference_outputs_pass_the_span_check():
    for lengths, world_size in [([1], 2), ([3, 2, 3], 2), ([7, 1, 9], 4), ([1, 1, 1], 8)]:
        for causal in (True, False):
            for padding in ("last_sequence", "own_sequence"):
                outputs = reference_outputs(lengths, world_size, causal, padding)
                assert span_problems(outputs, lengths, world_size, causal, padding) == []


def test_the_broken_copy_needs_its_line(checked, monkeypatch):
    monkeypatch.setattr(
        "recipe.checks.upstream.libraries.ring_flash_attn.CONTROL_LINE", "no such line"
    )
    with pytest.raises(UpstreamUnavailable, match="negative control's line"):
        checked.broken_copy()


def test_an_unknown_option_refuses():
    def prepare(cu_seqlens, causal, rank, world_size, heads_k_stride=1):
        raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match="'heads_k_stride'"):
        signature_options(prepare, "ring-flash-attn@9.9 prepare")


def _script(tmp_path, checked, finding):
    path = tmp_path / "repro.py"
    path.write_text(checked.reproducer(finding))
    spec = importlib.util.spec_from_file_location("ring_repro", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_the_reproducer_runs_the_released_file(checked, tmp_path):
    """The release has no finding, so the reproducer is checked on the control's: it passes on
    the released wheel (exit 0), reproduces on a wheel carrying the control's line (exit 1),
    and accepts the ground truth's outputs."""
    finding = checked.broken_copy().finding(([1], 2), {})
    path, script = _script(tmp_path, checked, finding)
    assert "import recipe" not in path.read_text()
    assert script.problems(checked.truth_outputs(finding)) == []
    wheel = next((cache_root() / f"ring-flash-attn-{VERSION}").glob("*.whl"))
    done = subprocess.run([sys.executable, str(path), "--wheel", str(wheel)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not reproduced: passes" in done.stdout
    broken_wheel = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(broken_wheel, "w") as target:
        text = source.read(FILE).decode()
        assert CONTROL_LINE in text
        target.writestr(FILE, text.replace(CONTROL_LINE, CONTROL_LINE + " + 1"))
    done = subprocess.run([sys.executable, str(path), "--wheel", str(broken_wheel)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "keys expected [0, 1), got: keys [0, 2)" in done.stdout
    assert "REPRODUCED" in done.stdout
