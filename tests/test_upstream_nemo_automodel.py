"""NeMo Automodel 0.7.0's THD packer and MTP shift, read from the PyPI wheel
(`recipe/checks/upstream/libraries/nemo_automodel/`, truth in its `packer_truth.py` and
`mtp_truth.py`).

What the checker finds, pinned by direct calls of the released functions (line numbers are in
the wheel):

- `pack_dataset` (packed_sequence.py:302) validates `packed_sequence_size` against
  `pad_to_multiple_of` only (:355-357), never against 2*cp. With a size that is not a multiple of
  2*cp:
  - real tokens misplaced (defaults, `lengths=[1, 5] cp=2 pack_size=5`): a sample that fits by its
    real length (the check at :367) but not once CP-padded (:382) overflows the pack by itself;
    the `while` at :401 splits the buffer at `previous_sample_boundary`, which is advanced only
    after the loop (:414), so the sample is cut across two packs, the first with no seq_lens;
  - padding only (defaults, `lengths=[1] cp=2 pack_size=5`): `_pad_pack` adds the pack's tail to
    the last span (:159-160), which is then not a multiple of 2*cp;
  - real tokens lost (drawn, `max_packs=1`, `lengths=[1, 9, 1] cp=2 pack_size=9`): the too-long
    sample closes the only pack, so the third one, which fits beside the first, is never packed.
  With pack sizes that are multiples of lcm(2*cp, pad_to_multiple_of) it passes; on them its
  raises (IndexError on `lengths=[9] cp=2 pack_size=10`) are refusals the truth makes too.
- `prepare_mtp_context_parallel_inputs` (models/common/mtp/mtp.py:240): passes, at its defaults
  and with every option and batch form drawn.

The wheel is fetched once by pip into the upstream cache: these tests are marked `launches`, as
tests/test_upstream.py is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.libraries.nemo_automodel import LIBRARY, mtp_truth, packer_truth
from recipe.checks.upstream.libraries.nemo_automodel.targets import (
    DISTRIBUTION,
    MTP_SHIFT,
    PACK_DATASET,
    check_signature,
)
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

RELEASE = "0.7.0"


@pytest.fixture(scope="module")
def packer():
    return PACK_DATASET.load("nemo-automodel", DISTRIBUTION, RELEASE)


@pytest.fixture(scope="module")
def mtp():
    return MTP_SHIFT.load("nemo-automodel", DISTRIBUTION, RELEASE)


def _search(checked, cases: int, options=None, impact: Impact | None = None):
    from hypothesis import strategies as st

    from recipe.checks.search import search

    drawn = st.just({}) if options is None else options

    def one(case):
        inner, chosen = case
        found = checked.finding(inner, {k: v for k, v in chosen.items() if v is not None})
        return None if found is None or (impact and found.impact != impact) else found

    return search(st.tuples(checked.cases(), drawn), one, cases, seed=0)


def _pack(packer, lengths, size, cp, **options):
    dataset = packer.module.Dataset.from_list(packer_truth.documents(lengths))
    return packer.module.pack_dataset(dataset, None, size, cp_size=cp, **options).to_dict()


def test_registry_entry(packer, mtp):
    assert LIBRARY.distribution == "nemo-automodel" and LIBRARY.releases == (RELEASE,)
    assert (packer.file, packer.line) == (
        "nemo_automodel/components/datasets/llm/packed_sequence.py",
        302,
    )
    assert (mtp.file, mtp.line) == ("nemo_automodel/components/models/common/mtp/mtp.py", 240)


def test_the_default_search_finds_a_pack_size_off_2cp(packer):
    """The default-options search (seed 0, 40 cases) shrinks to a pack size that is not a
    multiple of 2*cp: the padding-only span (`lengths=[1] pack_size=5`) or the document split
    across packs of the next test (`lengths=[1, 5]`); which shrinks first depends on
    hypothesis's state in the process, so both are pinned exactly."""
    finding, _ = _search(packer, 40)
    assert finding.case["pack_size"] % (2 * finding.case["cp"]) != 0
    expected = {
        Impact.PADDING: (
            "lengths=[1] cp=2 pack_size=5: pack 0: document 0's padded span 5 (seq_lens_padded "
            "[5]) is not a multiple of 2*cp=4: zigzag CP cannot split it (its real tokens are "
            "placed right)"
        ),
        Impact.MISPLACED: (
            "lengths=[1, 5] cp=2 pack_size=5: document 1 (length 5) is split across packs [1, 2]"
        ),
    }
    assert finding.what == expected[finding.impact]


def test_a_pack_size_off_2cp_cuts_a_sample_across_packs(packer):
    """Document 1 (tokens 7-11) spans 8 once padded: pack 1 gets tokens 7-10 and no seq_lens,
    pack 2 token 11 with seq_lens [5] and a span of 9 in a pack of 5."""
    out = _pack(packer, [1, 5], 5, 2)
    assert out["input_ids"] == [[1, 0, 0, 0, 0], [7, 8, 9, 10, 0], [11, 0, 0, 0, 0]]
    assert out["seq_lens"] == [[1], [], [5]]
    assert out["seq_lens_padded"] == [[5], [], [9]]


def test_a_pack_size_off_2cp_leaves_an_unsplittable_span(packer):
    finding = packer.finding({"lengths": [1], "cp": 2, "pack_size": 5}, {})
    assert finding.impact is Impact.PADDING
    assert "padded span 5 (seq_lens_padded [5]) is not a multiple of 2*cp=4" in finding.what
    assert _pack(packer, [1], 5, 2)["seq_lens_padded"] == [[5]]


def test_a_too_long_sample_closes_the_last_pack_before_one_that_fits(packer):
    """max_packs=1: document 1 (9 tokens, 12 once padded) is not dropped, overflows the pack
    and closes it; document 2, which fits beside document 0, is never packed."""
    finding = packer.finding({"lengths": [1, 9, 1], "cp": 2, "pack_size": 9}, {"max_packs": 1})
    assert finding.impact is Impact.LOST
    assert finding.what.endswith("document 2 (length 1): 1 real tokens in no pack (positions [0]):"
                                 " they never train")  # fmt: skip
    assert _pack(packer, [1, 9, 1], 9, 2, max_packs=1)["input_ids"] == [[1] + [0] * 8]


def test_sizes_aligned_to_2cp_pack_right_and_unaligned_raises_are_refusals(packer):
    for case in ([8, 16], [3, 9, 2], [1, 1, 1, 1], [31, 1, 17]):
        for cp in (1, 2, 4, 8):
            for size in (32, 64):
                assert packer.finding({"lengths": case, "cp": cp, "pack_size": size}, {}) is None
    for options in ({"pad_to_multiple_of": 3}, {"max_packs": 1}, {"loss_mask": True},
                    {"drop_long_samples": False}, {"input_form": "list"}):  # fmt: skip
        assert packer.finding({"lengths": [5, 7, 30], "cp": 2, "pack_size": 24}, options) is None
    # [9] at cp=2 pads to 12 > 10: the release raises IndexError, the truth refuses size 10 too
    outputs = packer_truth.call_packer(packer.module, "pack_dataset", {"lengths": [9], "cp": 2,
                                "pack_size": 10}, {})  # fmt: skip
    assert outputs["raised"].startswith("IndexError")
    assert packer.finding({"lengths": [9], "cp": 2, "pack_size": 10}, {}) is None


def test_mtp_shift_passes_with_every_option_drawn(mtp):
    from hypothesis import strategies as st

    assert _search(mtp, 30) == (None, 30)
    drawn = st.fixed_dictionaries({k: st.sampled_from(v) for k, v in mtp.drawn.items()})
    assert _search(mtp, 30, drawn) == (None, 30)


def test_mtp_shift_stops_each_depth_at_the_document_end(mtp):
    """Two documents of 3 and 4 tokens in spans of 4 (cp=2): depth 1 of position 2 (the last
    token of document 0) and depth 2 of positions 1-2 are ignored and masked, never document
    1's labels."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 0, 11, 12, 13, 14]]),
        "labels": torch.tensor([[2, 3, 99, -100, 12, 13, 14, 98]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
        "seq_lens_padded": torch.tensor([[4, 4]]),
    }
    out = mtp.module.prepare_mtp_context_parallel_inputs(batch, num_depths=2)
    assert out.targets[0].tolist() == [[3, 99, -100, -100, 13, 14, 98, -100]]
    assert out.targets[1].tolist() == [[99, -100, -100, -100, 14, 98, -100, -100]]
    assert out.valid_masks[1].tolist() == [[True, True, False, False, True, True, False, False]]


REPRODUCED = {
    "misplaced": ({"lengths": [1, 5], "cp": 2, "pack_size": 5}, {}),
    "padding": ({"lengths": [1], "cp": 2, "pack_size": 5}, {}),
    "lost": ({"lengths": [1, 9, 1], "cp": 2, "pack_size": 9}, {"max_packs": 1}),
}
# Runs each reproducer as __main__ with --wheel in one interpreter (torch and datasets imported
# once): {script: (exit code, what it printed)}.
RUN_ALL = """
import contextlib, io, json, runpy, sys
wheel, scripts, codes = sys.argv[1], sys.argv[2:], {}
for script in scripts:
    sys.argv, out = [script, "--wheel", wheel], io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as done:
            code = done.code
    codes[script] = (code, out.getvalue())
print(json.dumps(codes))
"""


def _load_script(path):
    spec = importlib.util.spec_from_file_location(f"nemo_repro_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reproduced(packer, mtp, tmp_path_factory):
    """Every reproducer, written and run once: {name: (finding, script, exit code, output)}.
    The MTP shift has no finding on the release: its script reproduces the broken copy's."""
    folder = tmp_path_factory.mktemp("nemo_repro")
    findings = {name: packer.finding(*args) for name, args in REPRODUCED.items()}
    findings["mtp"] = mtp.broken_copy().finding(
        {"lengths": [4, 4], "cp": 2}, {"positions": "mrope"}
    )
    scripts = {}
    for name, finding in findings.items():
        checked = mtp if name == "mtp" else packer
        scripts[name] = folder / f"{name}.py"
        scripts[name].write_text(checked.reproducer(finding))
    wheel = next((cache_root() / f"{DISTRIBUTION}-{RELEASE}").glob("*.whl"))
    done = subprocess.run([sys.executable, "-c", RUN_ALL, str(wheel), *map(str, scripts.values())],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (findings[name], scripts[name], *codes[str(scripts[name])]) for name in scripts}


@pytest.mark.parametrize("name", list(REPRODUCED))
def test_each_reproducer_reproduces_and_accepts_the_truth(packer, reproduced, name):
    finding, script, code, printed = reproduced[name]
    assert code == 1, printed
    assert finding.what.split(": ", 1)[1] in printed
    assert _load_script(script).problems(packer.truth_outputs(finding)) == []


def test_the_mtp_reproducer_passes_on_the_release_and_flags_the_broken_copy(mtp, reproduced):
    finding, script, code, printed = reproduced["mtp"]
    assert code == 0 and "not reproduced: passes" in printed
    module = _load_script(script)
    assert module.problems(mtp.truth_outputs(finding)) == []
    broken = module.call_mtp(mtp.broken_copy().module, mtp.function_name, finding.case,
                             dict(finding.options))  # fmt: skip
    assert module.problems(broken)


def test_the_mtp_truth_passes_its_own_problems(mtp):
    for options in ({}, {"num_depths": 3, "rows": 2, "positions": "mrope", "ignore_index": -1},
                    {"boundaries": "_packed_seq_ids", "positions": "none"}):  # fmt: skip
        case = {"lengths": [5, 1, 8], "cp": 2}
        assert mtp_truth.mtp_problems(case, options, mtp_truth.truth_mtp(case, options)) == []


def test_the_truths_zigzag_is_the_recipes():
    layout = mtp_truth.mtp_layout({"lengths": [5, 1, 17], "cp": 4}, {})
    spans = [span for _, _, span in layout["rows"][0]]
    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32)
    places = mtp_truth.zigzag_places(layout, 4)
    for rank in range(4):
        mine = sorted((slot, t) for (_, t), (r, slot) in places.items() if r == rank)
        assert [t for _, t in mine] == zigzag_index(cu, 4, rank).tolist()


def test_an_unknown_option_refuses(packer):
    def future_pack_dataset(dataset, split, packed_sequence_size, cp_size=1, *, layout="zigzag"):
        return None

    with pytest.raises(UpstreamUnavailable, match="'layout'"):
        check_signature(future_pack_dataset, "x", PACK_DATASET.fixed, PACK_DATASET.drawn)
    narrower = dataclasses.replace(PACK_DATASET, drawn={})
    with pytest.raises(UpstreamUnavailable, match="'max_packs'"):
        narrower.load("nemo-automodel", DISTRIBUTION, RELEASE)
