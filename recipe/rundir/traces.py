"""`<run dir>/trace/step_NNNNNNNN.pt`: one step's activations and gradients, in global token order.

Rank 0 merges the ranks' traces (recipe/training/trace.py keeps them) into one file per traced
step: each module's rows sorted into (sample, position) order, modules in execution order, and
every parameter's gradient. Two runs at different layouts then line up row for row
(`python -m recipe.compare.diverge A B`). Written under a temporary name and renamed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from recipe.rundir.layout import STEP_PREFIX, step_name, trace_dir

_SUFFIX = ".pt"


def write_trace(run_dir: str | Path, step: int, rank_traces: list[dict], grads: dict) -> Path:
    """Merge every rank's trace into global (sample, position) order and write it."""
    order = list(rank_traces[0]["order"])
    for trace in rank_traces[1:]:
        order += [name for name in trace["order"] if name not in order]
    modules = {}
    for name in order:
        parts = [t["modules"][name] for t in rank_traces if name in t["modules"]]
        sample, position, values, room = (torch.cat([p[i] for p in parts]) for i in range(4))
        key = sample * (int(position.max()) + 1 if position.numel() else 1) + position
        index = torch.argsort(key, stable=True)
        modules[name] = {
            "sample": sample[index],
            "position": position[index],
            "values": values[index],
            "room": room[index],
        }
    directory = trace_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step_name(step)}{_SUFFIX}"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"order": order, "modules": modules, "grads": grads}, tmp)
    os.replace(tmp, path)
    return path


def read_trace(run_dir: str | Path, step: int | None = None) -> tuple[int, dict]:
    """(step, trace) of a run: the given step, or its first traced one."""
    directory = trace_dir(run_dir)
    found = sorted(directory.glob(f"{STEP_PREFIX}*{_SUFFIX}")) if directory.is_dir() else []
    if not found:
        raise FileNotFoundError(f"{run_dir} has no trace (run it with trainer.trace_steps=[1])")
    steps = {int(p.stem.split("_")[1]): p for p in found}
    chosen = min(steps) if step is None else step
    if chosen not in steps:
        raise FileNotFoundError(f"{run_dir} traced steps {sorted(steps)}, not step {step}")
    return chosen, torch.load(steps[chosen], weights_only=True)
