"""AReaL 1.0.4's packed CP split, label roll and reassembly, loaded from its PyPI wheel and run
as its Megatron engine runs them (recipe/checks/upstream/libraries/areal/).

The release passes: its split is the zigzag contract on the engine's padding (each sequence
padded to a multiple of 2*cp*tp, megatron_engine.py:2081, lcm with 16 under fp8, :2082-2086, by
data.py:852; then one padding sequence up to a multiple of lcm(alignment, 256), data.py:919-944),
its labels are the next token of the same sequence wherever one exists, and its reassembly (and
postprocess's gather) give the original per-token tensor back. So the pins here are direct
calls of the released functions on small cases (what they output, as found), the labels'
negative control (the function controls, one line of the release's source slipped, are
tests/test_upstream_plugins.py's), the reproducers (no problem on the release, exit 1 on a wheel
carrying the same slip, the ground truth accepted), and the refusals of an option the check does
not know. The wheel is fetched by pip into the cache once (`$RECIPE_UPSTREAM_CACHE`), so these
tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.kit.checked import Finding
from recipe.checks.upstream.libraries import areal
from recipe.checks.upstream.libraries.areal import release as areal_release
from recipe.checks.upstream.libraries.areal.release import ENGINE, PCP
from recipe.checks.upstream.libraries.areal.shipped_run import micro_batch, split_on_rank
from recipe.checks.upstream.libraries.areal.targets import MUTATIONS
from recipe.upstream.source import UpstreamUnavailable, cache_root, source_file

pytestmark = pytest.mark.launches

VERSION = "1.0.4"
SPLIT, REASSEMBLY, POSTPROCESS = areal.LIBRARY.targets
FILES = (
    "areal/utils/math.py",
    "areal/utils/constants.py",
    "areal/utils/data.py",
    PCP,
    ENGINE,
)


@pytest.fixture(scope="module")
def checked():
    return {t.kind: t.load("areal", "areal", VERSION) for t in areal.LIBRARY.targets}


@pytest.fixture(scope="module")
def wheel():
    source_file("areal", VERSION, PCP)  # fetches the wheel into the cache once
    return next((cache_root() / f"areal-{VERSION}").glob("*.whl"))


def _search(target, cases: int, drawn: bool):
    from hypothesis import strategies as st

    options = (
        st.fixed_dictionaries({k: st.sampled_from(v) for k, v in target.drawn.items()})
        if drawn
        else st.just({})
    )

    def one(case):
        (lengths, cp, tp), chosen = case
        return target.finding((lengths, cp, tp), {k: v for k, v in chosen.items() if v is not None})

    return search(st.tuples(target.cases(), options), one, cases, seed=0)


def test_the_engine_statements_run_are_the_releases(checked):
    """The alignment, pad call, label roll and gather are found in megatron_engine.py and run
    as they are there (the lines of 1.0.4)."""
    statements = checked["split"].release.statements
    assert [(line, code) for line, _, code in statements["align"]] == [
        (2081, "align_to_multiple_of = tp_size * cp_size * 2 if cp_size > 1 else tp_size"),
        (
            2082,
            "align_to_multiple_of = math.lcm(align_to_multiple_of, "
            "DEFAULT_VECTORIZED_ALIGNMENT_BYTES) if self.enable_fp8 else align_to_multiple_of",
        ),
    ]
    assert statements["pad"][0][:2] == (2087, 2092)
    assert "seq_align_to=align_to_multiple_of" in statements["pad"][0][2]
    assert [code for _, _, code in statements["roll"]] == [
        "padded_cu_seqlens = mb_input.padded_mb['cu_seqlens']",
        "rolled_ids = torch.roll(mb_input.padded_mb['input_ids'], shifts=-1, dims=-1)",
        "cp_labels = split_packed_seqs_for_context_parallel(rolled_ids, padded_cu_seqlens)",
    ]
    assert [line for line, _, _ in statements["roll"]] == [898, 899, 902]
    assert [line for line, _, _ in statements["gather"]] == [2187, 2201]
    assert checked["split"].line == 14
    assert checked["reassembly"].line == 148
    assert checked["postprocess"].line == 188


@pytest.mark.parametrize(
    ("cp", "tp", "fp8", "align"),
    [(2, 1, False, 4), (2, 1, True, 16), (4, 2, False, 16), (8, 2, False, 32), (8, 2, True, 32)],
)
def test_the_engine_pads_each_sequence_to_2_cp_tp_and_the_micro_batch_to_a_page(
    checked, cp, tp, fp8, align
):
    """megatron_engine.py:2081-2086 and pad_mb_list: [3, 5] padded per sequence to the
    alignment, then one padding sequence up to a multiple of lcm(alignment, 256)."""
    release = checked["split"].release
    values = [torch.arange(1, 4), torch.arange(11, 16)]
    padded_mb, padding, old_cu = micro_batch(
        release.modules, release.statements, values, cp, tp, {"enable_fp8": fp8}
    )
    first, second = -(-3 // align) * align, -(-5 // align) * align
    page = 256 * align // torch.gcd(torch.tensor(256), torch.tensor(align)).item()
    assert padded_mb["cu_seqlens"].tolist() == [0, first, first + second, page]
    assert padding == page - first - second
    assert old_cu.tolist() == [0, 3, 8]


def test_the_split_and_labels_on_a_small_case(checked):
    """lengths [3, 5], cp=2: padded to [4, 8] (+ 244 rows of padding); rank 0 holds chunks 0 and
    3 of each sequence, rank 1 chunks 1 and 2; labels are the next token of the same sequence
    (0 = padding where the sequence has none)."""
    release = checked["split"].release
    values = [torch.tensor([1, 2, 3]), torch.tensor([11, 12, 13, 14, 15])]
    padded_mb = micro_batch(release.modules, release.statements, values, 2, 1, {})[0]
    got = [
        split_on_rank(release.modules, release.statements, padded_mb, 2, rank, 1)
        for rank in range(2)
    ]
    assert [tokens[:6].tolist() for tokens, _, _ in got] == [
        [1, 0, 11, 12, 0, 0],
        [2, 3, 13, 14, 15, 0],
    ]
    assert [labels[:6].tolist() for _, labels, _ in got] == [
        [2, 11, 12, 13, 0, 0],
        [3, 0, 14, 15, 0, 0],
    ]
    assert got[0][2].tolist() == [0, 4, 12, 256]


def test_the_label_of_a_last_token_crosses_into_the_next_sequence_when_no_padding_is_between(
    checked,
):
    """The engine rolls the whole padded stream (megatron_engine.py:899): where a sequence fills
    its alignment, its last token's label is the next sequence's first token. The contract does
    not weigh that slot (no next token of the same sequence); AReaL's loss mask, rolled row-wise
    before packing (trainer/sft/lm_engine.py:29, trainer/ppo/actor.py:176), is 0 there unless the
    row fills the [B, S] batch and its first token is in the loss."""
    release = checked["split"].release
    values = [torch.tensor([1, 2, 3, 4]), torch.tensor([11, 12, 13])]
    padded_mb = micro_batch(release.modules, release.statements, values, 2, 1, {})[0]
    _, labels, _ = split_on_rank(release.modules, release.statements, padded_mb, 2, 0, 1)
    assert labels[:2].tolist() == [2, 11]  # position 0's label, then position 3's: sequence 1's


@pytest.mark.parametrize("kind", ["split", "reassembly", "postprocess"])
def test_the_release_passes_a_search(checked, kind):
    for drawn in (False, True):
        finding, ran = _search(checked[kind], cases=12, drawn=drawn)
        assert finding is None and ran == 12, finding and finding.describe()


CONTROLS = [
    ("split", "function", ([3], 2, 1), {}, Impact.LOST),
    ("split", "labels", ([4], 2, 1), {}, Impact.MISPLACED),
    ("reassembly", "function", ([1], 2, 1), {}, Impact.LOST),
    ("postprocess", "function", ([1], 2, 1), {}, Impact.MISPLACED),
]


@pytest.mark.parametrize(
    ("kind", "part", "case", "options", "impact"),
    [c for c in CONTROLS if c[1] != "function"],  # the function's: tests/test_upstream_plugins.py
)
def test_each_broken_copy_is_flagged_where_the_release_passes(
    checked, kind, part, case, options, impact
):
    release = checked[kind]
    broken = release.broken_copy(part)
    assert release.finding(case, options) is None
    finding = broken.finding(case, options)
    assert finding is not None and finding.impact == impact, finding
    assert broken.line == release.line


def _slipped_wheel(tmp_path, wheel, kind):
    """A wheel holding the files the reproducer reads, with the control's slip in its source."""
    victim, line, slip = MUTATIONS[checked_name(kind)]["function"]
    out = tmp_path / f"areal-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w") as target:
        for name in FILES:
            text = source.read(name).decode()
            if name == PCP:
                assert text.count(line) == (2 if kind == "split" else 1)
                text = text.replace(line, slip, 1)
            target.writestr(name, text)
    return out


def checked_name(kind):
    return {"split": SPLIT, "reassembly": REASSEMBLY, "postprocess": POSTPROCESS}[kind].name


def _script(tmp_path, source, name):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"repro_areal_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


@pytest.mark.parametrize(
    ("kind", "part", "case", "options", "impact"), CONTROLS[::2] + CONTROLS[3:]
)
def test_reproducers_pass_on_the_release_and_fail_on_the_slip(
    checked, wheel, tmp_path, kind, part, case, options, impact
):
    """The release has no finding, so the reproducer of each control's finding is what is
    run: the release passes it (its problems are none: the script would exit 0), a wheel with
    the same one-line slip fails it (exit 1), and the ground truth's outputs have no problem."""
    finding = checked[kind].broken_copy(part).finding(case, options)
    source = checked[kind].reproducer(finding)
    assert "import recipe" not in source and "from recipe" not in source
    path, script = _script(tmp_path, source, kind)
    assert script.problems(checked[kind].truth_outputs(finding)) == []
    assert script.problems(script.release_outputs(wheel)) == []
    slipped = _slipped_wheel(tmp_path, wheel, kind)
    found = script.problems(script.release_outputs(slipped))
    assert found, kind
    if kind == "split":  # one subprocess: each start imports torch and megatron-core
        run = subprocess.run(
            [sys.executable, str(path), "--wheel", str(slipped)], capture_output=True, text=True
        )
        assert run.returncode == 1, run.stdout + run.stderr
        assert f"areal {VERSION}: REPRODUCED" in run.stdout


def _fake_release(monkeypatch, tmp_path, edits):
    """areal@9.9.9: the cached 1.0.4 files with `edits` ({relative: (old, new)}) applied."""
    for relative in FILES:
        target = tmp_path / "files" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source_file("areal", VERSION, relative)[0], target)
        if relative in edits:
            old, new = edits[relative]
            text = target.read_text()
            assert text.count(old) == 1
            target.write_text(text.replace(old, new))
    monkeypatch.setattr(
        areal_release,
        "source_file",
        lambda distribution, version, relative: (tmp_path / "files" / relative, "9.9.9"),
    )
    areal_release.load_release.cache_clear()


_ALIGN = "        align_to_multiple_of = tp_size * cp_size * 2 if cp_size > 1 else tp_size"
_PAD = "            seq_align_to=align_to_multiple_of,\n"
_SIGNATURE = "    cu_seqlens: torch.Tensor,\n) -> tuple"
UNKNOWN = {
    "a new option of the split": (
        {PCP: (_SIGNATURE, _SIGNATURE.replace(")", "    cp_layout: str = 'zigzag',\n)"))},
        "preprocess_packed_seqs_context_parallel has an option the check does not know: "
        "'cp_layout'",
    ),
    "a new keyword of the engine's pad call": (
        {ENGINE: (_PAD, _PAD + "            batch_align_to=self.batch_align,\n")},
        "reads self.batch_align, batch_align_to, which the check does not know",
    ),
    "a new term of the engine's alignment": (
        {ENGINE: (_ALIGN, "        align_to_multiple_of = tp_size * cp_size * 2 * ep_size")},
        "reads ep_size, which the check does not know",
    ),
}


@pytest.mark.parametrize(("edits", "message"), UNKNOWN.values(), ids=UNKNOWN.keys())
def test_an_unknown_option_refuses_the_check(monkeypatch, tmp_path, edits, message):
    _fake_release(monkeypatch, tmp_path, edits)
    try:
        with pytest.raises(UpstreamUnavailable, match="does not know") as info:
            SPLIT.load("areal", "areal", "9.9.9")
        assert message in str(info.value)
    finally:
        areal_release.load_release.cache_clear()


def test_an_unknown_control_part_refuses(checked):
    with pytest.raises(UpstreamUnavailable, match="no part 'labels' to break"):
        checked["reassembly"].broken_copy("labels")


@pytest.mark.parametrize(
    "options",
    [
        {"post_process": False},
        {"gather_output": False, "output_width": 1},
        {"pass_cu_seqlens": False, "enable_fp8": True},
    ],
)
def test_postprocess_reproducer_accepts_the_truth_and_the_release_on_each_mode(
    checked, wheel, tmp_path, options
):
    finding = Finding(
        {"lengths": [3, 9, 1], "cp": 4, "tp": 2}, tuple(sorted(options.items())), Impact.PADDING, ""
    )
    _, script = _script(tmp_path, checked["postprocess"].reproducer(finding), "modes")
    assert script.problems(checked["postprocess"].truth_outputs(finding)) == []
    assert script.problems(script.release_outputs(wheel)) == []
