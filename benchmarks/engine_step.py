"""Benchmark: one optimizer step on megatron-core's engine (the default) against the reference loop.

Both engines train the same model on the same steps of data in this process (a world of one, or
under torchrun a world of any layout), their steps interleaved so that a loaded machine slows both
alike. It prints, per engine, the median, min and max step time over the timed steps (after
warm-up steps) and the ratio megatron / reference of the medians. A report: it exits 0. What the
ratio holds: megatron's DDP copies every gradient into its contiguous buffer (`main_grad`) and its
optimizer copies it back, where the reference loop all-reduces `.grad` in place; on one CPU process
both costs are small next to the forward and backward of even the tiny model.

    .venv/bin/python benchmarks/engine_step.py                      # tiny model, 1 rank
    .venv/bin/python benchmarks/engine_step.py model=small mtp=on   # any train.py override
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = [
    "model.num_layers=2",
    "data.max_seq_len=512",
    "data.markov.mean_doc_len=150",
    "data.markov.max_doc_len=500",
    "batching.tokens_per_step=4096",
    "batching.max_tokens_per_rank=2048",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after the tiny set)")
    return parser.parse_args(argv)


def _trainer(overrides: list[str], engine: str, layout, corpus):
    from recipe.launch.compose import compose_typed
    from recipe.megatron.cpu_patches import seed_model_parallel_rng
    from recipe.training.trainer import Trainer

    cfg = compose_typed([*overrides, f"trainer.engine={engine}"])
    cfg.trainer.eval_every = 0
    seed_model_parallel_rng(cfg.trainer.seed)
    return cfg, Trainer(cfg, layout, torch.device("cpu"), corpus)


def main(argv: list[str] | None = None) -> int:
    from recipe.data.corpus import load_corpus
    from recipe.launch.compose import compose_typed
    from recipe.megatron.cpu_patches import install_cpu_patches
    from recipe.parallel import groups

    args = parse_args(argv)
    total = args.warmup + args.steps
    overrides = [*TINY, *args.overrides, f"trainer.max_steps={total + 1}"]
    install_cpu_patches()
    base = compose_typed(overrides)
    with groups.parallel_world(base.parallel_dims) as layout:
        corpus = load_corpus(base.data, base.image_grid)
        trainers = {e: _trainer(overrides, e, layout, corpus)[1] for e in ("reference", "megatron")}
        times: dict[str, list[float]] = {e: [] for e in trainers}
        losses: dict[str, list[float]] = {e: [] for e in trainers}
        for step in range(total):
            for engine, trainer in trainers.items():
                start = time.perf_counter()
                record = trainer.train_step()
                elapsed = time.perf_counter() - start
                if step >= args.warmup:
                    times[engine].append(elapsed)
                losses[engine].append(record.lm_loss)
    if layout.rank != 0:
        return 0
    print(f"engine step time, {args.steps} steps after {args.warmup} warm-up; {overrides}")
    medians = {}
    for engine, series in times.items():
        medians[engine] = statistics.median(series)
        print(
            f"  {engine:9s} median {medians[engine] * 1e3:8.1f} ms   min {min(series) * 1e3:8.1f}"
            f"   max {max(series) * 1e3:8.1f}"
        )
    print(f"  megatron / reference (medians): {medians['megatron'] / medians['reference']:.3f}")
    drift = max(
        abs(a - b) / abs(b) for a, b in zip(losses["megatron"], losses["reference"], strict=True)
    )
    print(f"  largest lm_loss difference between the engines: {drift:.2e} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
