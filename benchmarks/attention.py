"""Benchmark: packed causal attention against its limit, and host reads per micro-batch by depth.

Attention: one micro-batch of packed sequences (log-uniform lengths), forward and backward, by
(a) the path training takes on this device: one varlen kernel call per layer on CUDA in bf16/fp16
(`recipe/model/varlen_plan.py`), the per-sequence SDPA loop elsewhere; (b) on every device, the
other path as well where it can run (the per-sequence loop on CUDA; the plan run entry by entry
on the CPU); (c) the limit proxy: ONE dense causal SDPA call over a single sequence with the same
number of causal (query, key) pairs, the work a perfect varlen kernel does. Printed as ratios to
(c), measured in the same run: 1.0 is the limit.

Host reads: the host reads of tensors (tolist, item, ...) by all code during one training
micro-batch (MTP on, bf16 on CUDA), at 2 and 4 layers: on a GPU each is a synchronisation.
Printed as `host reads per micro-batch (all code): 2 layers A, 4 layers B`; `--check` exits 1
when B > A (a read per layer crept back in). Times are the minimum over repeats.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipe.model.attention import varlen_causal_attention  # noqa: E402
from recipe.model.varlen_plan import (  # noqa: E402
    attend_by_plan,
    attend_by_plan_reference,
    varlen_kernel,
    varlen_plan,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--sequences",
        type=int,
        default=None,
        help="sequences in the micro-batch (32 on CUDA, 12 on the CPU)",
    )
    parser.add_argument(
        "--max-len", type=int, default=None, help="longest sequence (4096 on CUDA, 512 on the CPU)"
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads (GQA)")
    parser.add_argument("--dim", type=int, default=64, help="head dimension")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip-host-reads",
        action="store_true",
        help="time attention only (the host-read count builds two models)",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when host reads grow with depth"
    )
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.sequences = args.sequences or (32 if cuda else 12)
    args.max_len = args.max_len or (4096 if cuda else 512)
    if args.heads % args.groups:
        parser.error(f"--heads {args.heads} must be a multiple of --groups {args.groups}")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    return args


def lengths(count: int, longest: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    logs = torch.rand(count, generator=generator) * math.log(longest / 8) + math.log(8)
    return [int(x) for x in logs.exp().round().clamp(8, longest)]


def best_of(repeats: int, run, device: torch.device) -> float:
    """The least seconds of `repeats` rounds (after one warm-up)."""
    run()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def time_attention(args) -> dict[str, float]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq = lengths(args.sequences, args.max_len, args.seed)
    cu = torch.tensor([0, *torch.tensor(seq).cumsum(0).tolist()])
    total = int(cu[-1])
    generator = torch.Generator().manual_seed(args.seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_(True)

    q, k, v = (
        make(total, args.heads, args.dim),
        make(total, args.groups, args.dim),
        make(total, args.groups, args.dim),
    )
    plan = varlen_plan(cu.tolist(), device=device)
    pairs = sum(n * (n + 1) // 2 for n in seq)
    dense_len = round((math.sqrt(8 * pairs + 1) - 1) / 2)  # n(n+1)/2 = pairs
    dq, dk, dv = (make(1, args.heads, dense_len, args.dim) for _ in range(3))

    def fwd_bwd(function):
        def run():  # forward, then the gradients of every input (attention's own backward)
            out = function()
            leaves = [t for t in (q, k, v, dq, dk, dv) if t.requires_grad]
            torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)

        return run

    paths = {
        "dense causal (limit proxy)": fwd_bwd(
            lambda: F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=False)
        )
    }
    paths["per-sequence SDPA loop"] = fwd_bwd(lambda: varlen_causal_attention(q, k, v, cu))
    if device.type == "cuda" and varlen_kernel() is not None:
        paths["one varlen kernel call"] = fwd_bwd(lambda: attend_by_plan(q, k, v, plan))
    else:
        paths["plan, entry by entry (CPU stand-in)"] = fwd_bwd(
            lambda: attend_by_plan_reference(q, k, v, plan)
        )
    print(
        f"{args.device}, {str(dtype).removeprefix('torch.')}: {len(seq)} sequences, "
        f"{total} tokens, {pairs} causal pairs (dense proxy: one sequence of {dense_len}), "
        f"{args.heads} heads / {args.groups} groups x {args.dim}, forward + backward"
    )
    times = {name: best_of(args.repeats, run, device) for name, run in paths.items()}
    limit = times["dense causal (limit proxy)"]
    for name, seconds in times.items():
        print(f"  {name:<38} {seconds * 1e3:9.2f} ms   {seconds / limit:6.2f}x the limit")
    return times


def host_reads(device: torch.device) -> tuple[int, int]:
    from recipe.checks.gpu.model_parts import count_micro_batch_syncs
    from recipe.checks.gpu.syncs import counting_host_reads

    shallow, deep = (
        sum(count_micro_batch_syncs(n, device, counting_host_reads).values()) for n in (2, 4)
    )
    print(f"host reads per micro-batch (all code): 2 layers {shallow}, 4 layers {deep}")
    return shallow, deep


def main(argv=None) -> int:
    args = parse_args(argv)
    time_attention(args)
    if args.skip_host_reads:
        return 0
    shallow, deep = host_reads(torch.device(args.device))
    if args.check and deep > shallow:
        print(f"FAIL: host reads grow with depth ({shallow} at 2 layers, {deep} at 4)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
