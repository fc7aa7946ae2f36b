"""Benchmark: zigzag CP sharding of a packed batch, index path vs verl's per-sequence path.

For every cp and rank it times (a) zigzag_index + index_select of input_ids, position_ids,
labels and loss_mask; (b) the per-sequence verl_fixed reference producing the same four tensors;
(c) a floor of the four index_selects alone with a precomputed index. Times are the minimum over
repeats (the least noisy estimate of the cost itself) and by default use one intra-op thread,
which is what one data-loader worker gets. It is a report and exits 0; ``--check`` exits 1 when a
goal (index >= 10x faster than verl_fixed, <= 3x the floor, on the sum over ranks) is missed.
cp=2 sits closest to the 10x goal: the index path is bound by copying T/cp tokens while verl's cost
is its per-sequence loop, so on a loaded machine its ratio is the first to drop.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipe.data.thd import cu_seqlens_from_lengths, padded_lengths
from recipe.parallel.cp.verl import verl_preprocess, verl_shard_values
from recipe.parallel.cp.zigzag import real_token_mask, zigzag_index

MIN_SPEEDUP_OVER_VERL = 10.0
MAX_SLOWDOWN_OVER_FLOOR = 3.0
VOCAB_SIZE = 32_000
IGNORE_INDEX = -100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=300, help="sequences in the batch")
    parser.add_argument("--min-len", type=int, default=4, help="shortest real length")
    parser.add_argument("--max-len", type=int, default=8192, help="longest real length")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="cp sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=10, help="least timed rounds per rank")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.5,
        help="seconds of extra rounds per rank, for a stabler min",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a goal is missed")
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.sequences < 1 or any(cp < 1 for cp in args.cp):
        parser.error("--sequences and every --cp must be >= 1")
    return args


def log_uniform_lengths(count: int, low: int, high: int, seed: int) -> torch.Tensor:
    # Log-uniform gives the long tail of short sequences that real SFT/RL batches have.
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(low) + u * (math.log(high) - math.log(low)))
    return lengths.round().to(torch.int64).clamp(low, high)


class Batch:
    """Global per-token tensors plus the per-sequence real-token views verl starts from."""

    def __init__(self, lengths: torch.Tensor, cp: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        padded = padded_lengths(lengths, 2 * cp)
        self.cu_seqlens = cu_seqlens_from_lengths(lengths)
        self.cu_seqlens_padded = cu_seqlens_from_lengths(padded)
        total = int(self.cu_seqlens_padded[-1])
        self.input_ids = torch.zeros(total, dtype=torch.int64)
        self.position_ids = torch.zeros(total, dtype=torch.int64)
        self.labels = torch.full((total,), IGNORE_INDEX, dtype=torch.int64)
        self.loss_mask = torch.zeros(total, dtype=torch.float32)
        self.sequences, self.label_sequences, self.mask_sequences = [], [], []
        for start, length, padded_len in zip(
            self.cu_seqlens_padded[:-1].tolist(), lengths.tolist(), padded.tolist(), strict=True
        ):
            real = slice(start, start + length)
            tokens = torch.randint(1, VOCAB_SIZE, (length,), generator=generator)
            self.input_ids[real] = tokens
            self.position_ids[start : start + padded_len] = torch.arange(padded_len)
            self.labels[start : start + length - 1] = tokens[1:]
            self.loss_mask[start : start + length - 1] = 1.0
            self.sequences.append(self.input_ids[real])
            self.label_sequences.append(self.labels[real])
            self.mask_sequences.append(self.loss_mask[real])

    def global_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.position_ids, self.labels, self.loss_mask


def index_path(batch: Batch, cp: int, rank: int) -> tuple[torch.Tensor, ...]:
    index = zigzag_index(batch.cu_seqlens_padded, cp, rank)
    return tuple(t.index_select(0, index) for t in batch.global_tensors())


def verl_path(batch: Batch, cp: int, rank: int) -> tuple[torch.Tensor, ...]:
    input_ids, position_ids = verl_preprocess(
        batch.sequences, batch.cu_seqlens_padded, cp, rank, "verl_fixed"
    )
    labels = verl_shard_values(batch.label_sequences, batch.cu_seqlens_padded, cp, rank)
    loss_mask = verl_shard_values(batch.mask_sequences, batch.cu_seqlens_padded, cp, rank)
    return input_ids, position_ids, labels, loss_mask


def floor_path(batch: Batch, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.index_select(0, index) for t in batch.global_tensors())


def check_same_output(batch: Batch, cp: int, rank: int) -> None:
    """Both paths must agree on real tokens, or the timings would compare different work."""
    real = real_token_mask(batch.cu_seqlens, batch.cu_seqlens_padded, cp, rank)
    for name, a, b in zip(
        ("input_ids", "position_ids", "labels", "loss_mask"),
        index_path(batch, cp, rank),
        verl_path(batch, cp, rank),
        strict=True,
    ):
        if not torch.equal(a[real], b[real]):
            raise AssertionError(f"index and verl_fixed disagree on {name} (cp={cp}, rank={rank})")


def min_times_ms(
    paths: dict[str, Callable[[], object]], repeats: int, budget_s: float
) -> dict[str, float]:
    """Min per-call time of each path, sampling the paths round-robin.

    Round-robin spreads any background load over all paths alike instead of penalising whichever
    path ran while the machine was busy; the minimum is the least noisy estimate of the cost.
    """
    numbers = {}
    for name, fn in paths.items():
        fn()  # warm-up: allocator and first-call costs are not what we measure
        start = time.perf_counter()
        fn()
        once = time.perf_counter() - start
        # Batch fast calls so each timed sample is well above timer resolution.
        numbers[name] = max(1, int(1e-3 / max(once, 1e-7)))
    best = dict.fromkeys(paths, math.inf)
    deadline = time.perf_counter() + budget_s
    done = 0
    while done < repeats or (time.perf_counter() < deadline and done < 50 * repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(numbers[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / numbers[name])
        done += 1
    return {name: t * 1e3 for name, t in best.items()}


def run_cp(lengths: torch.Tensor, cp: int, args: argparse.Namespace) -> bool:
    batch = Batch(lengths, cp, args.seed)
    total = int(batch.cu_seqlens_padded[-1])
    print(f"\ncp={cp}: {len(lengths)} sequences, {total} padded tokens, {total // cp} per rank")
    print(
        f"{'rank':>4} {'index ms':>9} {'verl ms':>9} {'floor ms':>9} {'verl/index':>11} "
        f"{'index/floor':>12}"
    )
    sums = [0.0, 0.0, 0.0]
    for rank in range(cp):
        check_same_output(batch, cp, rank)
        index = zigzag_index(batch.cu_seqlens_padded, cp, rank)
        paths = {
            "index": lambda r=rank: index_path(batch, cp, r),
            "verl": lambda r=rank: verl_path(batch, cp, r),
            "floor": lambda i=index: floor_path(batch, i),
        }
        times = tuple(min_times_ms(paths, args.repeats, args.budget).values())
        sums = [s + t for s, t in zip(sums, times, strict=True)]
        t_index, t_verl, t_floor = times
        print(
            f"{rank:>4} {t_index:>9.3f} {t_verl:>9.3f} {t_floor:>9.3f} "
            f"{t_verl / t_index:>10.1f}x {t_index / t_floor:>11.2f}x"
        )
    t_index, t_verl, t_floor = sums
    speedup, slowdown = t_verl / t_index, t_index / t_floor
    print(
        f"{'sum':>4} {t_index:>9.3f} {t_verl:>9.3f} {t_floor:>9.3f} "
        f"{speedup:>10.1f}x {slowdown:>11.2f}x"
    )
    passed = speedup >= MIN_SPEEDUP_OVER_VERL and slowdown <= MAX_SLOWDOWN_OVER_FLOOR
    print(
        f"goal cp={cp}: index >= {MIN_SPEEDUP_OVER_VERL:.0f}x faster than verl_fixed "
        f"({speedup:.1f}x), within {MAX_SLOWDOWN_OVER_FLOOR:.0f}x of floor ({slowdown:.2f}x): "
        f"{'PASS' if passed else 'FAIL'}"
    )
    return passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = log_uniform_lengths(args.sequences, args.min_len, args.max_len, args.seed)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), lengths {args.min_len}.."
        f"{args.max_len} log-uniform (seed {args.seed}), real tokens {int(lengths.sum())}"
    )
    results = [run_cp(lengths, cp, args) for cp in args.cp]
    return 1 if args.check and not all(results) else 0


if __name__ == "__main__":
    sys.exit(main())
