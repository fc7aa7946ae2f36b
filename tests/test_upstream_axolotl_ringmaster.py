"""axolotl-ringmaster 0.2.7's `shard_collated_batch` (`ringmaster/shard.py:275`), axolotl's
collator-side CP split, on one packed row of several documents
(recipe/checks/upstream/libraries/axolotl_ringmaster.py).

The finding, pinned by the checker's shrunk case and by a direct call: the labels are shifted
over the whole packed row before the split (shard.py:125-126), so with labels equal to the
token ids (a plain packed row) the last token of each document is trained to predict the next
document's first token; real tokens misplaced at the defaults, in both layouts and from every
boundary input. With -100 at each document's first label everything passes. An unknown option
refuses the check; the reproducer exits 1 on the wheel and accepts the ground truth (the broken
copy is tests/test_upstream_plugins.py's). pip fetches the wheel once into the cache
(`$RECIPE_UPSTREAM_CACHE`), so the tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.libraries import axolotl_ringmaster as plugin
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

DISTRIBUTION, VERSION = "axolotl-ringmaster", "0.2.7"
CROSSING = (
    "lengths=[1, 1] cp=2: rank 0, local slot 0 (document 0, position 0): label expected -100, "
    "got 3 (document 1's position 0: the label crosses into the next document)"
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


def test_the_release_is_loaded_with_every_option_drawn_or_fixed(released):
    assert (released.file, released.line) == ("ringmaster/shard.py", 275)
    assert _line(275) == "def shard_collated_batch("
    assert released.drawn == {
        "load_balance": ("contiguous", "head_tail"),
        "boundaries": ("position_ids", "segment_mask", "cu_seqlens"),
        "labels": ("as_given", "separator"),
        "pad_to_multiple_of": (64, 1),
    }
    assert set(released.skipped) == {"batch", "cp_rank", "cp_size"}


def test_labels_cross_into_the_next_document_minimal_case(released):
    """The search's minimal case at the defaults: two one-token documents over cp 2, the row
    padded to 64 by the collator. The shift_labels of the whole row start [3, -100]
    (`shift[:, :-1] = labels[:, 1:]`, :126): rank 0's token 1, document 0's last token, learns
    document 1's token 3."""
    from hypothesis import strategies as st

    found = _search(released, 30, st.just({}))
    assert found.impact is Impact.MISPLACED and found.case == {"lengths": [1, 1], "cp": 2}
    assert found.what == CROSSING
    shard = released.module.shard_collated_batch
    row = plugin.packed_row([1, 1], "position_ids", "as_given", 64)
    rank0 = shard(row, cp_rank=0, cp_size=2)
    assert rank0["input_ids"][0, :3].tolist() == [1, 3, 0]
    assert rank0["position_ids"][0, :3].tolist() == [0, 0, 0]
    assert rank0["shift_labels"][0, :3].tolist() == [3, -100, -100]
    assert rank0["_cp_shard"]["varlen"] == ([0, 1, 2, 64], 62)  # the boundaries are right
    assert [_line(n) for n in (125, 126)] == [
        "shift = torch.full_like(labels, -100)",
        "shift[:, :-1] = labels[:, 1:]",
    ]


@pytest.mark.parametrize("load_balance", ["contiguous", "head_tail"])
@pytest.mark.parametrize("boundaries", ["position_ids", "segment_mask", "cu_seqlens"])
@pytest.mark.parametrize("multiple", [64, 1])
def test_every_layout_and_input_crosses_and_the_separator_passes(released, load_balance,
                                                                 boundaries, multiple):  # fmt: skip
    """[5, 10] over cp 2 (the row padded to 64, or by the function alone to 16): document 0's
    last token, global slot 4, gets document 1's first token 12; with -100 at each document's
    first label the case passes."""
    options = {"load_balance": load_balance, "boundaries": boundaries,
               "pad_to_multiple_of": multiple}  # fmt: skip
    found = released.finding(([5, 10], 2, 1), {**options, "labels": "as_given"})
    where = "rank 1, local slot 0" if (load_balance, multiple) == ("head_tail", 1) else (
        "rank 0, local slot 4")  # fmt: skip
    assert found.impact is Impact.MISPLACED
    assert found.what == (
        f"lengths=[5, 10] cp=2: {where} (document 0, position 4): label expected -100, got 12 "
        "(document 1's position 0: the label crosses into the next document)"
    )
    assert released.finding(([5, 10], 2, 1), {**options, "labels": "separator"}) is None


def test_with_the_separator_the_search_passes(released):
    from hypothesis import strategies as st

    options = st.fixed_dictionaries(
        {
            "labels": st.just("separator"),
            "load_balance": st.sampled_from(plugin.DRAWN["load_balance"]),
            "boundaries": st.sampled_from(plugin.INPUT["boundaries"]),
            "pad_to_multiple_of": st.sampled_from(plugin.INPUT["pad_to_multiple_of"]),
        }
    )
    assert _search(released, 40, options) is None


def test_an_unknown_option_refuses():
    def shard(batch, *, cp_rank, cp_size, load_balance="contiguous", pad_to=None):
        raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match="does not know: 'pad_to'"):
        plugin.signature_options(shard, "axolotl-ringmaster@9.9 shard_collated_batch")


def test_the_reproducer_exits_1_on_the_release_and_accepts_the_truth(
    released, tmp_path, monkeypatch, capsys
):
    """The script accepts the ground truth's outputs (both layouts), prints the finding and
    returns 1 from main() on the wheel, and exits 1 as a process."""
    wheel = next((cache_root() / f"{DISTRIBUTION}-{VERSION}").glob("*.whl"))
    found = released.finding(([1, 1], 2, 1), {})
    path = tmp_path / "reproduce.py"
    path.write_text(released.reproducer(found))
    assert "import recipe" not in path.read_text()
    command = [sys.executable, str(path), "--wheel", str(wheel)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spec = importlib.util.spec_from_file_location("axolotl_ringmaster_repro", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.problems(released.truth_outputs(found)) == []
    monkeypatch.setattr(script, "CASE", {"lengths": [3, 17, 1], "cp": 4})
    for load_balance in ("contiguous", "head_tail"):  # a padded row, three documents
        other = released.finding(([3, 17, 1], 4, 1), {"load_balance": load_balance})
        monkeypatch.setattr(script, "OPTIONS", dict(other.options))
        assert script.problems(released.truth_outputs(other)) == []
    monkeypatch.setattr(script, "CASE", found.case)
    monkeypatch.setattr(script, "OPTIONS", dict(found.options))
    monkeypatch.setattr(sys, "argv", ["reproduce.py", "--wheel", str(wheel)])
    assert script.main(DISTRIBUTION, VERSION) == 1
    assert CROSSING.split(": ", 1)[1] in capsys.readouterr().out.splitlines()
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, out + err
    assert f"{DISTRIBUTION} {VERSION}: REPRODUCED" in out
