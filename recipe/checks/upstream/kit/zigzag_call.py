"""The reproducer of a function training can call (verl's and Megatron-Bridge's zigzag
functions, `kit/released.py`), as real code shipped by `inspect.getsource` after the kit's
prelude: every rank played in one process, the function reading its rank from the prelude's
`ParallelStateStandIn` as in the checker, and the zigzag contract written out again
(`zigzag_problems`), so the script imports nothing of the recipe.
"""

from __future__ import annotations

import torch

from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import ParallelStateStandIn


def case_sequences(case):
    """The case's sequences, token ids unique over the batch (0 is padding)."""
    stride = max(case["lengths"]) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(case["lengths"])]


def call_outputs(wheel, file, stubs, function_name, fields, case, options):
    """Every rank's input_ids, position_ids, labels, loss_mask and cu_seqlens_padded, `fields`
    calling the function as training does."""
    module = load_from_wheel(wheel, file, stubs)
    logger = getattr(module, "logger", None)
    if logger is not None and not hasattr(logger, "warning_once"):
        logger.warning_once = logger.debug  # the package's __init__ (not run) adds it
    function = getattr(module, function_name)
    sequences = [torch.tensor(s) for s in case_sequences(case)]
    outputs = []
    for rank in range(case["cp"]):
        module.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
        got = fields(function, sequences, dict(options))
        outputs.append({k: v.tolist() for k, v in got.items()})
    return outputs


def zigzag_problems(outputs, case):
    """What differs from zigzag CP: every real token on exactly one rank, rank r holding
    chunks r and 2*cp-1-r of every sequence padded to a multiple of 2*cp, at its own slot, with
    its position, the next token of its own sequence as its label, and loss weight 1 where such a
    label exists; padding never weighted."""
    cp = case["cp"]
    sequences = case_sequences(case)
    where = {t: (i, p) for i, s in enumerate(sequences) for p, t in enumerate(s)}
    found, seen = [], {}
    for rank, out in enumerate(outputs):
        for slot, token in enumerate(out["input_ids"]):
            if token not in where:
                if out.get("loss_mask") and out["loss_mask"][slot]:
                    found.append(f"rank {rank} slot {slot}: padding has loss mask 1")
                continue
            seen.setdefault(token, []).append((rank, slot))
            i, p = where[token]
            n = len(sequences[i])
            want = {"position_ids": p, "loss_mask": int(p + 1 < n)}
            if p + 1 < n:
                want["labels"] = sequences[i][p + 1]
            for name, value in want.items():
                if name in out and out[name][slot] != value:
                    found.append(
                        f"rank {rank} slot {slot} (sequence {i}, position {p}): "
                        f"{name} is {out[name][slot]}, should be {value}"
                    )
    cu = outputs[0]["cu_seqlens_padded"]
    for token, (i, p) in where.items():
        places = seen.get(token, [])
        if not places:
            found.append(f"sequence {i} position {p} (token {token}) is on no rank")
            continue
        if len(places) > 1:
            found.append(f"sequence {i} position {p} is on ranks {[r for r, _ in places]}")
        padded = cu[i + 1] - cu[i]
        if padded % (2 * cp):
            continue  # reported once per sequence below
        chunk = padded // (2 * cp)
        c = p // chunk
        rank = c if c < cp else 2 * cp - 1 - c
        slot = cu[i] // cp + p - c * chunk + (0 if c < cp else chunk)
        if places[0] != (rank, slot):
            found.append(
                f"sequence {i} position {p} is at rank {places[0][0]} slot "
                f"{places[0][1]}, zigzag puts it at rank {rank} slot {slot}"
            )
    for i in range(len(sequences)):
        padded = cu[i + 1] - cu[i]
        if padded % (2 * cp):
            found.append(
                f"sequence {i} is padded to {padded}, not a multiple of 2*cp={2 * cp}: "
                "zigzag CP cannot split it into whole chunks"
            )
    return found


def script(helpers: tuple, fields_name: str, constants: dict) -> str:
    """A reproducer's body: torch, `constants` (by repr), the sources of `helpers` (how training
    calls the function: `fields_name` among them) and of the parts above, and the glue."""
    glue = entry_points(
        f"call_outputs(wheel, FILE, STUBS, FUNCTION, {fields_name}, CASE, OPTIONS)",
        "zigzag_problems(outputs, CASE)",
    )
    parts = (*helpers, case_sequences, call_outputs, zigzag_problems)
    return script_body(parts, constants, imports=("torch",), entry=glue)
