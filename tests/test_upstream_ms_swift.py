"""ms-swift 4.6.0 and mcore-bridge 1.6.5 (recipe/checks/upstream/libraries/ms_swift/), loaded
from their wheels.

The one finding, pinned on the case the checker shrinks it to: with `padding_side=left`,
padding_free (the default) and a padding_to past the packed row (fp8, fp4, the blockwise or mxfp8
recipe, the fused attention backend), ms-swift's collator pads the tokens, labels and loss_scale
of the row on the left (swift/template/base.py:2164-2169) but appends the position ids' padding
on the right, as segments of 2*cp (:2140-2149). cu_seqlens_q come from the position ids
(swift/utils/transformers_utils.py:354-362), so every sample's boundaries stay at the start of
the row while its tokens sit in the tail's padding segments: get_batch_on_this_cp_rank
(swift/megatron/utils/megatron_lm_utils.py:858) then gives each rank real tokens that train at
the positions, and inside the attention spans, of padding segments.

Everything else passes: the batch path at its defaults and with every other option drawn, the
split (mcore-bridge megatron_utils.py:56) and the three inverses (mcore-bridge :118, ms-swift
swift/megatron/utils/utils.py:284 and swift/megatron/trainers/utils.py:472) as round trips.
Each target's negative control (one line of its own source changed) is
tests/test_upstream_plugins.py's. The wheels are fetched once by pip into the cache
(`$RECIPE_UPSTREAM_CACHE`): these tests start pip and a reproducer, so they are marked `launches`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.libraries import ms_swift
from recipe.checks.upstream.libraries.ms_swift import batch as batch_path
from recipe.checks.upstream.libraries.ms_swift import release, reproducers
from recipe.checks.upstream.runner import check_target
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.source import UpstreamUnavailable, cache_root

pytestmark = pytest.mark.launches

LEFT = {"padding_side": "left", "attention_backend": "fused"}
MINIMAL = "lengths=[1] cp=2 tp=1: rank 0, local slot 62 (in the tail's padding segments, past "


@pytest.fixture(scope="module")
def checked() -> dict:
    """Every target of both libraries, loaded once (label -> Checked)."""
    loaded = {}
    for library in ms_swift.LIBRARIES.values():
        for target in library.targets:
            one = target.load(library.distribution, library.distribution, library.releases[0])
            loaded[one.name if library is ms_swift.LIBRARY else f"bridge.{one.name}"] = one
    return loaded


@pytest.fixture(scope="module")
def batch(checked):
    return checked["get_batch_on_this_cp_rank"]


def _wheel(distribution: str, version: str):
    return next((cache_root() / f"{distribution}-{version}").glob("*.whl"))


def _script(tmp_path, source: str, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_the_targets_are_the_released_functions(checked):
    lines = {name: (one.file, one.line) for name, one in checked.items()}
    assert lines == {
        "get_batch_on_this_cp_rank": ("swift/megatron/utils/megatron_lm_utils.py", 858),
        "utils.reconstruct_tensor_cp": ("swift/megatron/utils/utils.py", 284),
        "trainers.reconstruct_tensor_cp": ("swift/megatron/trainers/utils.py", 472),
        "bridge.split_cp_inputs": ("mcore_bridge/utils/megatron_utils.py", 56),
        "bridge.reconstruct_tensor_cp": ("mcore_bridge/utils/megatron_utils.py", 118),
    }
    assert checked["get_batch_on_this_cp_rank"].swift.bridge_version == "1.6.5"


def test_left_padding_puts_real_tokens_into_the_tails_padding_segments(batch):
    """The minimal case: one 1-token sample, cp=2, the fused backend (padding_to = 128). The
    collator's row: the token at slot 127, its positions [0, 1, 2, 3] at slots 0-3."""
    s = {**batch_path.BATCH_DEFAULTS, **LEFT}
    finding = batch.finding(([1], 2, 1), LEFT)
    assert finding.impact is Impact.MISPLACED
    assert finding.what == (
        MINIMAL + "the last sample's boundary 4): holds sequence 0 position 0, which trains "
        "there at position 0 of a padding segment"
    )
    rank0 = batch_path.run_path(batch.swift, batch.cp_split, [[1]], 2, 0, 1, s, [])
    assert rank0.width == 128 and rank0.cu_seqlens[:2].tolist() == [0, 4]
    assert rank0.batch["input_ids"][0, :2].tolist() == [0, 0]  # sample 0's slots: padding
    assert int(rank0.batch["input_ids"][0, 62]) == 1  # global slot 127
    # padded on the right, the same micro-batch passes
    assert batch.finding(([1], 2, 1), {"attention_backend": "fused"}) is None


def test_left_padding_cuts_a_longer_sample_into_padding_segments(batch):
    """A sample longer than 2*cp is cut: its position 4 trains as position 0 of a new segment,
    blind to its first four tokens."""
    finding = batch.finding(([5], 2, 1), LEFT)
    assert finding.impact is Impact.MISPLACED
    assert finding.what.endswith(
        "holds sequence 0 position 4, which trains there at position 0 of a padding segment"
    )


def test_the_search_shrinks_to_the_minimal_case(batch):
    fixed = {**batch_path.BATCH_DEFAULTS, **LEFT}  # the micro-batch drawn: a quick shrink
    found, _ = check_target(batch, cases=10, seed=0, fixed=fixed, drawn=True)
    assert found is not None and found.impact is Impact.MISPLACED
    assert found.case == {"lengths": [1], "cp": 2, "tp": 1}
    assert found.what.startswith(MINIMAL)


def test_the_batch_path_passes_at_its_defaults(batch):
    for case in (([3, 5], 2, 1), ([17, 4, 9], 4, 2), ([1, 16], 8, 1)):
        assert batch.finding(case, {}) is None, case
    found, ran = check_target(batch, cases=15, seed=0, fixed={}, drawn=False)
    assert found is None and ran == 15


def test_left_padding_without_padding_free_is_refused_by_the_collator_not_a_finding(batch):
    assert batch.finding(([3, 5], 2, 1), {"padding_side": "left", "padding_free": False}) is None


@pytest.mark.parametrize(
    "name, options",
    [
        ("utils.reconstruct_tensor_cp", {"fp8_format": "e4m3", "dim": "sbh:0"}),
        ("utils.reconstruct_tensor_cp", {"padding_free": False, "dim": "bs:-1"}),
        ("utils.reconstruct_tensor_cp", {"cp_partition_mode": "contiguous"}),
        ("trainers.reconstruct_tensor_cp", {"attention_backend": "fused"}),
        ("trainers.reconstruct_tensor_cp", {"padding_free": False}),
        ("bridge.reconstruct_tensor_cp", {"packed_seq_params": "rows", "dim": "bsh:1"}),
        ("bridge.split_cp_inputs", {"cu_seqlens": "rows", "dim": "sbh:0"}),
        ("bridge.split_cp_inputs", {"cp_partition_mode": "contiguous", "dim": "bsh:1"}),
        ("get_batch_on_this_cp_rank", {"cp_partition_mode": "contiguous", "loss_scale": True}),
        ("get_batch_on_this_cp_rank", {"is_multimodal": True, "fp8_format": "e4m3"}),
    ],
)
def test_the_release_passes_with_options_drawn(checked, name, options):
    for case in (([3, 5], 2, 1), ([17, 4, 9], 4, 2)):
        assert checked[name].finding(case, options) is None, (name, case)


def test_the_reproducer_shows_the_finding_on_the_release(batch, tmp_path):
    finding = batch.finding(([5], 2, 1), LEFT)
    path, script = _script(tmp_path, batch.reproducer(finding), "repro_batch")
    done = subprocess.run(
        [sys.executable, str(path), "--wheel", str(_wheel("ms-swift", "4.6.0"))],
        capture_output=True,
        text=True,
        env={**os.environ, "MCORE_BRIDGE_WHEEL": str(_wheel("mcore-bridge", "1.6.5"))},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ms-swift 4.6.0: REPRODUCED" in done.stdout
    assert (
        "rank 0, local slot 0 (global slot 0, sequence 0 position 0): input_ids expected 1, got 0"
        in done.stdout
    )  # noqa: E501
    assert script.problems(batch.truth_outputs(finding)) == []


def test_the_split_reproducer_passes_the_release_and_flags_a_broken_split(checked, tmp_path):
    split = checked["bridge.split_cp_inputs"]
    options = {"cu_seqlens": "rows", "dim": "bsh:1"}
    found = split.broken_copy().finding(([3, 5], 2, 1), options)
    _, script = _script(tmp_path, split.reproducer(found), "repro_split")
    assert script.problems(script.release_outputs(_wheel("mcore-bridge", "1.6.5"))) == []
    assert script.problems(split.truth_outputs(found)) == []
    broken = split.truth_outputs(found)
    broken["ranks"][1]["input_ids"][0] = 0
    assert script.problems(broken) == [
        "rank 1, local slot 0 (global slot 2, sequence 0 position 2): input_ids expected 3, got 0"
    ]


def test_the_round_trip_reproducer_passes_the_release_and_flags_a_swap(checked, tmp_path):
    """ms-swift's trainer inverse: the script gathers the release's shards back itself."""
    trainer = checked["trainers.reconstruct_tensor_cp"]
    found = trainer.broken_copy().finding(([3, 5], 2, 1), {})
    assert found.impact is Impact.LOST
    _, script = _script(tmp_path, trainer.reproducer(found), "repro_round_trip")
    assert script.problems(script.release_outputs(_wheel("ms-swift", "4.6.0"))) == []
    truth = trainer.truth_outputs(found)
    assert script.problems(truth) == []
    truth["ranks"][0][0][:2] = truth["ranks"][0][0][1::-1]
    assert script.problems(truth)[0] == (
        "rank 0: row 0 slot 0 (sequence 0 position 0) gets the value of sequence 0 position 1"
    )


def test_an_option_the_adapter_does_not_know_refuses(batch):
    with pytest.raises(UpstreamUnavailable, match="unknown options"):
        batch.finding(([3], 2, 1), {"cp_layout": "zigzag"})
    reads_more = batch.broken_copy()
    reads_more.cp_split = layouts.mutated_function(
        batch.cp_split,
        "cp_size = mpu.get_context_parallel_world_size()",
        "cp_size = mpu.get_context_parallel_world_size() + 0 * bool(getattr(args, 'cp_new', 0))",
        batch.label,
    )
    with pytest.raises(UpstreamUnavailable, match="reads args.cp_new"):
        reads_more.finding(([3], 2, 1), {})


def test_an_ms_swift_release_without_a_known_mcore_bridge_refuses():
    with pytest.raises(UpstreamUnavailable, match="BRIDGE_FOR_SWIFT"):
        release.bridge_version_for("0.0.1")


@pytest.mark.parametrize("cp", [2, 4])
def test_the_te_stand_in_is_the_zigzag_index(cp):
    """TE's partition kernel as transcribed: the recipe's zigzag index, sequence by sequence."""
    cu = torch.tensor([0, 4 * cp, 6 * cp, 12 * cp], dtype=torch.int32)
    for rank in range(cp):
        got = reproducers.TEPartitionStandIn.thd_get_partitioned_indices(cu, int(cu[-1]), cp, rank)
        assert got.tolist() == zigzag_index(cu, cp, rank).tolist()
    with pytest.raises(AssertionError, match="the kernel's assert"):
        reproducers.TEPartitionStandIn.thd_get_partitioned_indices(cu + 1, 40, cp, 0)
