"""The ground truth and the comparisons with it: (impact, what) of every way the release's
outputs (shipped_run.py) differ from the zigzag contract or the original tensor.

Shipped into reproducers verbatim (`inspect.getsource`): every function here is self-contained
(imports inside, no module globals but the shipped ones). `SHIPPED` is all a reproducer ships,
in order."""

from __future__ import annotations

from recipe.checks.upstream.libraries.areal.shipped_run import (
    GatherStandIn,
    engine_statements,
    load_modules,
    micro_batch,
    postprocess_outputs,
    reassembly_outputs,
    run_statements,
    shards_and_stream,
    split_on_rank,
    split_outputs,
    wheel_outputs,
)
from recipe.parallel.cp.contract import unique_sequences

# ---- shipped into reproducers: self-contained (imports inside, no module globals) ----------


def zigzag_slots(cu, cp, rank):
    """The global slots rank `rank` holds, in its local order: chunks rank and 2*cp-1-rank of
    every sequence of the padded layout `cu`."""
    slots = []
    for i in range(len(cu) - 1):
        half = (cu[i + 1] - cu[i]) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            slots.extend(range(cu[i] + chunk * half, cu[i] + (chunk + 1) * half))
    return slots


def padded_stream(lengths, cu):
    """The ground truth on the padded layout `cu` (which may end with padding sequences):
    token, next token of the same sequence (-1 where none) and (sequence, position) per slot
    (None on padding)."""
    import torch

    total = cu[-1]
    tokens = torch.zeros(total, dtype=torch.float64)
    labels = torch.full((total,), -1.0, dtype=torch.float64)
    where = [None] * total
    for i, seq in enumerate(unique_sequences(lengths)):
        for p, token in enumerate(seq):
            tokens[cu[i] + p] = token
            where[cu[i] + p] = (i, p)
            if p + 1 < len(seq):
                labels[cu[i] + p] = seq[p + 1]
    return tokens, labels, where


def _value(x):
    x = float(x)
    return int(x) if x.is_integer() else x


def split_problems(outputs, case):
    """(impact, what) of every way the split's tokens and labels differ from the zigzag truth."""
    import torch

    if outputs["error"]:
        return [("raises", outputs["error"])]
    lengths, cp, cu = case["lengths"], case["cp"], outputs["cu"]
    problems = []
    for i, n in enumerate(lengths):
        padded = cu[i + 1] - cu[i]
        if padded < n or padded % (2 * cp):
            return [
                (
                    "misplaced",
                    f"sequence {i} ({n} tokens) is padded to {padded}, not a "
                    f"multiple of 2*cp={2 * cp} that holds it",
                )
            ]
    tokens, labels, where = padded_stream(lengths, cu)
    seen = torch.zeros(cu[-1], dtype=torch.bool)
    for rank, got in enumerate(outputs["ranks"]):
        slots = zigzag_slots(cu, cp, rank)
        shapes = [
            f"rank {rank}: {name} has {got[name].numel()} slots, the layout gives it {len(slots)}"
            for name in ("input_ids", "labels")
            if got[name].numel() != len(slots)
        ]
        if shapes:
            return [("misplaced", what) for what in shapes]
        index = torch.tensor(slots, dtype=torch.int64)
        real = torch.tensor([where[g] is not None for g in slots], dtype=torch.bool)
        seen[index[real]] = True
        for name, truth, checked in (
            ("input_ids", tokens[index], real),
            ("labels", labels[index], labels[index] >= 0),
        ):
            have = got[name].to(torch.float64)
            wrong = (checked & (have != truth)).nonzero().flatten().tolist()
            for slot in wrong[:1]:
                i, p = where[slots[slot]]
                problems.append(
                    (
                        "misplaced",
                        f"rank {rank}, local slot {slot} (sequence {i}, position {p}): {name} "
                        f"expected {_value(truth[slot])}, got {_value(have[slot])}",
                    )
                )
    missing = [where[g] for g in range(cu[-1]) if where[g] is not None and not seen[g]]
    if missing:
        problems.append(
            (
                "lost",
                f"{len(missing)} real tokens are on no rank (first: sequence "
                f"{missing[0][0]} position {missing[0][1]})",
            )
        )
    return problems


def _compare(name, want, got, where, real):
    """(impact, what) of the first slot where `got` differs from `want` (1-D or [T, V])."""
    if tuple(got.shape) != tuple(want.shape):
        return ("misplaced", f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    differs = (got != want).reshape(got.shape[0], -1).any(dim=1)
    if real is not None:
        for kind, mask in (("real", real), ("padding", ~real)):
            slots = (differs & mask).nonzero().flatten().tolist()
            if not slots:
                continue
            slot = slots[0]
            expected, have = want[slot].flatten()[0], got[slot].flatten()[0]
            if kind == "padding":
                return (
                    "padding",
                    f"{name}: padding slot {slot} expected {_value(expected)}, "
                    f"got {_value(have)}; every real token is right",
                )
            i, p = where[slot]
            anywhere = bool((got.reshape(got.shape[0], -1)[:, 0] == expected).any())
            impact = "misplaced" if anywhere else "lost"
            lost = (
                ""
                if anywhere
                else f" ({_value(expected)} is nowhere in it: that token never reaches the loss)"
            )
            return (
                impact,
                f"{name}: slot {slot} (sequence {i}, position {p}) expected "
                f"{_value(expected)}, got {_value(have)}{lost}",
            )
    slots = differs.nonzero().flatten().tolist()
    if slots:
        slot = slots[0]
        return (
            "misplaced",
            f"{name}: slot {slot} expected {_value(want[slot].flatten()[0])}, "
            f"got {_value(got[slot].flatten()[0])}",
        )
    return None


def reassembly_problems(outputs, case):
    """(impact, what) per rank whose reassembled, unpadded tensor is not the original."""
    import torch

    if outputs["error"]:
        return [("raises", outputs["error"])]
    seqs = unique_sequences(case["lengths"])
    want = torch.tensor([t for s in seqs for t in s], dtype=torch.float64)
    where = [(i, p) for i, s in enumerate(seqs) for p in range(len(s))]
    real = torch.ones(want.numel(), dtype=torch.bool)
    problems = []
    for rank, got in enumerate(outputs["ranks"]):
        found = _compare(
            "the reassembled, unpadded tensor", want, got.to(torch.float64), where, real
        )
        if found:
            problems.append((found[0], f"rank {rank}: {found[1]}"))
    return problems


def postprocess_problems(outputs, case, options):
    """(impact, what) per rank whose postprocess result is not what its options promise: the
    input unchanged (post_process=False), this rank's shard ([T/cp, V]: no cu_seqlens or
    gather_output=False), else the whole padded stream [T, V]."""
    import torch

    if outputs["error"]:
        return [("raises", outputs["error"])]
    width = options.get("output_width", 3)
    gathers = options.get("gather_output", True) and options.get("pass_cu_seqlens", True)
    tokens, _, where = padded_stream(case["lengths"], outputs["cu"])
    full = tokens[:, None] + torch.arange(width) / 4
    real = torch.tensor([w is not None for w in where], dtype=torch.bool)
    problems = []
    for rank, r in enumerate(outputs["ranks"]):
        got = r["output"].to(torch.float64)
        if not options.get("post_process", True) or not gathers:
            # the input unchanged, or squeezed to this rank's shard: compared slot by slot
            want = r["input"] if not options.get("post_process", True) else r["input"][0]
            if tuple(got.shape) != tuple(want.shape):
                found = (
                    "misplaced",
                    f"the output has shape {tuple(got.shape)}, expected {tuple(want.shape)}",
                )
            else:
                found = _compare(
                    "the output", want.reshape(-1, width), got.reshape(-1, width), None, None
                )
        else:
            found = _compare("the gathered output", full, got, where, real)
        if found:
            problems.append((found[0], f"rank {rank}: {found[1]}"))
    return problems


def problem_texts(found):
    """What a reproducer prints: the text of each (impact, what) problem."""
    return [what for _impact, what in found]


SHIPPED = (
    engine_statements,
    run_statements,
    GatherStandIn,
    load_modules,
    unique_sequences,  # the contract's own tokens: plain Python, shipped as they are
    micro_batch,
    split_on_rank,
    split_outputs,
    shards_and_stream,
    reassembly_outputs,
    postprocess_outputs,
    zigzag_slots,
    padded_stream,
    _value,
    split_problems,
    _compare,
    reassembly_problems,
    postprocess_problems,
    wheel_outputs,
    problem_texts,
)
