"""ColossalAI 0.5.0's ring-attention batch split (recipe/checks/upstream/libraries/colossalai/),
read from its PyPI sdist (the release has no wheel): `RingAttention.prepare_varlen_batch`
(colossalai/shardformer/layer/attn.py:1173), `split_batch_zigzag` (layer/utils.py:331) and
`split_varlen_zigzag` (utils.py:381), called as the Llama shardformer forward calls them.

Findings, each pinned twice: as the checker's search shrinks it (seed 0, a bounded case count)
and by a direct call of the released function on the minimal case, with the released line.
- prepare_varlen_batch, real tokens misplaced: a row shorter than the longest keeps label 0 on
  its local padding (utils.py:425), which dist_cross_entropy trains ([1, 5], sp 2);
- prepare_varlen_batch, real tokens misplaced: position_ids cut by the longest row
  (attn.py:1233) where tokens are cut by each row's length ([2, 5], sp 2);
- split_batch_zigzag, raises: rows of 2*sp slots fail its assert (utils.py:358-360) ([1], sp 2);
- split_varlen_zigzag, raises: packed labels, `torch.cat(seq[1:], tensor)` (utils.py:453).
An unknown option refuses the check; the reproducer exits 1 on the release and accepts the
ground truth (the broken copies are tests/test_upstream_plugins.py's). pip fetches the sdist once
into the cache (`$RECIPE_UPSTREAM_CACHE`), so the tests are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.libraries import colossalai
from recipe.upstream import source
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

VERSION = "0.5.0"


@pytest.fixture(scope="module")
def released():
    return {t.kind: t.load("colossalai", "colossalai", VERSION) for t in colossalai.TARGETS}


def _search(checked, cases: int, keep=lambda finding: True):
    """The checker's search at the defaults (seed 0): (the minimal finding kept, cases run)."""
    from hypothesis import strategies as st

    def one(case):
        finding = checked.finding(case[0], case[1])
        return finding if finding is not None and keep(finding) else None

    return search(st.tuples(checked.cases(), st.just({})), one, cases, seed=0)


def _line(file: str, number: int) -> str:
    """Line `number` of the released file, as the cache holds it (extracted from the sdist)."""
    path = cache_root() / f"colossalai-{VERSION}" / "files" / file
    return path.read_text().splitlines()[number - 1].strip()


def test_the_release_is_loaded_with_every_option_drawn_or_fixed(released):
    assert [(c.name, c.file, c.line) for c in released.values()] == [
        ("RingAttention.prepare_varlen_batch", colossalai.ATTN, 1173),
        ("split_batch_zigzag", colossalai.UTILS, 331),
        ("split_varlen_zigzag", colossalai.UTILS, 381),
    ]
    assert released["varlen"].drawn == {"position_ids": ("shared", "per_row"),
                                        "extra_columns": (0, 3)}  # fmt: skip
    assert set(released["varlen"].skipped) == {
        "padding_mask", "sp_group", "inputs_embeds", "is_label", "is_batched_seq"}  # fmt: skip
    assert set(released["rows"].skipped) == {"batch", "sp_group", "seq_dim", "is_label"}
    assert released["packed"].drawn == {"is_label": (True, False)}
    assert set(released["packed"].skipped) == {
        "batch", "cu_seqlens", "sp_group", "max_seqlen", "is_batched_seq"}  # fmt: skip


def _varlen(released, lengths, rank, cp=2):
    """prepare_varlen_batch called directly as llama.py:154 and :326 call it, on right-padded
    rows of the contract's token ids (each padded to a multiple of 2*cp, the mask 1 there)."""
    seqs = [[1 + (max(lengths) + 1) * i + p for p in range(n)] for i, n in enumerate(lengths)]
    padded = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    ids = torch.tensor([s + [0] * (max(padded) - len(s)) for s in seqs])
    labels = torch.where(ids == 0, -100, ids)
    mask = torch.tensor([[int(p < q) for p in range(max(padded))] for q in padded])
    prepare = released["varlen"].function  # the release's, its `dist` answering for (cp, rank)
    hidden, info, positions = prepare(
        mask, (cp, rank), ids[..., None], torch.arange(ids.shape[1])[None]
    )
    return hidden[..., 0], positions, prepare(mask, (cp, rank), labels, is_label=True)[0], info


def test_varlen_padding_labels_minimal_case(released):
    """The search's minimal case (as the checker reports it): [1, 5] over sp 2. Row 0 is padded
    to 4 (2 local slots), row 1 to 8 (4): row 0's local slots 2-3 are padding, and the batched
    split builds its output with torch.zeros (utils.py:425), writing only [:seqlen // sp]
    (:448-449): label 0, which dist_cross_entropy counts (labels != -100, loss.py:213)."""
    found, _ = _search(released["varlen"], 30)
    assert found.impact is Impact.MISPLACED and found.case == {"lengths": [1, 5], "cp": 2, "tp": 1}
    assert found.what == (
        "lengths=[1, 5] cp=2 tp=1: rank 0, row 0, local slot 2 (padding past sequence 0's 2 "
        "slots): label 0, not -100: dist_cross_entropy trains it and counts it"
    )
    _, _, labels, info = _varlen(released, [1, 5], rank=0)
    assert labels.tolist() == [[-100, -100, 0, 0], [8, 9, -100, -100]]
    assert (
        _line(colossalai.UTILS, 425) == "local_seq = torch.zeros(shape, dtype=dtype, device=device)"
    )
    # mask_info itself describes the rows right: 2 + 4 local slots
    assert info["cu_seqlens"].tolist() == [0, 2, 6]
    assert info["valid_indices"].tolist() == [0, 1, 4, 5, 6, 7]


def test_varlen_positions_minimal_case(released):
    """Past the padding labels (the same impact class), the search's minimal case of a wrong
    position: [2, 5] over sp 2. Tokens are cut by each row's length (chunks of 1 for row 0), the
    shared position_ids by the longest, 8 (chunks of 2, attn.py:1229-1236): rank 1 holds row 0's
    position 1 but is given position 2."""
    found, _ = _search(released["varlen"], 30, keep=lambda f: "position_ids" in f.what)
    assert found.case == {"lengths": [2, 5], "cp": 2, "tp": 1}
    assert found.impact is Impact.MISPLACED
    assert found.what == (
        "lengths=[2, 5] cp=2 tp=1: rank 1, local slot 0 (sequence 0, position 1): position_ids "
        "expected 1, got 2"
    )
    tokens, positions, _, _ = _varlen(released, [2, 5], rank=1)
    assert tokens.tolist() == [[2, 0, 0, 0], [9, 10, 11, 0]]
    assert positions.tolist() == [[2, 3, 4, 5]]  # right for row 1 only
    assert _line(colossalai.ATTN, 1233) == (
        '.view(-1, sp_size * 2, mask_info["max_seqlen"] // (sp_size * 2))'
    )


def test_split_batch_zigzag_raises_on_rows_of_2_sp(released):
    """Rows all 2*sp long (a valid padded length, which prepare_varlen_batch splits) reach
    split_batch_zigzag when the mask is all ones (llama.py:152); it asserts chunks of more than
    one token (utils.py:358-360)."""
    found, _ = _search(released["rows"], 30)
    assert found.impact is Impact.RAISES and found.case == {"lengths": [1], "cp": 2, "tp": 1}
    assert found.what == (
        "lengths=[1] cp=2 tp=1: rank 0 raises AssertionError: Bro, the seq length 4 for tensor 0 "
        "can't be split by 4!"
    )
    with pytest.raises(AssertionError, match="seq length 4 for tensor 0 can't be split by 4"):
        released["rows"].function(torch.tensor([[1, 0, 0, 0]]), (2, 0))
    assert _line(colossalai.UTILS, 359) == (
        "tensor.shape[seq_dim] // (sp_size * 2) > 1 and tensor.shape[seq_dim] % (sp_size * 2) == 0"
    )
    assert released["rows"].finding(([5, 8], 2, 1), {}) is None  # rows of 8: it passes


def test_split_varlen_zigzag_raises_on_packed_labels(released):
    """is_label=True in the packed mode runs `torch.cat(seq[1:], torch.tensor([-100]))`
    (utils.py:453): the tensor goes in as `dim`. The caller rolling the labels passes."""
    found, _ = _search(released["packed"], 30)
    assert found.impact is Impact.RAISES and found.case == {"lengths": [1], "cp": 2, "tp": 1}
    assert found.options == (("is_label", True),)
    assert "rank 0 raises TypeError: cat(): argument 'tensors' (position 1) must be tuple of " in (
        found.what
    )
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="must be tuple of Tensors, not Tensor"):
        released["packed"].function(torch.tensor([1, 0, 0, 0]), cu, (2, 0), is_label=True)
    assert _line(colossalai.UTILS, 453) == (
        "seq = torch.cat(seq[1:], torch.tensor([-100], dtype=dtype, device=device))"
    )
    for case in (([1], 2, 1), ([5, 8], 2, 1), ([3, 17, 1], 4, 1)):
        assert released["packed"].finding(case, {"is_label": False}) is None


def test_an_unknown_or_missing_option_refuses():
    def prepare(padding_mask, sp_group, inputs_embeds=None, position_ids=None, is_label=False,
                is_batched_seq=True, pad_to=None):  # fmt: skip
        raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match=r"does not know: \['pad_to'\], gone: \[\]"):
        colossalai.signature_options(prepare, "varlen", "colossalai@9.9 prepare")

    def split(batch, sp_group, is_label=False):
        raise AssertionError("never called")

    with pytest.raises(UpstreamUnavailable, match=r"does not know: \[\], gone: \['seq_dim'\]"):
        colossalai.signature_options(split, "rows", "colossalai@9.9 split")


REPRODUCED = [
    ("varlen", ([1, 5], 2, 1), "rank 0, row 0, local slot 2 (padding past sequence 0's 2 slots): "
     "label 0, not -100: dist_cross_entropy trains it and counts it"),
    ("varlen", ([2, 5], 2, 1), "rank 1, local slot 0 (sequence 0, position 1): position_ids "
     "expected 1, got 2"),
    ("rows", ([1], 2, 1), "raises: AssertionError: Bro, the seq length 4 for tensor 0 can't be "
     "split by 4!"),
    ("packed", ([1], 2, 1), "raises: TypeError: cat(): argument 'tensors' (position 1) must be "
     "tuple of Tensors, not Tensor"),
]  # fmt: skip


def test_the_reproducers_exit_1_on_the_release_and_accept_the_truth(
    released, tmp_path, monkeypatch, capsys
):
    """Each finding's script accepts the ground truth's outputs (its problems() is empty) and,
    on the sdist, prints the finding and returns 1 from main(); the first also runs as a process
    (started first, so that it overlaps the others)."""
    sdist = next((cache_root() / f"colossalai-{VERSION}").glob("*.tar.gz"))
    paths = [tmp_path / f"repro_{i}.py" for i in range(len(REPRODUCED))]
    for path, (kind, case, _) in zip(paths, REPRODUCED):
        path.write_text(released[kind].reproducer(released[kind].finding(case, {})))
        assert "import recipe" not in path.read_text()
    command = [sys.executable, str(paths[0]), "--wheel", str(sdist)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    monkeypatch.setattr(sys, "argv", ["reproduce.py", "--wheel", str(sdist)])
    for i, (path, (kind, case, shown)) in enumerate(zip(paths, REPRODUCED)):
        spec = importlib.util.spec_from_file_location(f"colossalai_repro_{i}", path)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        assert script.problems(released[kind].truth_outputs(released[kind].finding(case, {}))) == []
        assert script.main("colossalai", VERSION) == 1
        assert shown in capsys.readouterr().out.splitlines()
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, out + err
    assert REPRODUCED[0][2] in out.splitlines() and "colossalai 0.5.0: REPRODUCED" in out


def test_a_cut_cached_sdist_is_fetched_again(monkeypatch, tmp_path, caplog):
    """No wheel: the sdist, its file taken from below the top folder; a cached one cut short is
    deleted and fetched again, as a wheel is."""
    monkeypatch.setenv("RECIPE_UPSTREAM_CACHE", str(tmp_path))
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w:gz") as archive:
        data = b"X = 1\n" * 100
        info = tarfile.TarInfo("lib-9.9/lib/utils.py")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    (tmp_path / "lib-9.9").mkdir()
    (tmp_path / "lib-9.9" / "lib-9.9.tar.gz").write_bytes(whole.getvalue()[:40])
    calls = []

    def pip_download(distribution, version, dest, binary):
        calls.append(binary)
        if binary == "--no-binary=:all:":
            (dest / "lib-9.9.tar.gz").write_bytes(whole.getvalue())
        return subprocess.CompletedProcess([], 0 if "no-binary" in binary else 1, "", "no wheel")

    monkeypatch.setattr(source, "_pip_download", pip_download)
    assert source.fetched_file("lib", "9.9", "lib/utils.py").read_bytes() == data
    assert calls == ["--only-binary=:all:", "--no-binary=:all:"]
    assert "lib-9.9.tar.gz in the upstream cache is not a readable sdist" in caplog.text
    with pytest.raises(UpstreamUnavailable, match="lib-9.9.tar.gz has no lib/other.py"):
        source.fetched_file("lib", "9.9", "lib/other.py")
