"""OpenRLHF 0.11.2's ring-attention batch split (recipe/checks/upstream/libraries/openrlhf.py),
read from its PyPI wheel (`openrlhf-0.11.2.data/purelib/openrlhf/models/ring_attn_utils.py`).

- unpad_and_slice_tensor (line 103) with its inverse gather_and_pad_tensor (:151), as
  Actor.forward calls them: the release passes (right and left padding, ring sizes 2/4/8).
- get_tensor_in_current_ring_attn_rank (:72): passes on the (1, N) row OpenRLHF gives it; on the
  (batch, seqlen) its docstring also names, it slices columns by numel() // W (:94-96), pinned
  twice (the search's minimal case and a direct call).
The inverse's broken copy is flagged where the release passes (the functions' are
tests/test_upstream_plugins.py's); an unknown option refuses the check; the reproducer exits 1 on
the wheel and accepts the ground truth. pip fetches the wheel once into the cache
(`$RECIPE_UPSTREAM_CACHE`), so the tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.kit.checked import Finding
from recipe.checks.upstream.libraries import openrlhf
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

VERSION = "0.11.2"
FILE = f"openrlhf-{VERSION}.data/purelib/openrlhf/models/ring_attn_utils.py"


@pytest.fixture(scope="module")
def released():
    return {t.kind: t.load("openrlhf", "openrlhf", VERSION) for t in openrlhf.TARGETS}


def _search(checked, cases: int, options=None):
    """The checker's search (seed 0): (the minimal finding or None, cases run)."""
    from hypothesis import strategies as st

    drawn = st.just(options or {})
    one = lambda case: checked.finding(case[0], case[1])  # noqa: E731
    return search(st.tuples(checked.cases(), drawn), one, cases, seed=0)


def _line(number: int) -> str:
    path = cache_root() / f"openrlhf-{VERSION}" / "files" / FILE
    return path.read_text().splitlines()[number - 1].strip()


def test_the_release_is_loaded_with_every_option_drawn_or_fixed(released):
    assert [(c.name, c.file, c.line) for c in released.values()] == [
        ("unpad_and_slice_tensor", FILE, 103),
        ("get_tensor_in_current_ring_attn_rank", FILE, 72),
    ]
    assert released["unpad"].drawn == {"padding": ("right", "left")}
    inverse = ("tensor", "ring_attn_group", "ring_attn_pad_len", "indices", "batch", "seqlen")
    inverse = {f"gather_and_pad_tensor.{k}" for k in inverse}
    assert (
        set(released["unpad"].skipped)
        == {"sequences", "attention_mask", "ring_attn_group"} | inverse
    )
    assert released["unpad"].inverse_name == "gather_and_pad_tensor"
    assert released["slice"].drawn == {"shape": ("packed", "rows")}
    assert set(released["slice"].skipped) == {"tensors", "ring_attn_group", "pad_id"}


@pytest.mark.parametrize("options", [{}, {"padding": "left"}])
def test_unpad_and_slice_passes_a_short_search(released, options):
    assert _search(released["unpad"], 40, options) == (None, 40)


def test_unpad_and_slice_direct_call_as_the_actor_makes_it(released):
    """Rows of 5 and 11, ring size 2 (no stream padding): rank 0 holds slots 0-7, rank 1 slots
    8-15, positions per sample, labels rolled per row (a full row's last wraps to its own first
    token, which the actor drops); ring-flash-attn gets the global cu_seqlens."""
    got = openrlhf.rank_outputs("unpad", released["unpad"].module, [5, 11], 2, "right")
    zero, one = got["ranks"]
    assert zero["input_ids"] == [[1, 2, 3, 4, 5, 13, 14, 15]]
    assert zero["position_ids"] == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert zero["labels"] == [[2, 3, 4, 5, 0, 14, 15, 16]]
    assert one["position_ids"] == [[3, 4, 5, 6, 7, 8, 9, 10]]
    assert one["labels"] == [[17, 18, 19, 20, 21, 22, 23, 13]]
    assert zero["cu_seqlens"] == one["cu_seqlens"] == [0, 5, 16]
    assert zero["round_trip"][0] == [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0]
    # left padding, a stream padded by 1 at ring size 2: the padding joins the last sample
    left = openrlhf.rank_outputs("unpad", released["unpad"].module, [3, 2], 2, "left")
    assert [r["position_ids"] for r in left["ranks"]] == [[[0, 1, 2]], [[0, 1, 0]]]
    assert left["ranks"][1]["cu_seqlens"] == [0, 3, 6] and left["ranks"][1]["pad_len"] == 1
    assert left["ranks"][0]["round_trip"] == [[1, 2, 3], [0, 5, 6]]
    assert _line(146) == "cu_seqlens[-1] += ring_attn_pad_len"


def test_slice_passes_on_the_packed_row_openrlhf_gives_it(released):
    assert _search(released["slice"], 40) == (None, 40)


def test_slice_of_batch_rows_misplaces_minimal_case(released):
    """shape=rows, lengths [1, 1] over 2 ranks: the rows [[1], [3]] are padded to 2 columns and
    each rank should hold one; the slice takes numel() // 2 = 2 columns from rank * 2, so rank 0
    holds both and rank 1 none (ring_attn_utils.py:94-96). The docstring (:76) names (batch,
    seqlen) inputs; OpenRLHF itself passes only (1, total_seqs) (:143)."""
    found, _ = _search(released["slice"], 30, {"shape": "rows"})
    assert found.impact is Impact.MISPLACED
    assert found.case == {"lengths": [1, 1], "world_size": 2}
    assert found.what == (
        "lengths=[1, 1] ring size 2: rank 0: input_ids of shape [2, 2], expected [2, 1]"
    )
    function = released["slice"].module.get_tensor_in_current_ring_attn_rank
    rows = torch.tensor([[1], [3]])
    assert [function(rows, (2, r), 0)[0].tolist() for r in (0, 1)] == [[[1, 0], [3, 0]], [[], []]]
    assert _line(76) == "tensors: Each tensor shaped (batch, seqlen) or (1, total_seqs)"
    assert _line(94) == "local_seq_len = tensor.numel() // ring_attn_size"
    assert _line(96) == "tensor = tensor[:, start:end]"


@pytest.mark.parametrize(
    "kind, part, case, what",
    [  # the "function" part's: tests/test_upstream_plugins.py
        ("unpad", "inverse", ([5, 10], 2), "rank 0, round_trip [0, 0] (sample 0, position 0): "
         "expected 1, got 2"),
    ],
)  # fmt: skip
def test_the_broken_copies_are_flagged_where_the_release_passes(released, kind, part, case, what):
    assert released[kind].finding(case, {}) is None
    found = released[kind].broken_copy(part).finding(case, {})
    assert found is not None and found.what.endswith(what)


def test_an_unknown_option_refuses(released):
    def unpad_and_slice_tensor(sequences, attention_mask, ring_attn_group, pad_to=None):
        raise AssertionError("never called")

    gather = released["unpad"].module.gather_and_pad_tensor
    module = types.SimpleNamespace(unpad_and_slice_tensor=unpad_and_slice_tensor,
                                   gather_and_pad_tensor=gather)  # fmt: skip
    with pytest.raises(UpstreamUnavailable, match="does not know: 'pad_to'"):
        openrlhf.signature_options("unpad", module, "openrlhf@9.9 unpad_and_slice_tensor")


def test_the_reproducer_exits_1_on_the_release_and_accepts_the_truth(released, tmp_path):
    wheel = next((cache_root() / f"openrlhf-{VERSION}").glob("*.whl"))
    finding = released["slice"].finding(([1, 1], 2), {"shape": "rows"})
    path = tmp_path / "repro.py"
    path.write_text(released["slice"].reproducer(finding))
    assert "import recipe" not in path.read_text()
    command = [sys.executable, str(path), "--wheel", str(wheel)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spec = importlib.util.spec_from_file_location("openrlhf_repro", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.problems(released["slice"].truth_outputs(finding)) == []
    # the same script's truth check on the unpad kind's layout (left padding, stream padding)
    for lengths, world, padding in (([3, 1], 2, "left"), ([5, 10, 7], 4, "right")):
        case = Finding({"lengths": lengths, "world_size": world}, (("padding", padding),),
                       Impact.PADDING, "")  # fmt: skip
        script.KIND, script.CASE, script.OPTION = "unpad", case.case, padding
        assert script.problems(released["unpad"].truth_outputs(case)) == []
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, out + err
    assert out.splitlines() == [
        "rank 0: input_ids of shape [2, 2], expected [2, 1]",
        "rank 1: input_ids of shape [2, 0], expected [2, 1]",
        "openrlhf 0.11.2: REPRODUCED",
    ]
