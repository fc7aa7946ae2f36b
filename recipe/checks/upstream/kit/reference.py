"""The reproducers' own reference of the zigzag and contiguous layouts: `reference_problems(
outputs)` for the structure `layouts.truth_outputs` builds, written slot by slot in plain Python
(no recipe import, no index tensors), a second statement independent of
`recipe/parallel/cp/zigzag.py`. Shipped verbatim (its source, less this docstring) into the
reproducers that judge a zigzag or contiguous split; `reference_problems(layouts.truth_outputs(
...)) == []` checks the two against each other.
"""


def reference_sequences(lengths):
    stride = max(lengths) + 1
    return [[1 + stride * i + p for p in range(n)] for i, n in enumerate(lengths)]


def reference_values(lengths, width):
    stride = max(lengths) + 1
    rows = []
    for i, n in enumerate(lengths):
        base = [1.0 + p + stride * i for p in range(n)]
        rows.append(base if width is None else [[b + 0.25 * c for c in range(width)] for b in base])
    return rows


def _zigzag_slot(cu, cp, rank, slot):
    """(sequence, position) of local `slot` on `rank`: chunks rank and 2*cp-1-rank of every
    sequence, sequence i's slots from cu[i] // cp; None past the last sequence."""
    for i in range(len(cu) - 1):
        size = cu[i + 1] - cu[i]
        start, half = cu[i] // cp, size // (2 * cp)
        k = slot - start
        if 0 <= k < 2 * half:
            return i, (rank * half + k if k < half else size - (rank + 1) * half + k - half)
    return None


def _contiguous_slot(cu, width, rank, slot):
    """(sequence, position) of local `slot` on `rank` when rank r holds global slots
    [r * width, (r + 1) * width); None past the last sequence."""
    g = rank * width + slot
    for i in range(len(cu) - 1):
        if cu[i] <= g < cu[i + 1]:
            return i, g - cu[i]
    return None


def reference_problems(outputs):
    """What differs from the layout: each real token once, with its position, next-token
    label and loss weight; padding never weighted; the mask and the round trip if given."""
    if outputs.get("error"):
        return ["raises: " + outputs["error"]]
    lengths, cp, cu = outputs["lengths"], outputs["cp"], outputs["cu_seqlens_padded"]
    zigzag = outputs["layout"] == "zigzag"
    if len(cu) != len(lengths) + 1 or cu[0] != 0:
        return [f"cu_seqlens_padded {cu} does not describe {len(lengths)} sequences"]
    found = []
    for i, n in enumerate(lengths):
        size = cu[i + 1] - cu[i]
        if size < n:
            found.append(f"sequence {i} has {n} tokens but {size} slots")
        elif zigzag and size % (2 * cp):
            found.append(
                f"sequence {i}'s padded length {size} is not a multiple of 2*cp={2 * cp}: "
                "the zigzag chunks cannot split it"
            )
    if found:
        return found
    sequences, seen = reference_sequences(lengths), {}
    for rank, fields in enumerate(outputs["ranks"]):
        width = len(fields["input_ids"])
        for slot in range(width):
            where = (
                _zigzag_slot(cu, cp, rank, slot)
                if zigzag
                else _contiguous_slot(cu, width, rank, slot)
            )
            real = where is not None and where[1] < lengths[where[0]]
            want = {"loss_mask": 0}
            if real:
                i, p = where
                n = lengths[i]
                seen.setdefault(where, []).append(rank)
                want = {
                    "input_ids": sequences[i][p],
                    "position_ids": p,
                    "loss_mask": int(p + 1 < n),
                }
                if p + 1 < n:
                    want["labels"] = sequences[i][p + 1]
            if "attention_mask" in fields:
                want["attention_mask"] = int(real)
            text = (
                f"sequence {where[0]}, position {where[1]}" if where else "past the last sequence"
            )
            for name, value in want.items():
                if name in fields and fields[name][slot] != value:
                    found.append(
                        f"rank {rank}, local slot {slot} ({text}): {name} expected "
                        f"{value}, got {fields[name][slot]}"
                    )
    missing = [(i, p) for i, n in enumerate(lengths) for p in range(n) if (i, p) not in seen]
    if missing:
        found.append(
            f"{len(missing)} real tokens on no rank, first: sequence {missing[0][0]} "
            f"position {missing[0][1]}"
        )
    found += [f"sequence {i} position {p} on ranks {r}" for (i, p), r in seen.items() if len(r) > 1]
    want = reference_values(lengths, outputs.get("width"))
    for rank, back in enumerate(outputs.get("round_trip") or []):
        for i, (w, g) in enumerate(zip(want, back, strict=True)):
            if w != g:
                found.append(
                    f"rank {rank}: the round trip gives sequence {i} back as {g[:6]}, "
                    f"sharded from {w[:6]}"
                )
    return found[:12]
