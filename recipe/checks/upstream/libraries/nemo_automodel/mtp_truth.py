"""The ground truth of NeMo Automodel's MTP shift (`prepare_mtp_context_parallel_inputs`),
written without the library, and the call of the release's shift on a case.

No `from __future__`, torch only inside `call_mtp`; its one recipe import is packer_truth.py's
shared names, which an MTP reproducer ships with `MTP_SHIPPED` (verbatim, `inspect.getsource`)
and `MTP_CONSTANTS` (by value), so the standalone script calls and judges the release exactly as
the checker (`targets.py`) does.

MTP shift (`prepare_mtp_context_parallel_inputs`): for depth d, a real token at position p of a
document of real length L has, when p + d < L, the token, position and label of position p + d of
the same document and a valid mask of True; otherwise its target is the ignore index (a label
from padding or from another document must never train), and its valid mask is False when
position p + d is outside the document's padded span (another document's slot). A padding slot's
target is always the ignore index. Every place is named by CP rank and local slot in the zigzag
layout of the flattened stream (rank r keeps chunks r and 2*cp-1-r of every padded span).

Problems are (impact, what), as packer_truth.py's.
"""

from recipe.checks.upstream.libraries.nemo_automodel.packer_truth import (
    EOS_LABEL_OFFSET,
    MISPLACED,
    RAISES,
    Problems,
)

MTP_FIELDS = ("input_ids", "position_ids", "targets", "valid_masks")
MROPE_AXES = 3
MROPE_AXIS_STRIDE = 100_000  # axis a of an M-RoPE position is the position plus a * this


def mtp_options(options: dict) -> dict:
    return {
        "num_depths": options.get("num_depths", 1),
        "ignore_index": options.get("ignore_index", -100),
        "rows": options.get("rows", 1),
        "boundaries": options.get("boundaries", "seq_lens_padded"),
        "positions": options.get("positions", "per_row"),
    }


def mtp_layout(case: dict, options: dict) -> dict:
    """The packed rows of a case: each a list of (document, real length, span), every span a
    multiple of 2*cp, the rows padded to one width by the last document's span (as pack_dataset
    pads a pack); `cu_seqlens_padded` metadata describes one row, so it packs one row."""
    opts = mtp_options(options)
    lengths, cp = case["lengths"], case["cp"]
    unit = 2 * cp
    rows = 1 if opts["boundaries"] == "cu_seqlens_padded" else min(opts["rows"], len(lengths))
    per_row = -(-len(lengths) // rows)
    groups = [list(range(len(lengths)))[r * per_row : (r + 1) * per_row] for r in range(rows)]
    rows_out = [[[i, lengths[i], -(-lengths[i] // unit) * unit] for i in g] for g in groups if g]
    width = max(sum(span for _, _, span in row) for row in rows_out)
    for row in rows_out:
        row[-1][2] += width - sum(span for _, _, span in row)
    return {"rows": rows_out, "width": width}


def mtp_batch(case: dict, options: dict) -> dict:
    """The unsharded batch as plain lists (the reproducer makes tensors of them): input_ids and
    labels [rows][width], positions per the drawn form, and the drawn boundary metadata."""
    opts = mtp_options(options)
    layout = mtp_layout(case, options)
    stride = max(case["lengths"]) + 1
    ids, labels, positions, seq_idx, doc_ids = [], [], [], [], []
    for row in layout["rows"]:
        r_ids, r_labels, r_pos, r_seq, r_doc = [], [], [], [], []
        for k, (i, n, span) in enumerate(row):
            tokens = [1 + stride * i + j for j in range(n)]
            r_ids += tokens + [0] * (span - n)
            r_labels += tokens[1:] + [tokens[-1] + EOS_LABEL_OFFSET]
            r_labels += [opts["ignore_index"]] * (span - n)
            r_pos += list(range(span))
            r_seq += [k + 1] * span
            r_doc += [k + 1] * n + [0] * (span - n)
        ids.append(r_ids)
        labels.append(r_labels)
        positions.append(r_pos)
        seq_idx.append(r_seq)
        doc_ids.append(r_doc)
    batch = {"input_ids": ids, "labels": labels}
    form = opts["positions"]
    if form == "per_row":
        batch["position_ids"] = positions
    elif form == "shared":
        batch["position_ids"] = positions[:1]
    elif form == "mrope":
        batch["position_ids"] = [
            [[p + a * MROPE_AXIS_STRIDE for p in row] for row in positions]
            for a in range(MROPE_AXES)
        ]
    elif form != "none":
        raise ValueError(f"unknown positions form {form!r}")
    boundaries = opts["boundaries"]
    spans = [[span for _, _, span in row] for row in layout["rows"]]
    if boundaries == "seq_lens_padded":
        most = max(len(s) for s in spans)
        batch["seq_lens"] = [
            [n for _, n, _ in row] + [-1000] * (most - len(row)) for row in layout["rows"]
        ]
        batch["seq_lens_padded"] = [s + [-1000] * (most - len(s)) for s in spans]
    elif boundaries == "cu_seqlens_padded":
        cu = [0]
        for span in spans[0]:
            cu.append(cu[-1] + span)
        batch["cu_seqlens_padded"] = cu
    elif boundaries == "seq_idx":
        batch["seq_idx"] = seq_idx
    elif boundaries == "_packed_seq_ids":
        batch["_packed_seq_ids"] = doc_ids
    else:
        raise ValueError(f"unknown boundaries form {boundaries!r}")
    return batch


def _main_positions(batch: dict, form: str, rows: int, width: int):
    """The positions the main model sees at (row, slot), per axis (one axis unless M-RoPE)."""
    if form == "none":
        return [[list(range(width)) for _ in range(rows)]]
    if form == "shared":
        return [[batch["position_ids"][0] for _ in range(rows)]]
    if form == "mrope":
        return batch["position_ids"]
    return [batch["position_ids"]]


def zigzag_places(layout: dict, cp: int) -> dict:
    """(row, slot) -> (rank, local slot) in the zigzag split of the flattened rows."""
    places, local = {}, [0] * cp
    for r, row in enumerate(layout["rows"]):
        start = 0
        for _, _, span in row:
            chunk = span // (2 * cp)
            for rank in range(cp):
                for c in (rank, 2 * cp - 1 - rank):
                    for s in range(start + c * chunk, start + (c + 1) * chunk):
                        places[(r, s)] = (rank, local[rank])
                        local[rank] += 1
            start += span
    return places


def _slots(layout: dict):
    """(row, slot, document, position in it, its real length, its span) of every slot."""
    for r, row in enumerate(layout["rows"]):
        start = 0
        for i, n, span in row:
            for p in range(span):
                yield r, start + p, i, p, n, span
            start += span


def truth_mtp(case: dict, options: dict) -> dict:
    """The outputs of a correct shift (where the contract leaves a value free: 0 / False)."""
    opts = mtp_options(options)
    layout = mtp_layout(case, options)
    batch = mtp_batch(case, options)
    rows, width = len(layout["rows"]), layout["width"]
    main_pos = _main_positions(batch, opts["positions"], rows, width)
    truth = {name: [] for name in MTP_FIELDS}
    for d in range(1, opts["num_depths"] + 1):
        ids = [[0] * width for _ in range(rows)]
        pos = [[[0] * width for _ in range(rows)] for _ in main_pos]
        targets = [[opts["ignore_index"]] * width for _ in range(rows)]
        valid = [[False] * width for _ in range(rows)]
        for r, t, _, p, n, _ in _slots(layout):
            if p + d < n:
                ids[r][t] = batch["input_ids"][r][t + d]
                for a, axis in enumerate(main_pos):
                    pos[a][r][t] = axis[r][t + d]
                targets[r][t] = batch["labels"][r][t + d]
                valid[r][t] = True
        truth["input_ids"].append(ids)
        truth["position_ids"].append(pos if opts["positions"] == "mrope" else pos[0])
        truth["targets"].append(targets)
        truth["valid_masks"].append(valid)
    return truth


def mtp_problems(case: dict, options: dict, outputs: dict) -> list:
    """Every way the shift's output (per field, per depth, [rows][width] lists; positions
    [axes][rows][width] for M-RoPE; or `{"raised": ...}`) breaks the contract: (impact, what)."""
    if "raised" in outputs:
        return [(RAISES, f"raises {outputs['raised']}")]
    opts = mtp_options(options)
    layout = mtp_layout(case, options)
    truth = truth_mtp(case, options)
    places = zigzag_places(layout, case["cp"])
    mrope = opts["positions"] == "mrope"
    found = Problems()

    def wrong(d, r, t, i, p, n, what):
        rank, slot = places[(r, t)]
        at = f"document {i} position {p}" if p < n else f"padding of document {i}"
        found.add(
            MISPLACED,
            f"depth {d}, rank {rank} local slot {slot} (row {r} slot {t}, {at}): {what}",
        )

    for d in range(1, opts["num_depths"] + 1):
        want = {name: truth[name][d - 1] for name in MTP_FIELDS}
        got = {name: outputs[name][d - 1] for name in MTP_FIELDS}
        for r, t, i, p, n, span in _slots(layout):
            place = (d, r, t, i, p, n)
            if got["targets"][r][t] != want["targets"][r][t]:
                why = "" if p + d < n else " (no token of the same document at p + depth)"
                wrong(
                    *place,
                    f"target expected {want['targets'][r][t]}{why}, got {got['targets'][r][t]}",
                )
            if p >= n:
                continue  # a padding slot: only its target counts
            if p + d >= n:
                if p + d >= span and got["valid_masks"][r][t]:
                    wrong(*place, f"valid mask True, but slot {t} + {d} is another document's")
                continue
            if got["input_ids"][r][t] != want["input_ids"][r][t]:
                wrong(
                    *place,
                    f"input_ids expected {want['input_ids'][r][t]}, got {got['input_ids'][r][t]}",
                )
            axes = range(MROPE_AXES) if mrope else [None]
            for a in axes:
                w = want["position_ids"][a][r][t] if mrope else want["position_ids"][r][t]
                g = got["position_ids"][a][r][t] if mrope else got["position_ids"][r][t]
                if g != w:
                    axis = "" if a is None else f" (axis {a})"
                    wrong(*place, f"position_ids{axis} expected {w}, got {g}")
            if not got["valid_masks"][r][t]:
                wrong(*place, "valid mask False: a supervised position's MTP input is masked")
    return found


def call_mtp(module, function_name: str, case: dict, options: dict) -> dict:
    """Run the release's MTP shift on the case's unsharded batch (tensors as the THD collater
    makes them): per field, per depth, nested lists; or `{"raised": ...}`."""
    import torch

    opts = mtp_options(options)
    batch = {}
    for key, value in mtp_batch(case, options).items():
        dtype = torch.int32 if key == "cu_seqlens_padded" else torch.long
        batch[key] = torch.tensor(value, dtype=dtype)
    batch["qkv_format"] = "thd"
    function = getattr(module, function_name)
    try:
        out = function(batch, num_depths=opts["num_depths"], ignore_index=opts["ignore_index"])
        return {name: [t.tolist() for t in getattr(out, name)] for name in MTP_FIELDS}
    except Exception as err:  # noqa: BLE001 (a raise is an outcome the truth judges)
        return {"raised": f"{type(err).__name__}: {err}"}


# What an MTP reproducer ships: these parts' sources, and the constants they read by value.
MTP_SHIPPED = (
    Problems,
    mtp_options,
    mtp_layout,
    mtp_batch,
    _main_positions,
    zigzag_places,
    _slots,
    truth_mtp,
    mtp_problems,
    call_mtp,
)
MTP_CONSTANTS = {
    "RAISES": RAISES,
    "MISPLACED": MISPLACED,
    "EOS_LABEL_OFFSET": EOS_LABEL_OFFSET,
    "MTP_FIELDS": MTP_FIELDS,
    "MROPE_AXES": MROPE_AXES,
    "MROPE_AXIS_STRIDE": MROPE_AXIS_STRIDE,
}
