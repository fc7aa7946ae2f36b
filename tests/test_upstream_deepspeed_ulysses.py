"""DeepSpeed 0.19.8's `UlyssesSPDataLoaderAdapter` (`deepspeed/runtime/sequence_parallel/
ulysses_sp.py:571`), the ALST/Ulysses data adapter, on packed rows of several documents
(recipe/checks/upstream/libraries/deepspeed_ulysses.py).

The findings, each pinned by the checker's shrunk case and by a direct call: the labels are
shifted over the whole packed row before the split (ulysses_sp.py:713-714), so with labels equal
to the token ids the last token of each document learns the next document's first token (real
tokens misplaced at the defaults); an unpadded row whose length sp does not divide raises
ValueError (:706-707). With -100 at each document's first label and rows padded to a multiple of
sp everything passes. An unknown option refuses the check; the reproducer exits 1 on the sdist
and accepts the ground truth (the broken copy is tests/test_upstream_plugins.py's). pip fetches
the sdist once into the cache (`$RECIPE_UPSTREAM_CACHE`), so the tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.libraries import deepspeed_ulysses as plugin
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

DISTRIBUTION, VERSION = "deepspeed", "0.19.8"
CROSSING = (
    "lengths=[1, 1] sp=2: rank 0, micro-batch 0, local slot 0 (document 0, position 0): label "
    "expected -100, got 3 (document 1's position 0: the label crosses into the next document)"
)


@pytest.fixture(scope="module")
def released():
    return plugin.TARGETS[0].load(DISTRIBUTION, DISTRIBUTION, VERSION)


def _line(number: int) -> str:
    path = cache_root() / f"{DISTRIBUTION}-{VERSION}" / "files" / plugin.FILE
    return path.read_text().splitlines()[number - 1].strip()


def _search(checked, cases: int, options):
    """The checker's search (seed 0): the minimal finding, with `options` a strategy."""
    from hypothesis import strategies as st

    def one(case):
        return checked.finding(case[0], case[1])

    return search(st.tuples(checked.cases(), options), one, cases, seed=0)[0]


def _adapt(released, rows, rank):
    """Rank `rank`'s micro-batches, rows[j] the batch of rank j's one-batch dataloader."""
    released.module.dist = plugin.Collectives
    adapter = released.module.UlyssesSPDataLoaderAdapter(
        [rows[rank]], rank, plugin.RanksGroup(rows, rank), len(rows), "cpu"
    )
    return list(adapter)


def test_the_release_is_loaded_with_every_option_drawn_or_fixed(released):
    assert (released.file, released.line) == (plugin.FILE, 571)
    assert _line(571) == "class UlyssesSPDataLoaderAdapter:"
    assert released.drawn == {"labels": ("as_given", "separator"), "pad_to_multiple_of": ("sp", 1)}
    assert set(released.skipped) == {"dl", "sp_rank", "sp_group", "sp_world_size", "device"}


def test_labels_cross_into_the_next_document_minimal_case(released):
    """Two one-token documents over sp 2: shift_labels of the whole row are [3, -100] (:714),
    so rank 0's token 1, document 0's last token, learns document 1's token 3."""
    from hypothesis import strategies as st

    found = _search(released, 30, st.just({}))
    assert found.impact is Impact.MISPLACED and found.case == {"lengths": [1, 1], "sp": 2}
    assert found.what == CROSSING
    rows = [plugin.packed_row([1, 1], j, "as_given", 2) for j in range(2)]
    first, second = _adapt(released, rows, 0)
    assert first["input_ids"].tolist() == [[1]] and first["position_ids"].tolist() == [[0]]
    assert first["shift_labels"].tolist() == [[3]]  # -100 is right: document 0 ends here
    assert second["input_ids"].tolist() == [[5]]  # rank 1's row, its chunk 0
    assert "labels" not in first
    assert [_line(n) for n in (712, 713, 714)] == [
        'labels = batch.pop("labels")',
        "labels = torch.nn.functional.pad(labels, (0, 1), value=-100)",
        'batch["shift_labels"] = labels[..., 1:].contiguous()',
    ]


def test_an_unpadded_row_sp_does_not_divide_raises_minimal_case(released):
    """One one-token document over sp 2, no padding: ValueError at :706-707."""
    from hypothesis import strategies as st

    options = st.fixed_dictionaries({"labels": st.just("separator"),
                                     "pad_to_multiple_of": st.just(1)})  # fmt: skip
    found = _search(released, 30, options)
    assert found.impact is Impact.RAISES and found.case == {"lengths": [1], "sp": 2}
    assert found.what == (
        "lengths=[1] sp=2: rank 0 raises ValueError: batch's seqlen=1 isn't divisible by sp-size=2"
    )
    rows = [plugin.packed_row([1], j, "separator", 1) for j in range(2)]
    with pytest.raises(ValueError, match="seqlen=1 isn't divisible by sp-size=2"):
        _adapt(released, rows, 0)
    assert _line(706) == "if seq_length % self.sp_world_size != 0:"


def test_with_the_separator_and_padding_the_search_passes(released):
    from hypothesis import strategies as st

    options = st.fixed_dictionaries({"labels": st.just("separator"),
                                     "pad_to_multiple_of": st.just("sp")})  # fmt: skip
    assert _search(released, 30, options) is None


def test_an_unknown_option_refuses():
    class Adapter:
        def __init__(self, dl, sp_rank, sp_group, sp_world_size, device, pad_to=None):
            raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match="does not know: 'pad_to'"):
        plugin.signature_options(Adapter, "deepspeed@9.9 UlyssesSPDataLoaderAdapter")


def test_the_reproducer_exits_1_on_the_release_and_accepts_the_truth(
    released, tmp_path, monkeypatch, capsys
):
    """The script accepts the ground truth's outputs, prints the finding and returns 1 from
    main() on the sdist, and exits 1 as a process."""
    sdist = next((cache_root() / f"{DISTRIBUTION}-{VERSION}").glob("*.tar.gz"))
    found = released.finding(([1, 1], 2, 1), {})
    path = tmp_path / "reproduce.py"
    path.write_text(released.reproducer(found))
    assert "import recipe" not in path.read_text()
    command = [sys.executable, str(path), "--wheel", str(sdist)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spec = importlib.util.spec_from_file_location("deepspeed_ulysses_repro", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.problems(released.truth_outputs(found)) == []
    for case, options in ((([3, 17, 1], 4, 1), {}), (([1], 2, 1), {"pad_to_multiple_of": 1})):
        other = released.finding(case, options)  # a padded row; a raise the truth pads past
        monkeypatch.setattr(script, "CASE", other.case)
        monkeypatch.setattr(script, "OPTIONS", dict(other.options))
        assert script.problems(released.truth_outputs(other)) == []
    monkeypatch.setattr(script, "CASE", found.case)
    monkeypatch.setattr(script, "OPTIONS", dict(found.options))
    monkeypatch.setattr(sys, "argv", ["reproduce.py", "--wheel", str(sdist)])
    assert script.main(DISTRIBUTION, VERSION) == 1
    assert CROSSING.split(": ", 1)[1] in capsys.readouterr().out.splitlines()
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, out + err
    assert f"{DISTRIBUTION} {VERSION}: REPRODUCED" in out
