"""Megatron-Bridge 0.6.2's other CP splits of packed sequences (`recipe/upstream/
bridge_families.py`), loaded from the released wheel.

The finding pinned here: Kimi K2.5-VL splits a packed (THD) batch as one sequence.
`KimiK25VLModel.forward` (`megatron/bridge/models/kimi_vl/modeling_kimi_k25_vl.py:471-481`) calls
`_split_on_cp_rank` (`:34-57`) on the whole [1, T] row whether or not `packed_seq_params` is
given, and passes `packed_seq_params` on to the language model (`:492`), whose THD attention
expects every packed sequence split into its own 2*cp chunks. With two sequences of one token at
cp=2 (each padded to 4), rank 0 holds the row's slots 0, 1, 6, 7 instead of 0, 3, 4, 7: sequence
1's first token (slot 4) trains on rank 1 in the place of sequence 0's padding. Impact: real
tokens misplaced; no search finds a worse one.

`gpt_step._partition_packed_batch_for_cp` (`training/gpt_step.py:174`),
`common_utils.slice_batch_for_context_parallel` (`utils/common_utils.py:251`) and
`deepseek_v4_step._partition_packed_batch_contiguous` (`models/deepseek/deepseek_v4_step.py:109`)
pass. The first two go through megatron-core and Transformer Engine's kernel, transcribed here
(`TransformerEngineStandIn`). Each target's negative control is tests/test_upstream_plugins.py's.
The wheel is fetched by pip into the upstream cache: marked `launches`.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import zipfile

import pytest
from hypothesis import strategies as st

from recipe.checks.assess import Impact, micro_batches
from recipe.checks.search import search
from recipe.checks.upstream.kit.checked import Finding
from recipe.checks.upstream.kit.released import load
from recipe.checks.upstream.libraries import megatron_bridge as bridge_families
from recipe.checks.upstream.libraries.megatron_bridge import targets as bridge_targets
from recipe.upstream.releases import LIBRARIES
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

VERSION = "0.6.2"
GPT_STEP, SLICE_BATCH, CONTIGUOUS, KIMI = bridge_families.TARGETS
PASSING = (GPT_STEP, SLICE_BATCH, CONTIGUOUS)


@pytest.fixture(scope="module")
def released():
    dist = "megatron-bridge"
    return {t.name: t.load(dist, dist, VERSION) for t in bridge_families.TARGETS}


def test_the_released_lines(released):
    lines = {name: checked.line for name, checked in released.items()}
    assert lines == {
        "gpt_step._partition_packed_batch_for_cp": 174,
        "common_utils.slice_batch_for_context_parallel": 251,
        "deepseek_v4_step._partition_packed_batch_contiguous": 109,
        "kimi_k25_vl._split_on_cp_rank": 34,
    }


def test_kimi_splits_a_packed_row_as_one_sequence(released):
    """A direct call, as the forward makes it: labels [1, 8] of two sequences of one token
    padded to 4 (ids 1 and 3); rank 0 gets slots 0, 1, 6, 7 of the row."""
    split = released[KIMI.name].module._split_on_cp_rank
    batch, cu = bridge_families.packed_batch([[1], [3]], cp=2, tp=1)
    assert cu == [0, 4, 8]
    assert batch["tokens"].tolist() == [[1, 0, 0, 0, 3, 0, 0, 0]]
    assert split(batch["tokens"], 2, 0, seq_dim=1).tolist() == [[1, 0, 0, 0]]
    assert split(batch["tokens"], 2, 1, seq_dim=1).tolist() == [[0, 0, 3, 0]]
    # the THD layout: rank 0 holds chunks 0 and 3 of each sequence, [1, 0, 3, 0]
    finding = released[KIMI.name].finding(([1, 1], 2, 1), {})
    assert finding.impact is Impact.MISPLACED
    assert finding.what == (
        "lengths=[1, 1] cp=2 tp=1: rank 0, local slot 2 (sequence 1, position 0, chunk 0 = "
        "front): input_ids expected 3, got 0"
    )


def test_kimi_search_shrinks_to_two_one_token_sequences_and_finds_nothing_worse(released):
    checked = released[KIMI.name]
    strategy = micro_batches(max_sequences=4, max_length=40)
    finding, _ = search(strategy, lambda case: checked.finding(case, {}), cases=20, seed=0)
    assert (finding.case, finding.impact) == ({"lengths": [1, 1], "cp": 2, "tp": 1},
                                              Impact.MISPLACED)  # fmt: skip

    def lost(case):
        found = checked.finding(case, {})
        return found if found is not None and found.impact > Impact.MISPLACED else None

    assert search(strategy, lost, cases=20, seed=0) == (None, 20)


def test_kimi_passes_a_single_sequence(released):
    for lengths in ([1], [8], [37]):
        assert released[KIMI.name].finding((lengths, 4, 2), {}) is None


@pytest.mark.parametrize("target", PASSING, ids=lambda t: t.name)
def test_the_other_splits_pass_a_short_search(released, target):
    checked = released[target.name]
    options = st.fixed_dictionaries({k: st.sampled_from(v) for k, v in checked.drawn.items()})
    strategy = st.tuples(micro_batches(max_sequences=5, max_length=60), options)

    def one(case):
        return checked.finding(case[0], {k: v for k, v in case[1].items() if v is not None})

    assert search(strategy, one, cases=25, seed=0) == (None, 25)


@pytest.mark.parametrize("metadata", bridge_families.METADATA)
def test_gpt_step_passes_every_metadata_format(released, metadata):
    checked = released[GPT_STEP.name]
    options = {"metadata": metadata, "pack_padding_units": 3}
    for case in (([1], 2, 1), ([3, 8, 1], 4, 2), ([17, 5], 8, 1)):
        assert checked.finding(case, options) is None, case


def _script(tmp_path, checked, finding):
    path = tmp_path / "repro.py"
    path.write_text(checked.reproducer(finding))
    spec = importlib.util.spec_from_file_location(f"repro_{tmp_path.name}", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return path, script


def _wheel():
    return next((cache_root() / f"megatron-bridge-{VERSION}").glob("*.whl"))


def test_the_kimi_reproducer_reproduces(tmp_path, released):
    checked = released[KIMI.name]
    finding = checked.finding(([1, 1], 2, 1), {})
    path, script = _script(tmp_path, checked, finding)
    done = subprocess.run([sys.executable, str(path), "--wheel", str(_wheel())],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 0, local slot 2 (sequence 1, position 0): input_ids expected 3, got 0" in (
        done.stdout
    )
    assert script.problems(checked.truth_outputs(finding)) == []


@pytest.mark.parametrize("target", PASSING, ids=lambda t: t.name)
def test_the_other_reproducers_pass_and_judge_like_the_ground_truth(tmp_path, released, target):
    """In this process (the script's `main` is the Kimi test's): the release's outputs have no
    problem, the ground truth's neither, and labels swapped between ranks do."""
    checked = released[target.name]
    options = {"metadata": "offline+pad_cu_seqlens", "pack_padding_units": 1}
    options = {k: v for k, v in options.items() if k in checked.drawn}
    finding = Finding({"lengths": [3, 8], "cp": 2, "tp": 1}, tuple(sorted(options.items())),
                      Impact.PADDING, "a passing case")  # fmt: skip
    _, script = _script(tmp_path, checked, finding)
    assert script.problems(script.release_outputs(_wheel())) == []
    truth = checked.truth_outputs(finding)
    assert script.problems(truth) == []
    truth["ranks"][1]["labels"], truth["ranks"][0]["labels"] = (
        truth["ranks"][0]["labels"],
        truth["ranks"][1]["labels"],
    )
    assert script.problems(truth)


def test_an_unknown_option_refuses(monkeypatch):
    real = bridge_targets.load_module

    def load_module(*args, **kwargs):
        module = real(*args, **kwargs)
        if hasattr(module, "_split_on_cp_rank"):

            def _split_on_cp_rank(val, cp_size, cp_rank, seq_dim, layout="zigzag"):
                return val

            module._split_on_cp_rank = _split_on_cp_rank
        return module

    monkeypatch.setattr(bridge_targets, "load_module", load_module)
    with pytest.raises(UpstreamUnavailable, match="option the checker does not know: 'layout'"):
        KIMI.load("megatron-bridge", "megatron-bridge", VERSION)


def _released_functions(relative: str) -> dict[str, str]:
    wheel = next((cache_root() / f"megatron-bridge-{VERSION}").glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(relative).decode()
    tree = ast.parse(source)
    functions = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if ast.get_docstring(node) is not None:
                node.body = node.body[1:]
            functions[node.name] = ast.unparse(node)
    return functions


def test_the_survey_copies_differ_only_where_the_report_says():
    """exaone45's preprocess_packed_seqs is qwen3_vl's without the cast of the mask to bool
    (qwen3_vl utils.py:716-720); the two split_data_cp_rank differ only in their docstrings."""
    load("megatron-bridge", VERSION, LIBRARIES["megatron-bridge"].targets[0])  # the wheel
    models = "megatron/bridge/models"
    qwen = _released_functions(f"{models}/qwen_vl/modelling_qwen3_vl/utils.py")
    exaone = _released_functions(f"{models}/exaone/exaone45/modelling_exaone45/utils.py")
    assert qwen["split_data_cp_rank"] == exaone["split_data_cp_rank"]
    cast = (
        "\n    if attention_mask.dtype != torch.bool:"
        "\n        attention_mask = attention_mask.bool()"
    )
    assert cast in qwen["preprocess_packed_seqs"]
    assert qwen["preprocess_packed_seqs"].replace(cast, "") == exaone["preprocess_packed_seqs"]


def test_exaone45_forward_calls_split_data_cp_rank_with_one_argument_too_many():
    """`Exaone45Model.forward` (modelling_exaone45/model.py:407, :411) passes packed_seq_params
    as a fifth argument to split_data_cp_rank (utils.py:318), which takes four: at cp > 1 the
    labels' split raises before the language model runs."""
    loaded = load("megatron-bridge", VERSION, LIBRARIES["megatron-bridge"].targets[1])
    import torch

    with pytest.raises(TypeError, match="takes from 3 to 4 positional arguments but 5 were given"):
        loaded.module.split_data_cp_rank(torch.zeros(1, 8), 2, 1, 0, None)
