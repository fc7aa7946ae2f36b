"""scripts/gpu_check.py (recipe.checks.gpu): on a machine without CUDA an honest report and exit
0; every part's body run here on the CPU (device=cpu, small shapes, an independent torch
reference where Transformer Engine would be), so that the script's first run on a GPU fails only
on what only a GPU can show; the report written after every part, out-of-memory errors reported
with where the part was, the attention kernel recorded and gated; and a negative control for
each verdict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from recipe.checks import gpu as gpu_check
from recipe.checks.gpu import model_parts, shared
from recipe.model.attention import varlen_causal_attention

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
SMALLER = [
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "batching.tokens_per_step=1024",
    "batching.max_tokens_per_rank=1024",
]
ATTENTION_LENGTHS = [64, 7, 128, 16]


@pytest.fixture
def small(monkeypatch):
    """The parts' small model, smaller still: every body in seconds on the CPU."""
    monkeypatch.setattr(shared, "SMALL", shared.SMALL + SMALLER)


@pytest.fixture(autouse=True)
def _determinism_restored():
    """Parts that train (and run_checks) switch torch's process-wide determinism."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# --- the script on a machine without CUDA ----------------------------------------------------


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
    assert len(parts) == 9
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the part would run")
def test_only_runs_the_parts_named_and_determinism_is_set_before_any(monkeypatch):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    report = gpu_check.run_checks(quick=True, only=["bf16_vs_fp32"])
    assert list(report) == ["versions", "bf16_vs_fp32"]
    assert report["bf16_vs_fp32"] == {"status": "skipped", "reason": "no CUDA"}
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"


# --- every part's body on the CPU ------------------------------------------------------------


def selection_module(bf16_pick: str) -> types.SimpleNamespace:
    """A stand-in for TE's attention/dot_product_attention/utils.py that picks `bf16_pick` for
    bf16 and "unfused" for fp32, in TE 2.20's tuple shape. It checks te_backends' PLUMBING
    (every case asked, the answer read by meaning, the bf16 verdict), not TE's selection."""

    def get_attention_backend(params):
        pick = bf16_pick if params.qkv_dtype == torch.bfloat16 else "unfused"
        flash, fused, unfused = (pick == n for n in ("flash", "fused", "unfused"))
        return (flash, None, fused, 1 if fused else None, unfused, [True, True, True])

    return types.SimpleNamespace(
        AttentionParams=types.SimpleNamespace, get_attention_backend=get_attention_backend
    )


def pooled(worlds):
    """cp2_one_gpu's `run_world` on the session's launched gloo worlds (tests/helpers/world.py),
    so that the part's two ranks start no processes of their own."""
    return lambda size, cfg: worlds.run(size, gpu_check.train_recording_kernels, cfg)


def _versions(entry):
    assert entry["torch"] == torch.__version__ and entry["megatron_core"]
    assert entry["device"] == "cpu" and entry["attention_kernels"] == {}


def _te_backends(entry):
    assert len(entry["selection"]) == 8  # bf16/fp32 x cp 1/2 x deterministic or not
    bf16 = [v["selected"] for k, v in entry["selection"].items() if k.startswith("bfloat16")]
    assert bf16 == ["fused"] * 4


def _zigzag(entry):
    assert entry["cases"] == 2 + 4 + 8 and entry["mismatching_ranks"] == 0


def _attention(entry):
    assert entry["ran"]["lengths"] == ATTENTION_LENGTHS
    # bf16 against the fp32 dense reference: rounding, nothing more
    assert 0 < entry["output_rel_l2"] < 1e-2 and 0 < entry["grad_rel_l2_max"] < 1e-2
    assert list(entry["attention_kernels"]) == ["bfloat16"]


def _model(entry):
    for variant, depths in (("plain", 0), ("mtp", 1)):
        result = entry[variant]
        assert result["mtp_depths_compared"] == depths and result["tokens"] > 500
        assert result["token_max_abs"] == 0.0  # the same weights, the same backend
        assert result["mtp_token_max_abs"] in ((0.0,) if depths else (None,))
        assert result["grad_rel_l2_max"] < 1e-6  # the CPU backward sums in threads
        assert result["grads_compared"] > 10 and not result["grads_missing"]
    assert entry["ran"]["backends"] == ["torch", "torch"]
    assert list(entry["attention_kernels"]) == ["bfloat16"]


def _cp2(entry):
    from recipe.names import FP32_TOKEN_ATOL

    result = entry["torch fp32"]
    assert result["token_atol"] == FP32_TOKEN_ATOL
    assert result["tokens_compared"] > 1000 and result["tokens_flagged"] == 0
    assert entry["skipped"] == {"te bf16": "no CUDA"}
    assert entry["ran"]["ranks"] == 2 and entry["ran"]["route"] == "gloo"
    assert "float32" in entry["attention_kernels"]  # the ranks' own record came back


def _host_syncs(entry):
    assert entry["layers_2"]["recipe"] == entry["layers_4"]["recipe"] >= 1
    # megatron's own reads (its unfused THD RoPE reads the boundaries per layer on 0.19.2) are
    # shown, not gated: the count is there, by whose code
    assert entry["layers_4"]["megatron"] >= entry["layers_2"]["megatron"] > 0
    assert entry["ran"]["counted"].startswith("host reads")


def _bf16(entry):
    assert entry["ran"]["steps"] == 2 and entry["step1_rel"] < 1e-2
    assert entry["final"]["bf16"] == pytest.approx(entry["final"]["fp32"], rel=2e-2)
    assert set(entry["attention_kernels"]) == {"bfloat16", "float32"}


def _real_offsets(entry):
    assert entry["padded_rows_zero"] and entry["padded_keys_without_gradient"]
    assert entry["output_rel_l2"] < 1e-5, entry  # fp32 on the CPU against the fp32 product


def _mfu(entry):
    assert entry["steps_timed"] == 1 and entry["warmup_steps"] == 1
    assert 0 < entry["mfu_median"] < 1 and entry["tokens_per_s_median"] > 0
    assert entry["peak_memory_gib"] is None  # no allocator statistics on the CPU
    assert entry["mfu_goal"] == 0.35 and entry["meets_mfu_goal"] is None, "judged on a GPU only"
    assert entry["ran"]["backend"] == "torch" and entry["ran"]["hidden_size"] == 64
    # the varlen path against the per-sequence loop (cuDNN off as well on CUDA only)
    variants = entry["variants"]
    assert list(variants) == ["training's attention", "per-sequence SDPA"]
    assert variants["training's attention"]["mfu_median"] == entry["mfu_median"]
    assert all(0 < v["mfu_min"] <= v["mfu_median"] <= v["mfu_max"] for v in variants.values())
    # the time split of the headline variant's profiled steps: every part found, none larger
    # than the step (CPU time on the CPU)
    split = entry["time_split"]
    assert split["clock"] == "CPU time" and split["steps"] == 2
    parts = split["parts_s"]
    assert set(parts) == {"attention", "rope", "mlp", "loss", "optimizer", "backward, other"}
    assert all(0 < seconds < split["step_s"] for seconds in parts.values()), split


@dataclass(frozen=True)
class CpuBody:
    """How a part's body runs on the CPU, and what its result must show."""

    options: Callable[[pytest.FixtureRequest], dict]
    """The part's options on the CPU (the request: for fixtures only some parts need)."""
    check: Callable[[dict], None]
    """Assertions on the part's report entry beyond its status."""
    marks: tuple = ()


RUNS_THE_MODEL = (pytest.mark.stack_dependent,)
TRAINS = pytest.mark.skipif(
    torch.cuda.is_available(), reason="train() computes on the GPU here: gpu_check runs this part"
)
CPU_BODIES = {
    "versions": CpuBody(lambda request: {}, _versions),
    "te_backends": CpuBody(lambda request: {"selector": selection_module("fused")}, _te_backends),
    "zigzag_vs_te": CpuBody(lambda request: {"partition": gpu_check.zigzag_reference}, _zigzag),
    "attention_vs_te": CpuBody(
        lambda request: {
            "reference": gpu_check.dense_causal_attention,
            "lengths": ATTENTION_LENGTHS,
        },
        _attention,
    ),
    "real_offsets": CpuBody(
        lambda request: {"lengths": ATTENTION_LENGTHS, "dtype": torch.float32}, _real_offsets
    ),
    "model_te_vs_torch": CpuBody(
        lambda request: {"backends": ("torch", "torch")}, _model, RUNS_THE_MODEL
    ),
    "cp2_one_gpu": CpuBody(
        lambda request: {"run_world": pooled(request.getfixturevalue("worlds"))},
        _cp2,
        (pytest.mark.distributed, pytest.mark.stack_dependent, TRAINS),
    ),
    "host_syncs": CpuBody(lambda request: {}, _host_syncs, RUNS_THE_MODEL),
    "bf16_vs_fp32": CpuBody(lambda request: {"steps": 2}, _bf16, (*RUNS_THE_MODEL, TRAINS)),
    "mfu_1b": CpuBody(
        lambda request: {
            "overrides": ["trainer.peak_tflops=1"],
            "warmup_steps": 1,
            "timed_steps": 1,
        },
        _mfu,
        (*RUNS_THE_MODEL, TRAINS),
    ),
}


def test_every_part_has_a_cpu_body_test():
    """A new part without its CPU body here fails this test."""
    assert list(CPU_BODIES) == list(gpu_check.CHECKS)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=body.marks) for name, body in CPU_BODIES.items()]
)
def test_every_part_body_runs_on_the_cpu(name, request, small):
    body = CPU_BODIES[name]
    entry = gpu_check.run_part(name, gpu_check.CHECKS[name], CPU, **body.options(request))
    assert entry["status"] == ("info" if name == "versions" else "pass"), entry
    assert "kernel_problem" not in entry and entry["seconds"] >= 0
    body.check(entry)


# --- negative controls: each verdict must be able to fail ------------------------------------


@pytest.mark.stack_dependent
@pytest.mark.parametrize(
    "name, options",
    [("model_te_vs_torch", {"backends": ("torch", "torch")}), ("host_syncs", {})],
)
def test_negative_control_swapped_arguments_to_run_micro_batch_fail_the_part(
    monkeypatch, small, name, options
):
    """The parts drive a micro-batch through `run_micro_batch`, the function training uses; the
    same call with two arguments swapped (as host_syncs once called its own pass) fails."""
    original = model_parts.run_micro_batch
    calls = []

    def swapped(micro, index, model, backward=True):
        calls.append(index)
        return original(micro, model, index, backward)

    monkeypatch.setattr(model_parts, "run_micro_batch", swapped)
    entry = gpu_check.run_part(name, gpu_check.CHECKS[name], CPU, **options)
    assert calls, f"{name} did not run its micro-batch through run_micro_batch"
    assert entry["status"] == "fail" and entry["reason"].startswith("TypeError"), entry


def _zigzag_back_chunk_first(cu, total, cp, rank):
    """The zigzag with each rank's two chunks of every sequence in the wrong order."""
    index = gpu_check.zigzag_reference(cu, total, cp, rank)
    pieces, at = [], 0
    for length in (cu[1:] - cu[:-1]).tolist():
        chunk = length // (2 * cp)
        pieces += [index[at + chunk : at + 2 * chunk], index[at : at + chunk]]
        at += 2 * chunk
    return torch.cat(pieces)


@pytest.mark.parametrize(
    "name, options",
    [
        ("te_backends", {"selector": selection_module("unfused")}),
        ("zigzag_vs_te", {"partition": _zigzag_back_chunk_first}),
        (
            "attention_vs_te",
            {
                # keys and values swapped in the reference
                "reference": lambda q, k, v, cu: gpu_check.dense_causal_attention(q, v, k, cu),
                "lengths": ATTENTION_LENGTHS,
            },
        ),
        (
            "real_offsets",
            {
                # the real tokens of all sequences as one sequence in the reference
                "reference": lambda q, k, v, cu: gpu_check.dense_causal_attention(
                    q, k, v, cu[[0, -1]]
                ),
                "lengths": ATTENTION_LENGTHS,
                "dtype": torch.float32,
            },
        ),
    ],
    ids=["te_backends", "zigzag_vs_te", "attention_vs_te", "real_offsets"],
)
def test_negative_control_a_wrong_answer_fails_the_part(name, options):
    """te_backends with unfused picked for bf16, the zigzag with a rank's chunks swapped, the
    attention reference with keys and values swapped, the real-offsets reference attending across
    sequences: each fails its part on the verdict (a failure without a crash's reason)."""
    entry = gpu_check.run_part(name, gpu_check.CHECKS[name], CPU, **options)
    assert entry["status"] == "fail" and "reason" not in entry, entry


@pytest.mark.stack_dependent
def test_negative_control_a_per_layer_boundary_read_fails_host_syncs(monkeypatch, small):
    """Without the per-micro-batch layout cache every layer reads the boundaries again: the
    recipe's count grows with depth and the part fails."""
    from recipe.model import attention

    def uncached(packed_seq_params, cp_size, cp_rank):
        padded, real = attention._sequence_bounds(packed_seq_params)
        return attention.stream_layout(padded, cp_size, cp_rank, real)

    monkeypatch.setattr(attention, "micro_batch_layout", uncached)
    entry = gpu_check.run_part("host_syncs", gpu_check.check_host_syncs, CPU)
    assert entry["status"] == "fail", entry
    assert entry["layers_4"]["recipe"] > entry["layers_2"]["recipe"]


@TRAINS
@pytest.mark.distributed
@pytest.mark.stack_dependent
def test_negative_control_wrong_cp_positions_fail_cp2_against_cp1(small, worlds, tmp_path):
    """cp2_one_gpu's comparison catches a known CP bug: the pre-fix position_ids."""
    from recipe.names import CUDA_FP32_TOKEN_ATOL, FP32_TOKEN_ATOL

    wrong = gpu_check.cp2_against_cp1(
        ["cp.preprocess=verl_legacy", "model.position_embedding_type=learned_absolute"],
        FP32_TOKEN_ATOL,
        tmp_path,
        steps=1,
        run_world=pooled(worlds),
    )
    assert not wrong["passed"] and wrong["tokens_flagged"] > 0
    # by far more than CUDA's looser fp32 bound too (1.9 here): on a GPU it fails as surely
    assert wrong["token_max_abs"] > 100 * CUDA_FP32_TOKEN_ATOL, wrong["token_max_abs"]


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


def test_a_changed_gradient_fails_the_pair_comparison():
    """model_te_vs_torch's gate on two passes that differ in one gradient by 5 %."""
    gen = torch.Generator().manual_seed(0)
    reference = {
        "lm": torch.rand(50, generator=gen),
        "mtp": [torch.rand(49, generator=gen)],
        "grads": {"w": torch.randn(8, 8, generator=gen), "b": torch.randn(8, generator=gen)},
    }
    same = {**reference, "grads": dict(reference["grads"])}
    pairs = {"w": "w", "b": "b"}
    assert gpu_check.passes_within(gpu_check.compare_passes(reference, same, pairs), 1e-6, 1e-6)
    changed = {**reference, "grads": {**reference["grads"], "w": reference["grads"]["w"] * 1.05}}
    worse = gpu_check.compare_passes(reference, changed, pairs)
    assert worse["grad_worst"] == "w" and worse["grad_rel_l2_max"] == pytest.approx(0.05)
    assert not gpu_check.passes_within(worse, 1e-6, 2e-2)


# --- the attention kernel, out of memory, the report after every part ------------------------


def _attention_part(allowed):
    """A part whose body runs the recipe's attention in bf16 with only `allowed` SDPA kernels."""
    from torch.nn.attention import sdpa_kernel

    def part(quick, device, progress):
        (q, k, v), cu = gpu_check.packed_qkv([32, 16], 4, 2, 16, torch.bfloat16, CPU)
        with sdpa_kernel(allowed):
            varlen_causal_attention(q, k, v, cu)
        return {"passed": True}

    return part


def test_bf16_attention_on_the_math_kernel_fails_a_part_on_cuda_only():
    """The gate reads what the recording saw: forced onto the math kernel, a bf16 attention
    fails a part on CUDA (here the device argument says CUDA; the attention itself runs on the
    CPU); on the CPU the same kernel is recorded, not gated; a fused kernel passes on CUDA."""
    from torch.nn.attention import SDPBackend

    cuda = torch.device("cuda")
    on_math = gpu_check.run_part("x", _attention_part([SDPBackend.MATH]), cuda)
    assert on_math["attention_kernels"] == {"bfloat16": ["math"]}
    assert on_math["status"] == "fail" and "math kernel" in on_math["reason"]
    on_cpu = gpu_check.run_part("x", _attention_part([SDPBackend.MATH]), CPU)
    assert on_cpu["status"] == "pass" and on_cpu["attention_kernels"] == {"bfloat16": ["math"]}
    fused = gpu_check.run_part("x", _attention_part([SDPBackend.FLASH_ATTENTION]), cuda)
    assert fused["status"] == "pass", fused
    assert fused["attention_kernels"] == {"bfloat16": ["flash_attention"]}
    assert gpu_check.kernel_problem({"bfloat16": ["te"], "float32": ["math"]}, cuda) is None


@TRAINS
@pytest.mark.stack_dependent
def test_out_of_memory_in_training_is_reported_with_the_step_and_lengths(monkeypatch, small):
    """A part that trains and runs out of memory at step 2: a failure that says where."""
    from recipe.training.trainer import Trainer

    real = Trainer.forward_backward_step

    def out_of_memory_at_step_2(self, work, *args, **kwargs):
        if self.step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, work, *args, **kwargs)

    monkeypatch.setattr(Trainer, "forward_backward_step", out_of_memory_at_step_2)
    entry = gpu_check.run_part("bf16_vs_fp32", gpu_check.check_bf16_vs_fp32, CPU, steps=2)
    assert entry["status"] == "fail"
    assert entry["reason"] == "out of memory: CUDA out of memory. Tried to allocate 20.00 GiB"
    where = entry["out_of_memory"]
    assert where["step"] == 2 and where["doing"] == "training 2 steps in fp32"
    assert len(where["lengths"]) > 1 and sum(where["lengths"]) > 500
    assert where["peak_memory_gib"] is None and where["device"] == "cpu"  # no CUDA here
    assert "out_of_memory_at_step_2" in entry["traceback"]


def test_the_report_is_written_after_every_part_and_out_of_memory_is_caught(tmp_path):
    def out_of_memory(quick, device, progress):
        progress.at("a 65k-token micro-batch", [40000, 25536], step=7)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    def reads_the_report(quick, device, progress):
        on_disk = json.loads((tmp_path / "report.json").read_text())
        return {"passed": True, "seen": {k: v["status"] for k, v in on_disk.items()}}

    checks = {
        "versions": gpu_check.check_versions,
        "runs_out_of_memory": out_of_memory,
        "reads_the_report": reads_the_report,
    }
    report = gpu_check.run_checks(True, out=tmp_path, device=CPU, checks=checks)
    assert report["reads_the_report"]["seen"] == {
        "versions": "info",
        "runs_out_of_memory": "fail",
        "reads_the_report": "running",
    }
    failed = report["runs_out_of_memory"]
    assert failed["reason"].startswith("out of memory: CUDA out of memory")
    assert failed["out_of_memory"] == {
        "device": "cpu",
        "peak_memory_gib": None,
        "doing": "a 65k-token micro-batch",
        "step": 7,
        "lengths": [40000, 25536],
    }
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(
        json.dumps(report, default=str)
    )
    assert "| reads_the_report | pass |" in (tmp_path / "report.md").read_text()


def test_a_part_stopped_by_sigterm_is_reported_and_the_rest_pending(tmp_path):
    """gpu_kit.sh's time cap sends SIGTERM: the part under way is marked stopped, the parts
    after it "pending", the earlier results kept."""

    def hangs(quick, device, progress):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the part")

    def never(quick, device, progress):
        raise AssertionError("a part after the stop ran")

    checks = {"versions": gpu_check.check_versions, "hangs": hangs, "after": never}
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(gpu_check.StoppedBySignal):
        gpu_check.run_checks(True, out=tmp_path, device=CPU, checks=checks)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the parts' alone
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["versions"]["status"] == "info"
    assert report["hangs"] == {"status": "fail", "reason": "stopped by SIGTERM while this part ran"}
    assert report["after"] == {"status": "pending"}
    assert "not reached: the run stopped before this part" in (tmp_path / "report.md").read_text()
