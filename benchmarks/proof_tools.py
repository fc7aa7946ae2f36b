"""Benchmark: what the proof tools cost, as ratios measured in the same run.

1. Per-token records: a training step of the default config (cp=1, one process) with
   `trainer.record_tokens` on that step, over the same step without (goal: <= 2x). Steps alternate
   recorded / not recorded on fresh trainers built from the same seed, so both see the same data
   and weights; the minimum over repeats is the least noisy estimate of each.
2. The preprocessing checker: 1000 hypothesis cases of `verl_fixed` on one intra-op thread
   (goal: under 60 s), and the time per case.

A report; `--check` exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_RECORD_SLOWDOWN = 2.0
MAX_CHECKER_SECONDS = 60.0


def step_times(repeats: int) -> tuple[float, float]:
    from recipe.data.corpus import load_corpus
    from recipe.launch.compose import compose_config, to_typed
    from recipe.launch.local import lone_world
    from recipe.training.trainer import Trainer

    plain, recorded = [], []
    with lone_world() as layout, tempfile.TemporaryDirectory() as out:
        base = ["logger.wandb.mode=disabled", "trainer.progress_bar=false"]
        corpus = None
        for i in range(2 * repeats):
            record = i % 2 == 1
            cfg = to_typed(compose_config(base + (["trainer.record_tokens=[1]"] if record else [])))
            cfg.output_dir = out
            corpus = corpus or load_corpus(cfg.data)
            trainer = Trainer(cfg, layout, torch.device("cpu"), corpus)
            start = time.perf_counter()
            trainer.train_step()
            (recorded if record else plain).append(time.perf_counter() - start)
    return min(plain), min(recorded)


def checker_time(cases: int) -> tuple[float, int]:
    from recipe.checks.preprocess import check
    from recipe.parallel.cp.contract import load_function

    start = time.perf_counter()
    mismatch, ran = check(load_function("verl_fixed"), cases=cases)
    assert mismatch is None, mismatch.describe()
    return time.perf_counter() - start, ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plain, recorded = step_times(args.repeats)
    ratio = recorded / plain
    print(
        f"step without records {plain:.3f} s, with per-token records {recorded:.3f} s: "
        f"{ratio:.2f}x (goal <= {MAX_RECORD_SLOWDOWN:g}x)"
    )
    took, ran = checker_time(args.cases)
    print(
        f"check_preprocess verl_fixed: {ran} cases in {took:.1f} s on one thread, "
        f"{1000 * took / ran:.1f} ms a case (goal: 1000 cases < {MAX_CHECKER_SECONDS:g} s)"
    )
    missed = ratio > MAX_RECORD_SLOWDOWN or (took > MAX_CHECKER_SECONDS and ran >= 1000)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
