"""scripts/gpu_check.py: on a machine without CUDA an honest report and exit 0; and every piece
of its logic that does not need a GPU, run here on the CPU, so that the script's first run on a
GPU fails only on what only a GPU can show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe.checks import gpu as gpu_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.launches
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs every part")
def test_gpu_check_without_cuda_reports_every_part_skipped(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["versions"]["status"] == "info" and report["versions"]["torch"]
    parts = [name for name in report if name != "versions"]
    assert parts == [name for name in gpu_check.CHECKS if name != "versions"]
    assert len(parts) == 8
    assert all(report[p]["status"] == "skipped" for p in parts)
    assert all(report[p]["reason"] == "no CUDA" for p in parts)
    assert "nothing but the versions was checked" in (tmp_path / "report.md").read_text()


@pytest.mark.launches
def test_an_unknown_part_is_refused_with_the_list(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--only", "cp2,mfu_1b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown part(s) cp2; parts: versions, te_backends" in result.stderr


def test_only_runs_the_parts_named_and_determinism_is_set_before_any(monkeypatch):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        report = gpu_check.run_checks(quick=True, only=["bf16_vs_fp32"])
        assert list(report) == ["versions", "bf16_vs_fp32"]
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    finally:
        torch.use_deterministic_algorithms(before, warn_only=True)


def test_te_selection_is_read_by_meaning_in_every_tuple_shape():
    # Transformer Engine 2.20: (flash, flash_backend, fused, fused_backend, unfused, available)
    te_220 = (False, None, True, 1, False, [True, True, False])
    assert gpu_check.te_selection(te_220) == {"selected": "fused", "available": ["flash", "fused"]}
    # the order the old gpu_check read positionally would have called this "flash"
    assert te_220[0] is False and te_220[1] is None
    # older releases: (flash, fused, fused_backend, unfused, available)
    older = (True, False, None, False, [True, False, True])
    assert gpu_check.te_selection(older)["selected"] == "flash"
    nothing = (False, None, False, None, False, [False, False, False])
    assert gpu_check.te_selection(nothing) == {"selected": "none", "available": []}
    with pytest.raises(RuntimeError, match="returned 3 items"):
        gpu_check.te_selection((True, False, [True]))


def test_two_ranks_share_the_gpu_through_nccl_only_where_nccl_allows():
    route, why = gpu_check.sharing_route((2, 28, 9))  # torch 2.11's NCCL
    assert route == "gloo" and "NCCL 2.28.9 refuses two ranks on one GPU" in why
    assert gpu_check.sharing_route((2, 30, 3))[0] == "nccl"
    assert gpu_check.sharing_route(None)[0] == "gloo"


def test_bf16_is_gated_on_the_first_and_the_final_step():
    fp32 = [5.0, 4.0, 3.0, 2.0]
    assert gpu_check.bf16_verdict(fp32, [5.01, 4.5, 3.0, 2.01])["passed"]  # noisy middle
    assert not gpu_check.bf16_verdict(fp32, [5.2, 4.0, 3.0, 2.0])["passed"]  # step 1 off
    late = gpu_check.bf16_verdict(fp32, [5.0, 4.0, 3.0, 2.2])
    assert not late["passed"] and late["final_rel"] == pytest.approx(0.1)


SMALLER = [
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "batching.tokens_per_step=1024",
    "batching.max_tokens_per_rank=1024",
]


@pytest.mark.stack_dependent
def test_model_pair_passes_and_their_comparison_on_the_cpu(monkeypatch):
    """model_te_vs_torch's machinery with the torch backend on both sides: identical weights
    give identical per-token losses (MTP depths too) and gradients; a changed gradient fails."""
    monkeypatch.setattr(gpu_check, "SMALL", gpu_check.SMALL + SMALLER)
    reference, candidate, pairs = gpu_check.model_pair_passes(
        ["mtp=on", "trainer.precision=fp32"], ("torch", "torch"), torch.device("cpu")
    )
    result = gpu_check.compare_passes(reference, candidate, pairs)
    assert result["mtp_depths_compared"] == 1 and result["tokens"] > 500
    assert result["grads_compared"] == len(pairs) and not result["grads_missing"]
    assert result["token_max_abs"] == result["mtp_token_max_abs"] == 0.0
    assert result["grad_rel_l2_max"] < 1e-6  # the CPU backward sums in threads
    assert gpu_check.passes_within(result, 1e-6, 1e-6)
    name = "output_layer.weight"
    candidate["grads"][name] = candidate["grads"][name] * 1.05
    worse = gpu_check.compare_passes(reference, candidate, pairs)
    assert worse["grad_worst"] == name and not gpu_check.passes_within(worse, 1e-6, 2e-2)


@pytest.mark.launches
@pytest.mark.stack_dependent
def test_cp2_against_cp1_runs_two_ranks_and_compares_every_token(monkeypatch, tmp_path):
    """cp2_one_gpu's comparison, here on two gloo ranks of the CPU: it passes at the fp32
    tolerance, and the pre-fix position_ids (a known CP bug) fail it."""
    from recipe.names import FP32_TOKEN_ATOL

    monkeypatch.setattr(gpu_check, "SMALL", gpu_check.SMALL + SMALLER)
    right = gpu_check.cp2_against_cp1([], FP32_TOKEN_ATOL, tmp_path / "right")
    assert right["passed"], right
    assert right["tokens_compared"] > 1000 and right["tokens_flagged"] == 0
    wrong = gpu_check.cp2_against_cp1(
        ["cp.preprocess=verl_legacy", "model.position_embedding_type=learned_absolute"],
        FP32_TOKEN_ATOL,
        tmp_path / "wrong",
    )
    assert not wrong["passed"] and wrong["tokens_flagged"] > 0
