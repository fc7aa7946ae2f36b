"""Benchmark: memory over a long run, sampled from outside, with the allocator as the control.

Runs `python train.py` with the given overrides (a run directory of its own under a temporary
folder) and samples the resident memory (RSS, from /proc) of every process of the job, the Hydra
process and each rank it starts, once per `--interval` seconds, beside the step the run has logged.
It prints per process the RSS at the end of warm-up and at the end, and the growth after warm-up
per 100 steps. With `--allocator both` the same run is repeated with glibc's malloc told to give
freed memory back and to keep large blocks in mmap (a fixed mmap threshold): growth that goes away
there is the allocator holding freed memory for the varying tensor sizes of packed batches, not
objects that the run keeps alive (which would grow the same under either setting). A report: it
exits 0 unless a run fails. Linux only (/proc).

    .venv/bin/python benchmarks/soak.py --steps 2000                         # the default run
    .venv/bin/python benchmarks/soak.py --steps 600 -- cp=2 mtp=on          # any train.py override
    .venv/bin/python benchmarks/soak.py --steps 600 --allocator both         # the control
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALLOCATOR_CONTROL = {
    # Without these glibc raises its mmap threshold each time a large block is freed, so later
    # blocks of other sizes come from the heap, which fragments and is rarely given back.
    "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 20),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="trainer.max_steps")
    parser.add_argument("--warmup", type=int, default=100, help="steps before growth is counted")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument(
        "--allocator",
        choices=("default", "control", "both", "unbounded"),
        default="default",
        help="as the recipe runs (oneDNN's cache and glibc's thresholds bounded: "
        "recipe/host_memory.py), with the control settings, one run of each, or with "
        "RECIPE_HOST_MEMORY_DEFAULTS=0 (the libraries' own defaults)",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=500,
        help="also print RSS at every N steps: where it levels off",
    )
    parser.add_argument("overrides", nargs="*", help="train.py overrides")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    return args


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        tree.append(pid)
        queue.extend(sorted(children.get(pid, [])))
    return tree


def logged_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    last = 0
    for line in metrics.read_text().splitlines():
        try:
            last = max(last, int(json.loads(line).get("step", 0)))
        except (json.JSONDecodeError, ValueError):
            continue  # a line being written
    return last


def soak(steps: int, overrides: list[str], interval: float, env: dict) -> dict[int, list]:
    """{pid: [(step, rss MB), ...]} of every process the run had; raises if the run fails."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [
            sys.executable,
            str(ROOT / "train.py"),
            f"trainer.max_steps={steps}",
            "trainer.progress_bar=false",
            "trainer.checkpoint_every=0",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]
        log = open(Path(tmp) / "console.log", "w")  # noqa: SIM115
        job = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        samples: dict[int, list] = {}
        while job.poll() is None:
            step = logged_step(run_dir / "metrics.jsonl")
            for pid in process_tree(job.pid):
                rss = rss_mb(pid)
                if rss is not None and rss > 50:  # skip tiny helpers (the wandb service's shell)
                    samples.setdefault(pid, []).append((step, rss))
            time.sleep(interval)
        log.close()
        if job.returncode != 0:
            tail = (Path(tmp) / "console.log").read_text()[-2000:]
            raise SystemExit(f"run failed (exit {job.returncode}):\n{tail}")
    return samples


def milestones(series: list, every: int) -> list[tuple[int, float]]:
    """(step, RSS) at the first sample at or past each multiple of `every`."""
    marks, found = [], {}
    for step, rss in series:
        mark = step // every * every
        if mark > 0 and mark not in found:
            found[mark] = rss
            marks.append((mark, rss))
    return marks


def summarize(samples: dict[int, list], steps: int, warmup: int, every: int = 0) -> list[str]:
    lines = []
    for number, (pid, series) in enumerate(sorted(samples.items())):
        after = [(s, r) for s, r in series if s >= warmup]
        if len(after) < 2:
            continue
        (s0, r0), (s1, r1) = after[0], after[-1]
        per_100 = (r1 - r0) / max(1, s1 - s0) * 100
        peak = max(r for _, r in series)
        lines.append(
            f"  process {number} (pid {pid}): {r0:7.0f} MB at step {s0}, {r1:7.0f} MB at step "
            f"{s1}, peak {peak:.0f} MB; after warm-up {per_100:+.1f} MB per 100 steps"
        )
        marks = milestones(series, every) if every else []
        if len(marks) > 1:
            growth = [
                f"{b[0]}: {b[1]:.0f} MB ({(b[1] - a[1]) / (b[0] - a[0]) * 100:+.1f}/100 steps)"
                for a, b in zip(marks, marks[1:])
            ]
            lines.append(f"    at {marks[0][0]}: {marks[0][1]:.0f} MB; " + "; ".join(growth))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = ["default", "control"] if args.allocator == "both" else [args.allocator]
    for setting in settings:
        env = dict(os.environ)
        if setting == "control":
            env.update(ALLOCATOR_CONTROL)
        if setting == "unbounded":
            env["RECIPE_HOST_MEMORY_DEFAULTS"] = "0"
        start = time.perf_counter()
        samples = soak(args.steps, args.overrides, args.interval, env)
        took = time.perf_counter() - start
        what = " ".join(args.overrides) or "the default config"
        print(f"{what}, {args.steps} steps, allocator {setting} ({took:.0f} s):")
        print("\n".join(summarize(samples, args.steps, args.warmup, args.every)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
