"""Check the GPU path on ONE GPU and write what was found: report.json and report.md.

    python scripts/gpu_check.py [--out DIR] [--quick] [--only PART,PART]

Parts (each reports pass / fail / skipped with the reason, never silently dropped, and says what
ran: backend, precision, ranks, versions, the attention kernels):
  versions          python, torch, CUDA, cuDNN, NCCL, megatron-core, Transformer Engine, the GPU
  te_backends       which TE attention backend bf16/fp32 x THD x cp x determinism would select
  zigzag_vs_te      the recipe's zigzag index against TE's thd_get_partitioned_indices
  attention_vs_te   the recipe's varlen attention against TE's DotProductAttention (cp=1, bf16):
                    outputs and gradients
  real_offsets      the torch backend given real offsets beside padded ones (Megatron-Bridge's
                    packed SFT): real rows against a dense reference, padded rows exactly zero
  model_te_vs_torch the whole model, te against torch backend at cp=1 on the same weights, in
                    training mode: per-token losses and every gradient, with and without MTP
  cp2_one_gpu       two ranks on the one GPU: cp=2 against cp=1 per token (torch backend; TE too
                    where NCCL lets two ranks share a GPU)
  host_syncs        device synchronisations of one training micro-batch, at 2 and 4 layers
  bf16_vs_fp32      training in bf16 against fp32: step 1 and the final loss
  mfu_1b            model FLOPs utilisation of model=gpt_1b on a 16k-token packed step
                    (non-deterministic kernels, TE where installed, median of >= 8 steps)

Every part is a function `check_<part>(quick, device, progress, **options)`. The script runs it on
the GPU against the real thing (Transformer Engine's selection, partition and attention; torch's
sync debug mode); tests/test_gpu_check.py runs every part's body on the CPU (`device=cpu`, small
shapes, an independent torch reference where TE would be), so that a GPU run fails only on what
only a GPU can show. `run_part` wraps one part: the attention kernels it ran
(`recipe.model.attention.recording_attention_kernels`; on CUDA a bf16 attention that took torch's
math kernel fails the part), its peak memory, and an out-of-memory error reported with where the
part was (`PartProgress`: the step and the sequence lengths). `run_checks` rewrites report.json
and report.md after every part, so a part that hangs until the time cap leaves the earlier
parts' results (and itself marked "running").

Determinism (megatron's deterministic_mode, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, cuBLAS) is set
before any CUDA work; only mfu_1b turns it off. On a machine without CUDA every part after
`versions` is skipped with "no CUDA" and the script exits 0: the report says honestly that
nothing ran. Exit 1 when any part that ran failed. `scripts/gpu_kit.sh run OUT` runs this on a
bare CUDA machine under a hard 8-minute limit.

The package, a module a responsibility: `shared` (what every part uses: Skip, PartProgress,
SMALL, tolerances, ran_with), `references` (the torch references that stand in for Transformer
Engine on the CPU), `syncs` (host reads and CUDA synchronisations counted by whose code),
`attention_parts` (te_backends, zigzag_vs_te, attention_vs_te), `model_parts`
(model_te_vs_torch, host_syncs: one micro-batch through `run_micro_batch`), `training_parts`
(cp2_one_gpu, bf16_vs_fp32, mfu_1b), `parts` (versions and `CHECKS`), `runner` (`run_part`,
`run_checks`, the out-of-memory report, the kernel gate, SIGTERM), `report` (report.json and
report.md); this module: `main` and the names the tests, scripts and docs use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe.checks.gpu.attention_parts import (
    check_attention_vs_te,
    check_real_offsets,
    check_te_backends,
    check_zigzag_vs_te,
    packed_qkv,
    te_attention,
    te_selection,
)
from recipe.checks.gpu.model_parts import (
    check_host_syncs,
    check_model_te_vs_torch,
    compare_passes,
    count_micro_batch_syncs,
    losses_and_gradients,
    model_pair_passes,
    passes_within,
)
from recipe.checks.gpu.parts import CHECKS, check_versions
from recipe.checks.gpu.references import dense_causal_attention, zigzag_reference
from recipe.checks.gpu.report import STATUS_NOTES, render_markdown, write_report
from recipe.checks.gpu.runner import (
    StoppedBySignal,
    kernel_problem,
    kernel_table,
    run_checks,
    run_part,
)
from recipe.checks.gpu.shared import PartProgress, Skip, ran_with
from recipe.checks.gpu.syncs import code_owner, counting_cuda_syncs, counting_host_reads
from recipe.checks.gpu.training_parts import (
    bf16_verdict,
    check_bf16_vs_fp32,
    check_cp2_one_gpu,
    check_mfu_1b,
    cp2_against_cp1,
    sharing_route,
    train_on_local_ranks,
    train_recording_kernels,
)

__all__ = [
    "bf16_verdict",
    "check_attention_vs_te",
    "check_bf16_vs_fp32",
    "check_cp2_one_gpu",
    "check_host_syncs",
    "check_mfu_1b",
    "check_model_te_vs_torch",
    "check_real_offsets",
    "check_te_backends",
    "check_versions",
    "check_zigzag_vs_te",
    "CHECKS",
    "code_owner",
    "compare_passes",
    "count_micro_batch_syncs",
    "counting_cuda_syncs",
    "counting_host_reads",
    "cp2_against_cp1",
    "dense_causal_attention",
    "kernel_problem",
    "kernel_table",
    "losses_and_gradients",
    "model_pair_passes",
    "packed_qkv",
    "PartProgress",
    "passes_within",
    "ran_with",
    "render_markdown",
    "run_checks",
    "run_part",
    "sharing_route",
    "Skip",
    "STATUS_NOTES",
    "StoppedBySignal",
    "te_attention",
    "te_selection",
    "train_on_local_ranks",
    "train_recording_kernels",
    "write_report",
    "zigzag_reference",
    "main",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="folder for report.json, report.md")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    parser.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    args = parser.parse_args(argv)
    only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(CHECKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = run_checks(args.quick, only, out)
    except StoppedBySignal as stop:
        print(f"{stop}: the report so far is in {out / 'report.json'}", file=sys.stderr)
        return 128 + stop.signum
    print(render_markdown(report))
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    return 1 if any(r["status"] == "fail" for r in report.values()) else 0
