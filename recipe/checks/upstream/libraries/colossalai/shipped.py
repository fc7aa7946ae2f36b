"""The code ColossalAI's reproducers ship, as real code: `reproducer_body` copies the functions
below into the standalone script by `inspect.getsource` (after the prelude, which provides
`load_from_wheel`), with the constants they read written out, then `kit.layouts.REFERENCE` (its
`reference_sequences` and the zigzag `reference_problems`) and the entry points. The checker
calls the same `Dist`, `rank_outputs`, `rows_truth` and `row_problems` (`__init__.py`), so a
script calls and judges the release exactly as the checker did. Shipped code is self-contained:
torch is imported inside, and the case's tokens come in as an argument.
"""

from __future__ import annotations

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.upstream.prelude import load_from_wheel

UTILS, ATTN = "colossalai/shardformer/layer/utils.py", "colossalai/shardformer/layer/attn.py"
STUBS = ("colossalai", "colossalai.accelerator", "colossalai.kernel",
         "colossalai.kernel.kernel_loader", "colossalai.logging", "einops")  # fmt: skip
PACKAGE = "released_colossalai"  # the reproducer's stub package for attn.py's `from .utils`


class Dist:
    """torch.distributed as the released files call it, the group a (size, rank) stand-in."""

    get_world_size = staticmethod(lambda group=None: group[0])
    get_rank = staticmethod(lambda group=None: group[1])


def rank_outputs(kind, function, sequences, padded, cp, rank, options):
    """One rank's output of `function` as `kind`'s caller gets it, JSON-able: the contract's
    fields in its local order, their layout, and for "varlen" the local padding's labels and
    mask_info. `padded`: each sequence's padded length."""
    import torch

    group, n, top = (cp, rank), len(sequences), max(padded)
    bounds = [sum(padded[:i]) for i in range(n + 1)]
    if kind == "packed":
        rolled = not options.get("is_label", True)
        stream, positions, labels = [], [], []
        for s, p in zip(sequences, padded):
            stream += list(s) + [0] * (p - len(s))
            positions += list(range(p))
            labels += list(s[rolled:]) + [-100] * (p - len(s) + rolled)
        cu = torch.tensor(bounds, dtype=torch.int32)
        tokens, positions = function([torch.tensor(stream), torch.tensor(positions)], cu, group)
        labels = function(torch.tensor(labels), cu, group, is_label=not rolled)
        fields = {"input_ids": tokens, "position_ids": positions, "labels": labels}
        return _flat(fields, range(len(tokens)), bounds)
    width = top + options.get("extra_columns", 0)
    ids, mask = torch.zeros(n, width, dtype=torch.int64), torch.zeros(n, width, dtype=torch.int64)
    labels = torch.full((n, width), -100)
    for j, (s, p) in enumerate(zip(sequences, padded)):
        ids[j, : len(s)] = labels[j, : len(s)] = torch.tensor(s, dtype=torch.int64)
        mask[j, : p if kind == "varlen" else width] = 1
    hidden, positions = ids[..., None].double(), torch.arange(width)[None]
    if options.get("position_ids", "shared") == "per_row":
        positions = positions.repeat(n, 1)
    if kind == "varlen":
        hidden, info, positions = function(mask, group, hidden, positions)
        labels = function(mask, group, labels, is_label=True)[0]
    else:
        hidden, positions = function([hidden, positions], group)
        labels = function(labels, group, seq_dim=1, is_label=True)
    local = hidden.shape[1]
    fields = {"input_ids": hidden[..., 0], "position_ids": positions.expand(n, local),
              "labels": labels}  # fmt: skip
    if kind == "rows":
        return _flat(fields, range(n * local), [j * width for j in range(n + 1)])
    out = _flat(fields, [j * local + s for j in range(n) for s in range(padded[j] // cp)], bounds)
    out["rows"] = {"padding_labels": [labels[j, padded[j] // cp :].tolist() for j in range(n)],
                   "cu_seqlens": info["cu_seqlens"].tolist(), "width": local,
                   "valid_indices": info["valid_indices"].tolist()}  # fmt: skip
    return out


def _flat(fields, keep, layout):
    flat = {k: [int(v) for v in t.reshape(-1).tolist()] for k, t in fields.items()}
    flat = {k: [v[i] for i in keep] for k, v in flat.items()}
    flat["loss_mask"] = [int(v != -100) for v in flat["labels"]]
    return {"fields": flat, "cu_seqlens_padded": layout}


def rows_truth(padded, cp, width):
    """What right "varlen" rows of `width` local slots hold besides the contract's slots."""
    local = [p // cp for p in padded]
    valid = [j * width + s for j, n in enumerate(local) for s in range(n)]
    cu = [sum(local[:i]) for i in range(len(local) + 1)]
    pad = [[-100] * (width - n) for n in local]
    return {"padding_labels": pad, "width": width, "cu_seqlens": cu, "valid_indices": valid}


def row_problems(out, padded, cp):
    """(impact level, message) of one rank's "varlen" rows against `rows_truth`: 3 = a local
    padding slot has a label but -100 (dist_cross_entropy trains it, loss.py:213-217), or
    mask_info does not describe the rows' slots (ring attention unpads with it, attn.py:587)."""
    got, found = out.get("rows"), []
    want = rows_truth(padded, cp, got["width"]) if got else {}
    for j, labels in enumerate(got["padding_labels"] if got else []):
        k = next((k for k, v in enumerate(labels) if v != -100), None)
        if k is not None:
            where = f"row {j}, local slot {padded[j] // cp + k} (padding past sequence {j}'s "
            found.append((3, f"{where}{padded[j] // cp} slots): label {labels[k]}, not -100: "
                          "dist_cross_entropy trains it and counts it"))  # fmt: skip
    for key in ("cu_seqlens", "valid_indices") if got else ():
        if got[key] != want[key]:
            found.append((3, f"mask_info {key} {got[key][:12]}, expected {want[key][:12]}"))
    return found


def load_released(wheel):
    """(utils, attn) of the release: utils.py, then attn.py in a stub package whose `utils` has
    utils.py's names; `dist` answering for the group stand-in."""
    stubs = {key: {} for key in STUBS}
    utils = load_from_wheel(wheel, UTILS, stubs)
    names = {k: v for k, v in vars(utils).items() if not k.startswith("__")}
    stubs.update({PACKAGE: {}, PACKAGE + ".utils": names})
    attn = load_from_wheel(wheel, ATTN, stubs, package=PACKAGE)
    utils.dist = attn.dist = Dist()  # torch.distributed, answering for the group stand-in
    attn._pad_input = attn._unpad_input = "flash-attn's pad/unpad: not called"
    return utils, attn


def padded_lengths(case):
    """Each sequence of the case padded to a multiple of 2*cp*tp."""
    unit = 2 * case["cp"] * case["tp"]
    return [-(-n // unit) * unit for n in case["lengths"]]


def released_outputs(wheel, kind, case, options, sequences):
    """Every rank's `rank_outputs` of the released function of `kind` on `sequences`: the
    contract's fields (`ranks`), the rows' extras (`rows`) and the layout, or the raise."""
    utils, attn = load_released(wheel)
    function = {
        "varlen": attn.RingAttention.prepare_varlen_batch,
        "rows": utils.split_batch_zigzag,
        "packed": utils.split_varlen_zigzag,
    }[kind]
    lengths, cp = case["lengths"], case["cp"]
    out = {"lengths": lengths, "cp": cp, "layout": "zigzag", "error": None}
    try:
        got = [
            rank_outputs(kind, function, sequences, padded_lengths(case), cp, rank, options)
            for rank in range(cp)
        ]
        out.update(
            ranks=[g.pop("fields") for g in got],
            rows=got,
            cu_seqlens_padded=got[0].pop("cu_seqlens_padded"),
        )
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
    return out


def rank_row_problems(outputs, case):
    """`row_problems` of every rank's rows, each message led by its rank."""
    found = []
    for rank, rows in enumerate([] if outputs.get("error") else outputs["rows"]):
        found += [
            f"rank {rank}, {m}" for _, m in row_problems(rows, padded_lengths(case), outputs["cp"])
        ]
    return found


SHIPPED = (
    Dist,
    rank_outputs,
    _flat,
    rows_truth,
    row_problems,
    load_released,
    padded_lengths,
    released_outputs,
    rank_row_problems,
)

# The script's entry points: the release on the reference's tokens, judged by the zigzag
# reference and, row by row, by the truth of the caller's rows.
ENTRY = entry_points(
    'released_outputs(wheel, KIND, CASE, OPTIONS, reference_sequences(CASE["lengths"]))',
    "reference_problems(outputs) + rank_row_problems(outputs, CASE)",
)


def reproducer_body(kind: str) -> str:
    """The reproducer's body after the prelude and the case: the constants, the shipped code,
    the reference and the entry points."""
    constants = {"KIND": kind, "UTILS": UTILS, "ATTN": ATTN, "STUBS": STUBS, "PACKAGE": PACKAGE}
    return script_body(SHIPPED, constants, after=layouts.REFERENCE, entry=ENTRY)
