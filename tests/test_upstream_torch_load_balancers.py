"""torch's context-parallel load balancers, read from the installed torch (no download).

The verdicts depend on the torch release, so the version-bound tests are `stack_dependent`:
torch 2.13.0 and 2.11.0 (the legacy and image stacks) split a packed row of documents unevenly
(`_PerDocumentHeadTailLoadBalancer` lays its indices out document by document before
`torch.chunk` cuts them), torch 2.14.1 (the current stack) balances it; the head-tail balancer
of a single sequence passes on all three. The judge itself is tested on hand-made indices first
(any stack), and the reproducer of the finding end to end where 2.13.0 or 2.11.0 is installed.
The shared contract (control flagged, reproducer accepts the truth, unknown option refused) is
tests/test_upstream_plugins.py's.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from recipe.check_upstream import main
from recipe.checks.search import search
from recipe.checks.upstream.libraries.torch_load_balancers import (
    FILE,
    LIBRARY,
    balance_problems,
    call_outputs,
    padded_documents,
)
from recipe.upstream.prelude import installed_release
from recipe.upstream.source import installed_root, public_version

VERSION = public_version(torch.__version__)
# What the search finds on each release measured (the image, legacy and current stacks')
UNBALANCED_BEFORE_2_14 = (
    "lengths=[1, 5] world_size=2: documents [4, 8] (padded) on world size 2: the ranks' query-key "
    "pairs are [13, 33], not 23 each"
)
MEASURED = {
    "2.11.0": {
        "_HeadTailLoadBalancer": None,
        "_PerDocumentHeadTailLoadBalancer": UNBALANCED_BEFORE_2_14,
    },
    "2.13.0": {
        "_HeadTailLoadBalancer": None,
        "_PerDocumentHeadTailLoadBalancer": UNBALANCED_BEFORE_2_14,
    },
    "2.14.1": {"_HeadTailLoadBalancer": None, "_PerDocumentHeadTailLoadBalancer": None},
}
measured_here = pytest.mark.skipif(
    VERSION not in MEASURED, reason=f"torch {VERSION}: verdicts recorded for {sorted(MEASURED)}"
)


def _load(name: str):
    """The installed release's class; a torch without the file (before its CP package) skips,
    any other failure to load fails."""
    target = next(t for t in LIBRARY.targets if t.name == name)
    if not (installed_root("torch") / FILE).is_file():
        pytest.skip(f"torch {torch.__version__} has no {FILE}")
    return target.load("torch", "torch", None)


# ---- the judge, on indices made by hand (any stack) ------------------------------------------


def _document_major(documents, world_size):
    """torch 2.13.0's per-document layout, written out: for each document, for each rank, its
    head chunk then its tail chunk, documents one after the other."""
    out, start = [], 0
    for n in documents:
        k = n // (2 * world_size)
        for rank in range(world_size):
            out += list(range(start + k * rank, start + k * (rank + 1)))
            out += list(
                range(start + k * (2 * world_size - rank - 1), start + k * (2 * world_size - rank))
            )
        start += n
    return out


def _outputs(documents, rearrange):
    restore = sorted(range(len(rearrange)), key=rearrange.__getitem__)
    return {"documents": documents, "rearrange": rearrange, "restore": restore}


def test_the_judge_counts_each_ranks_attention_work():
    """Documents of 4 and 12 at world size 2: rank 0 takes document 0 whole and the head of
    document 1 (26 query-key pairs), rank 1 the rest (62); the zigzag gives 44 each."""
    found = balance_problems(_outputs([4, 12], _document_major([4, 12], 2)), 2)
    assert [level for level, _ in found] == [0]
    assert "query-key pairs are [26, 62], not 44 each" in found[0][1]
    zigzag = [0, 3, 4, 5, 6, 13, 14, 15, 1, 2, 7, 8, 9, 10, 11, 12]  # chunks r, 3-r of each
    assert balance_problems(_outputs([4, 12], zigzag), 2) == []
    # equal documents: the document-major layout happens to be balanced, and passes
    assert balance_problems(_outputs([4, 4], _document_major([4, 4], 2)), 2) == []


def test_the_judge_ranks_lost_positions_and_a_wrong_restore_worst():
    lost = balance_problems(_outputs([8], [0, 7, 1, 6, 2, 5, 3, 3]), 2)
    assert lost[0][0] == 4 and "1 of 8 positions are in no rank's shard (first: 4)" in lost[0][1]
    outputs = _outputs([8], [0, 7, 1, 6, 2, 5, 3, 4])
    outputs["restore"] = list(range(8))
    assert [level for level, _ in balance_problems(outputs, 2)] == [3]
    outputs["restore"] = [0, 1, 2, 3, 4, 5, 6, 9]  # out of range: reported, never an IndexError
    assert [level for level, _ in balance_problems(outputs, 2)] == [3]
    raised = balance_problems({"documents": [8], "raises": "AssertionError: "}, 2)
    assert raised == [(2, "the balancer raises AssertionError: ")]


def test_padding_follows_the_assertion_the_balancers_make():
    assert padded_documents([1, 5, 9], 2, True) == [4, 8, 12]
    assert padded_documents([1, 5, 9], 2, False) == [16]
    assert padded_documents([8], 4, True) == [8]


# ---- the installed release ------------------------------------------------------------------


@pytest.mark.stack_dependent
@measured_here
@pytest.mark.parametrize("name", [t.name for t in LIBRARY.targets])
def test_the_installed_release_gets_its_measured_verdict(name):
    checked = _load(name)
    from hypothesis import strategies as st

    found, _ = search(st.tuples(checked.cases(), st.just({})),
                   lambda c: checked.finding(c[0], c[1]), 200, seed=0)  # fmt: skip
    expected = MEASURED[VERSION][name]
    if expected is None:
        assert found is None, found.describe()
    else:
        assert found is not None and found.impact.label == "work unbalanced"
        assert found.what.startswith(expected), found.what


@pytest.mark.stack_dependent
@measured_here
@pytest.mark.parametrize("name", [t.name for t in LIBRARY.targets])
def test_the_control_unbalances_a_single_document(name):
    """The negative control's line exists in both releases' shape; one document of 8 at world
    size 2 is balanced by the release and not by the broken copy, which gives rank 0 chunks 0
    and 2 of 4 (positions 0, 1, 4, 5: 1+2+5+6 = 14 query-key pairs) and rank 1 the rest (22)."""
    checked = _load(name)
    assert checked.finding(((8,), 2), {}) is None
    broken = checked.broken_copy()
    found = broken.finding(((8,), 2), {})
    assert found is not None and "query-key pairs are [14, 22]" in found.what, found


@pytest.mark.stack_dependent
@pytest.mark.skipif(VERSION == "2.14.1", reason="the finding is fixed in 2.14.1")
@measured_here
def test_the_reproducer_of_the_finding_before_2_14_exits_1(tmp_path, monkeypatch, capsys):
    """The report's script, run as a user runs it, on the installed 2.13.0 or 2.11.0 (no --wheel:
    the installed release is that version), reproduces the imbalance; the truth passes it."""
    checked = _load("_PerDocumentHeadTailLoadBalancer")
    finding = checked.finding(((1, 5), 2), {})
    source = checked.reproducer(finding)
    assert "import recipe" not in source and "from recipe" not in source
    (tmp_path / "repro.py").write_text(source)
    spec = importlib.util.spec_from_file_location("repro_torch_lb", tmp_path / "repro.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.problems(checked.truth_outputs(finding)) == []
    monkeypatch.setattr(sys, "argv", ["repro.py"])
    assert script.main("torch", checked.version) == 1
    printed = capsys.readouterr().out
    assert "query-key pairs are [13, 33]" in printed and printed.rstrip().endswith("REPRODUCED")
    # the CLI's report says where the release was read and how to get it
    assert main(["torch", "--function", checked.name, "--report", str(tmp_path / "r"),
                 "--cases", "50"]) == 1  # fmt: skip
    readme = next((tmp_path / "r").glob("*/README.md")).read_text()
    assert "(the installed release)" in readme and f"pip install torch=={VERSION}" in readme


def test_the_cli_checks_the_installed_torch_and_refuses_an_option(capsys):
    assert main(["torch", "--fixed", "device=cuda", "--cases", "1"]) == 2
    assert "device" in capsys.readouterr().err
    assert installed_release("torch", torch.__version__) is not None
    outputs = call_outputs(_load("_HeadTailLoadBalancer").function, [3, 2], 2, False)
    assert outputs["documents"] == [8] and sorted(outputs["rearrange"]) == list(range(8))
