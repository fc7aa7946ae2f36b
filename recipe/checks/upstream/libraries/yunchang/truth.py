"""yunchang's layouts as its attention reads them, written from that reading alone (see the
package's docstring), and the comparison of every rank's output with them.

Shipped into reproducers verbatim (`inspect.getsource`, with ranks.py and reproducer.py's
`wheel_outputs`): every function here is self-contained (torch and math only, no module globals),
so a reproducer judges a release exactly as the checker does.
"""

import math

import torch


def layout_unit(layout, ring, ulysses):
    """What the length must be a multiple of for `layout` over ring x ulysses ranks."""
    if layout == "zigzag" and ring > 1:
        return math.lcm(2 * ring, ring * ulysses)
    return ring * ulysses


def ring_positions(layout, length, ring, r):
    """The positions ring rank r holds, in order, as the ring attention of `layout` reads them."""
    if layout == "basic":
        block = length // ring
        return list(range(r * block, (r + 1) * block))
    if layout == "zigzag" and ring == 1:
        return list(range(length))  # chunks 0 and 1: the whole sequence, even of odd length
    if layout == "zigzag":
        chunk = length // (2 * ring)
        back = 2 * ring - 1 - r
        return list(range(r * chunk, (r + 1) * chunk)) + list(
            range(back * chunk, (back + 1) * chunk)
        )
    if layout == "stripe":
        return list(range(r, length, ring))
    raise ValueError(f"unknown layout {layout!r}")


def group_ranks(rank, ring, ulysses, ulysses_low):
    """(ring rank, ulysses rank) of rank `rank` of one group, as set_seq_parallel_pg lays them."""
    if ulysses_low:
        return rank // ulysses, rank % ulysses
    return rank % ring, rank // ring


def shard_positions(layout, length, ring, ulysses, r, u):
    """The positions of the rank with ring rank r and ulysses rank u: the u-th of `ulysses`
    consecutive pieces of ring rank r's, which the ulysses all-to-all concatenates in order."""
    held = ring_positions(layout, length, ring, r)
    piece = len(held) // ulysses
    return held[u * piece : (u + 1) * piece]


def value_shape(case, dim):
    """[batch, seqlen, *features], with the sequence on axis `dim` (dim 2: after one feature)."""
    features = list(case["features"])
    if dim == 2 and not features:
        features = [1]
    return [case["batch"], *features[: dim - 1], case["length"], *features[dim - 1 :]]


def make_value(case, dim):
    shape = value_shape(case, dim)
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.int64).reshape(shape)


def truth_outputs(layout, case, options):
    """Every rank's shard by the ground truth: {"shape", "ids"}; a length the layout cannot split
    is padded at its tail with 0 (padding) to the next multiple first."""
    dim = options.get("dim", 1)
    ring, ulysses = case["ring"], case["ulysses"]
    value = make_value(case, dim)
    unit = layout_unit(layout, ring, ulysses)
    padded_length = -(-case["length"] // unit) * unit
    pad_shape = list(value.shape)
    pad_shape[dim] = padded_length - case["length"]
    value = torch.cat([value, value.new_zeros(pad_shape)], dim=dim)
    outputs = []
    for rank in range(ring * ulysses):
        r, u = group_ranks(rank, ring, ulysses, options.get("use_ulysses_low", True))
        positions = shard_positions(layout, padded_length, ring, ulysses, r, u)
        index = torch.tensor(positions, dtype=torch.int64)
        shard = value.index_select(dim, index)
        outputs.append({"shape": list(shard.shape), "ids": shard.flatten().tolist()})
    return outputs


def describe_case(case, options):
    text = (
        f"batch={case['batch']} length={case['length']} features={list(case['features'])} "
        f"ring={case['ring']} ulysses={case['ulysses']}"
    )
    if options.get("dim", 1) != 1:
        text += (
            f" (value shape {value_shape(case, options['dim'])}, chunked on dim {options['dim']})"
        )
    return text


def name_id(case, options, token):
    """What an id is: its batch row, position and feature index in the value, or padding."""
    if token == 0:
        return "padding"
    dim = options.get("dim", 1)
    shape = value_shape(case, dim)
    if not 1 <= token <= math.prod(shape):
        return f"id {token} (not in the value)"
    coords, rest = [], token - 1
    for size in reversed(shape):
        coords.append(rest % size)
        rest //= size
    coords.reverse()
    features = [c for axis, c in enumerate(coords) if axis not in (0, dim)]
    feature = f" feature {features}" if features else ""
    return f"batch {coords[0]} position {coords[dim]}{feature} (id {token})"


def layout_problems(layout, case, options, outputs):
    """[(kind, what)] of every rank's output against the ground truth; kind is raises, lost,
    misplaced or padding. Empty when every rank holds its shard."""
    head = describe_case(case, options)
    raised = [(rank, out["raises"]) for rank, out in enumerate(outputs) if "raises" in out]
    if raised:
        return [("raises", f"{head}: rank {rank} raises {why}") for rank, why in raised]
    ring, ulysses = case["ring"], case["ulysses"]
    low = options.get("use_ulysses_low", True)
    dim = options.get("dim", 1)
    real = math.prod(value_shape(case, dim))
    truth = truth_outputs(layout, case, options)
    problems = []
    seen = {}
    for rank, out in enumerate(outputs):
        for token in out["ids"]:
            if 1 <= token <= real:
                seen.setdefault(token, []).append(rank)
    missing = [token for token in range(1, real + 1) if token not in seen]
    if missing:
        listed = ", ".join(name_id(case, options, t) for t in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        problems.append(
            ("lost", f"{head}: {len(missing)} of {real} elements are on no rank ({listed}{more})")
        )
    twice = [(token, ranks) for token, ranks in seen.items() if len(ranks) > 1]
    if twice:
        token, ranks = twice[0]
        problems.append(
            ("misplaced", f"{head}: {name_id(case, options, token)} is on ranks {ranks}")
        )
    for rank, (out, want) in enumerate(zip(outputs, truth, strict=True)):
        r, u = group_ranks(rank, ring, ulysses, low)
        who = f"{head}: rank {rank} (ring {r}, ulysses {u})"
        if out["shape"] == want["shape"]:
            wrong = [j for j, (g, w) in enumerate(zip(out["ids"], want["ids"])) if g != w]
            real_wrong = [j for j in wrong if want["ids"][j] != 0]
            if wrong:
                j = (real_wrong or wrong)[0]
                slot = list(torch.unravel_index(torch.tensor(j), want["shape"]))
                slot = tuple(int(s) for s in slot)
                problems.append(
                    (
                        "misplaced" if real_wrong else "padding",
                        f"{who}, local slot {slot}: expected "
                        f"{name_id(case, options, want['ids'][j])}, got "
                        f"{name_id(case, options, out['ids'][j])}",
                    )
                )
            continue
        got_shape, want_shape = out["shape"], want["shape"]
        same_but_seq = (
            len(got_shape) == len(want_shape)
            and all(g == w for axis, (g, w) in enumerate(zip(got_shape, want_shape)) if axis != dim)
            and got_shape[dim] < want_shape[dim]
        )
        if same_but_seq:
            wanted = torch.tensor(want["ids"]).reshape(want_shape)
            held = wanted.narrow(dim, 0, got_shape[dim])
            dropped = wanted.narrow(dim, got_shape[dim], want_shape[dim] - got_shape[dim])
            if held.flatten().tolist() == out["ids"] and not bool(dropped.any()):
                problems.append(
                    (
                        "padding",
                        f"{who} holds {got_shape[dim]} position(s) where its shard has "
                        f"{want_shape[dim]}, the rest padding: its real elements sit right, but "
                        "the ranks' shards are of unequal length",
                    )
                )
                continue
        problems.append(
            ("misplaced", f"{who} returns shape {got_shape}; its shard is {want_shape}")
        )
    return problems


def problem_texts(layout, case, options, outputs):
    """What a reproducer reports: the text of every problem layout_problems finds."""
    return [what for _, what in layout_problems(layout, case, options, outputs)]
