"""Where do two runs part? Compare their traces module by module, in execution order.

    python -m recipe.compare.diverge RUN_A RUN_B [--step N] [--rtol X]

Both runs need `trainer.trace_steps=[N]` (tp=1; any cp and dp). Every module's output on every
real token is compared in global (sample, position) order, modules in the order the forward pass
ran them; the first whose relative difference (norm of the difference over the norm of RUN_B's
values) exceeds --rtol is named, with the token where it is largest and how many tokens
differ, followed by the other modules and the first parameter whose gradient differs. MTP modules
are compared on the tokens that have a target at their depth: the others reach no loss, and
megatron fills them differently at different cp. Exit 1 when the runs part, 0 when they agree
everywhere, 2 on bad input.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import torch

from recipe.rundir.traces import read_trace

DEFAULT_RTOL = 1e-4
"""fp32 runs at different cp agree to about 1e-6 relative per module; a bug gives 1e-2 and more."""


@dataclass
class ModuleDiff:
    name: str
    kind: str
    """activation | gradient"""
    relative: float
    max_abs: float
    tokens_off: int = 0
    tokens: int = 0
    worst_token: tuple[int, int] | None = None
    """(sample, position) with the largest difference (activations)."""
    note: str = ""


def mtp_depth(name: str, calls: dict[str, int]) -> int:
    """How many tokens at the end of each sequence a module's output may differ on without
    reaching any loss: depth k for MTP layer k-1 (its target is k+1 tokens ahead), and for a
    module the forward pass calls several times (the embedding and output layer that MTP shares;
    the order of the calls differs between megatron releases) the deepest depth among its
    calls. 0 for the rest of the main model. A vision model's language model holds the MTP
    block one level down (`language_model.mtp.layers.K.`): the same depth."""
    match = re.search(r"(?:^|\.)mtp\.layers\.(\d+)\.", name + ".")
    if match:
        return int(match.group(1)) + 1
    return calls.get(name.split("#")[0], 1) - 1


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.norm())
    difference = float((a - b).norm())
    return difference / scale if scale > 0 else (0.0 if difference == 0 else float("inf"))


def _unmatched(x: dict, y: dict | None) -> str:
    """Why two traced modules cannot be compared row by row ('' when they can)."""
    if y is None:
        return "missing in the second run"
    if not (torch.equal(x["sample"], y["sample"]) and torch.equal(x["position"], y["position"])):
        return "the runs traced different tokens"
    if x["values"].shape != y["values"].shape:
        return f"shapes {tuple(x['values'].shape)} vs {tuple(y['values'].shape)}"
    return ""


def _unmatched_diff(name: str, kind: str, note: str) -> ModuleDiff:
    return ModuleDiff(name, kind, float("inf"), float("inf"), note=note)


def compare_traces(a: dict, b: dict, rtol: float) -> list[ModuleDiff]:
    """Activations in a's execution order, then gradients in parameter order."""
    diffs = []
    calls: dict[str, int] = {}
    for name in a["order"]:
        base = name.split("#")[0]
        calls[base] = calls.get(base, 0) + 1
    for name in a["order"]:
        x, y = a["modules"][name], b["modules"].get(name)
        problem = _unmatched(x, y)
        if problem:
            diffs.append(_unmatched_diff(name, "activation", problem))
            continue
        depth = mtp_depth(name, calls)
        if depth:  # tokens without a target at this depth reach no loss: their values are free
            kept = x["room"] > depth
            x = {
                **x,
                "values": x["values"][kept],
                "sample": x["sample"][kept],
                "position": x["position"][kept],
            }
            y = {**y, "values": y["values"][kept]}
        delta = (x["values"] - y["values"]).abs()
        per_token = delta.amax(dim=1) if delta.numel() else delta.new_zeros(0)
        scale = y["values"].abs().amax(dim=1).clamp(min=1e-12) if delta.numel() else per_token
        worst = int(per_token.argmax()) if per_token.numel() else None
        diffs.append(
            ModuleDiff(
                name,
                "activation",
                _relative(x["values"], y["values"]),
                float(per_token.max()) if per_token.numel() else 0.0,
                tokens_off=int((per_token / scale > rtol).sum()),
                tokens=int(per_token.numel()),
                worst_token=None
                if worst is None
                else (int(x["sample"][worst]), int(x["position"][worst])),
            )
        )
    for name, grad in a["grads"].items():
        other = b["grads"].get(name)
        if other is None or other.shape != grad.shape:
            diffs.append(
                _unmatched_diff(name, "gradient", "missing or shaped differently in the second run")
            )
            continue
        diffs.append(
            ModuleDiff(name, "gradient", _relative(grad, other), float((grad - other).abs().max()))
        )
    return diffs


def first_divergence(diffs: list[ModuleDiff], rtol: float, kind: str) -> ModuleDiff | None:
    return next((d for d in diffs if d.kind == kind and not d.relative <= rtol), None)


def render(diffs: list[ModuleDiff], rtol: float, step: int) -> str:
    lines = [f"step {step}, tolerance {rtol:g} (relative difference of each module's output)"]
    first = first_divergence(diffs, rtol, "activation")
    if first is None:
        lines.append("no module's output differs beyond the tolerance")
    else:
        where = ""
        if first.worst_token is not None:
            where = (
                f", largest at sample {first.worst_token[0]} position "
                f"{first.worst_token[1]}; {first.tokens_off} of {first.tokens} tokens off"
            )
        note = f" ({first.note})" if first.note else ""
        lines.append(
            f"first divergence: {first.name}: relative {first.relative:.3g}, max abs "
            f"{first.max_abs:.3g}{where}{note}"
        )
    grad = first_divergence(diffs, rtol, "gradient")
    lines.append(
        "no parameter's gradient differs beyond the tolerance"
        if grad is None
        else f"first gradient that differs: {grad.name}: relative {grad.relative:.3g}"
    )
    lines += ["", "| # | module | relative | max abs | tokens off |", "|---|---|---|---|---|"]
    for i, d in enumerate(d for d in diffs if d.kind == "activation"):
        mark = " **>**" if not d.relative <= rtol else ""
        lines.append(
            f"| {i} | {d.name}{mark} | {d.relative:.3g} | {d.max_abs:.3g} | "
            f"{d.tokens_off}/{d.tokens} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe.compare.diverge", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_a")
    parser.add_argument("run_b", help="the reference (e.g. the cp=1 run)")
    parser.add_argument("--step", type=int, help="the traced step (default: the first)")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL)
    args = parser.parse_args(argv)
    try:
        step, a = read_trace(args.run_a, args.step)
        _, b = read_trace(args.run_b, step)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    diffs = compare_traces(a, b, args.rtol)
    print(render(diffs, args.rtol, step))
    parted = any(not d.relative <= args.rtol for d in diffs)
    return 1 if parted else 0


if __name__ == "__main__":
    sys.exit(main())
