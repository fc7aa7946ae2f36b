"""The ground truth of ms-swift's rows: what every slot of a packed row (or of rows side by side)
holds, the zigzag (per sample, the tail's padding in segments of 2*cp) or contiguous slots each
rank must get, and the tensor layouts ([b, s], [b, s, h], [s, b, h]) the split is drawn over."""

from __future__ import annotations

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.libraries.ms_swift.release import IGNORE, PAD_ID


def case_text(lengths, cp: int, tp: int) -> str:
    return f"lengths={list(lengths)} cp={cp} tp={tp}"


def token_places(sequences) -> dict[int, tuple[int, int]]:
    return {t: (i, p) for i, seq in enumerate(sequences) for p, t in enumerate(seq)}


def tail_problem(sequences, fields: list[dict], cu_end: int, cp: int) -> str | None:
    """Zigzag, packed: past the last sample's boundary a rank holds only the tail's padding
    segments, so no real token and no loss weight. Of the real tokens found there, one that
    trains at another position than its own is named first (the harm is plainest)."""
    where = token_places(sequences)
    start = cu_end // cp
    found, weighted = [], None
    for rank, got in enumerate(fields):
        for slot in range(start, got["loss_mask"].numel()):
            if "input_ids" in got and int(got["input_ids"][slot]) in where:
                i, p = where[int(got["input_ids"][slot])]
                found.append((int(got["position_ids"][slot]) == p, rank, slot, i, p,
                              int(got["position_ids"][slot])))  # fmt: skip
            elif weighted is None and float(got["loss_mask"][slot]) != 0:
                weighted = (rank, slot, plain_number(float(got["loss_mask"][slot])))
    where_tail = f"(in the tail's padding segments, past the last sample's boundary {cu_end})"
    if found:
        _, rank, slot, i, p, at = min(found)
        return (
            f"rank {rank}, local slot {slot} {where_tail}: holds sequence {i} position {p}, "
            f"which trains there at position {at} of a padding segment"
        )
    if weighted is not None:
        rank, slot, weight = weighted
        return f"rank {rank}, local slot {slot} {where_tail}: loss weight {weight} on padding"
    return None


def plain_number(value: float):
    return int(value) if float(value).is_integer() else value


def slot_truth(sequences, cu: torch.Tensor, total: int) -> dict[str, list]:
    """Every global slot of a row (or rows side by side) of `total` slots laid out on `cu`: its
    sample and position (-1 past the last sample), token, next-token label and loss weight."""
    seq, pos = [-1] * total, [-1] * total
    token, label, weight = [PAD_ID] * total, [IGNORE] * total, [0] * total
    for i, tokens in enumerate(sequences):
        for g in range(int(cu[i]), int(cu[i + 1])):
            p = g - int(cu[i])
            seq[g], pos[g] = i, p
            if p < len(tokens):
                token[g] = tokens[p]
            if p + 1 < len(tokens):
                label[g], weight[g] = tokens[p + 1], 1
    return {"sequence": seq, "position": pos, "token": token, "label": label, "weight": weight}


def contiguous_problem(sequences, fields: list[dict], cu: torch.Tensor, rows: int, width: int,
                        cp: int) -> tuple[Impact, str] | None:  # fmt: skip
    """Contiguous CP: of each row of `width` slots rank r holds slots [r*width/cp,
    (r+1)*width/cp); every real token there with its position, label and weight, padding
    weighted 0, and every real token on a rank."""
    where = token_places(sequences)
    if "input_ids" in fields[0]:
        seen = {int(t) for got in fields for t in got["input_ids"].tolist()}
        missing = [where[t] for t in where if t not in seen]
        if missing:
            listed = ", ".join(f"sequence {i} position {p}" for i, p in missing[:6])
            return Impact.LOST, f"{len(missing)} real tokens are on no rank ({listed})"
    truth = slot_truth(sequences, cu, rows * width)
    local = width // cp
    for rank, got in enumerate(fields):
        for name, value in got.items():
            if value.numel() != rows * local:
                return Impact.MISPLACED, (
                    f"rank {rank}: {name} holds {value.numel()} slots, contiguous CP gives each "
                    f"rank {rows} x {local}"
                )
        for slot in range(rows * local):
            g = (slot // local) * width + rank * local + slot % local
            i, p = truth["sequence"][g], truth["position"][g]
            real = i >= 0 and p < len(sequences[i])
            expected = {"loss_mask": truth["weight"][g]}
            if real:
                expected.update(input_ids=truth["token"][g], position_ids=p)
            if truth["weight"][g]:
                expected["labels"] = truth["label"][g]
            for name, want in expected.items():
                if name in got and float(got[name][slot]) != want:
                    at = f"sequence {i}, position {p}" if real else "padding"
                    return Impact.MISPLACED, (
                        f"rank {rank}, local slot {slot} (global slot {g}: {at}): {name} "
                        f"expected {want}, got {plain_number(float(got[name][slot]))}"
                    )
    return None


def zigzag_slots(start: int, end: int, cp: int, rank: int) -> torch.Tensor:
    chunk = (end - start) // (2 * cp)
    front = torch.arange(start + rank * chunk, start + (rank + 1) * chunk)
    back_start = start + (2 * cp - 1 - rank) * chunk
    return torch.cat([front, torch.arange(back_start, back_start + chunk)])


def layout_truth_outputs(sequences, layout: torch.Tensor, rows: int, width: int, cp: int, mode: str,
                   with_tokens: bool) -> dict:  # fmt: skip
    """What a correct split gives each rank, in the reproducers' structure: the ground truth's
    slots of the row(s) laid out on `layout` (the samples' boundaries the release chose),
    zigzag per sample with the tail's padding in segments of 2*cp, or contiguous blocks."""
    total = rows * width
    truth = slot_truth(sequences, layout, total)
    fields = {
        "input_ids": truth["token"],
        "position_ids": [max(p, 0) for p in truth["position"]],
        "labels": truth["label"],
        "loss_mask": truth["weight"],
    }
    if not with_tokens:
        fields.pop("input_ids")
    cuts = [int(c) for c in layout]
    while cuts[-1] < total:
        cuts.append(min(cuts[-1] + 2 * cp, total))
    ranks = []
    for rank in range(cp):
        if mode == "contiguous":
            local = width // cp
            index = [b * width + rank * local + k for b in range(rows) for k in range(local)]
        else:
            index = [int(g) for a, b in zip(cuts, cuts[1:]) for g in zigzag_slots(a, b, cp, rank)]
        ranks.append({name: [values[g] for g in index] for name, values in fields.items()})
    return {"layout": cuts[: len(sequences) + 1], "rows": rows, "width": width, "ranks": ranks}


def shaped(rows: torch.Tensor, layout: str) -> tuple[torch.Tensor, int]:
    """[b, s] values as the tensor of `layout` ([b, s], [b, s, h] or [s, b, h]) and its dim."""
    shape, dim = layout.split(":")
    if shape == "bs":
        return rows, int(dim)
    stacked = torch.stack([rows * 2, rows * 2 + 1], dim=-1)  # h = 2 distinct values per slot
    return (stacked if shape == "bsh" else stacked.transpose(0, 1).contiguous()), int(dim)


def unshaped(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of shaped: [b, s] from the tensor's first hidden value."""
    shape = layout.split(":")[0]
    if shape == "bs":
        return tensor
    if shape == "sbh":
        tensor = tensor.transpose(0, 1)
    return torch.div(tensor[..., 0], 2, rounding_mode="floor")


def stream_rows(sequences, cu: torch.Tensor, rows: bool) -> tuple[dict, torch.Tensor, int]:
    """The contract's fields on the packed row (or one row per sample, each padded to the
    widest), the samples' boundaries, and the row width."""
    if rows:
        width = int(cu.diff().max())
        layout = torch.arange(len(sequences) + 1, dtype=torch.int64) * width
    else:
        width, layout = int(cu[-1]), cu.to(torch.int64)
    truth = slot_truth(sequences, layout, int(layout[-1]))
    fields = {
        "input_ids": torch.tensor(truth["token"]),
        "position_ids": torch.tensor([max(p, 0) for p in truth["position"]]),
        "labels": torch.tensor(truth["label"]),
        "loss_mask": torch.tensor(truth["weight"]),
    }
    n_rows = len(sequences) if rows else 1
    return {k: v.reshape(n_rows, width) for k, v in fields.items()}, layout, width
