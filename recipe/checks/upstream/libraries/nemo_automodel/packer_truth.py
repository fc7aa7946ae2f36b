"""The ground truth of NeMo Automodel's packer (`pack_dataset`), written without the library,
and the call of the release's packer on a case; with what mtp_truth.py shares (the impacts, the
end-label offset, `Problems`).

Pure Python (no recipe imports, no `from __future__`): the checker (`targets.py`) imports it,
and every packer reproducer ships `PACKER_SHIPPED` verbatim (`inspect.getsource`) and
`PACKER_CONSTANTS` by value, so the standalone script calls and judges the release exactly as
the checker does.

Packer (`pack_dataset`): documents are packed in input order, next-fit: each document's span is
its length rounded up to f = lcm(2*cp if cp > 1 else 1, pad_to_multiple_of); a document whose
span does not fit the space left closes the pack and opens the next one; a document whose span
exceeds the pack size is dropped (`drop_long_samples=True`) or refused (ValueError); packing stops
once `max_packs` packs are closed. A pack size that is not a multiple of f is refused: the packs
are fixed-length, so their spans (each a multiple of f, the last one absorbing the tail padding)
could not all be multiples of 2*cp. In every pack, each document's tokens sit at consecutive slots
from the start of its span (the cumulative `seq_lens_padded`), with positions 0.. and the
dataset's own labels (the next token, the last one a label of its own; -100 where the sample's
`loss_mask` is 0); `seq_lens` are the real lengths; every padding slot has label -100.

Problems are (impact, what): impact 1 padding only, 2 raises, 3 real tokens misplaced, 4 real
tokens lost (the values of `recipe.checks.assess.Impact`).
"""

import math

PADDING, RAISES, MISPLACED, LOST = 1, 2, 3, 4
IGNORE = -100
# Each document's last label is the id of its last token plus this: unique, never a token.
EOS_LABEL_OFFSET = 1_000_000
# A padding id drawn for the packer that is neither a token nor a label id.
FAR_PADDING_ID = 3_000_017


class Problems(list):
    """(impact, what) pairs, in the order found."""

    def add(self, impact: int, what: str) -> None:
        self.append((impact, what))


def documents(lengths: list[int], loss_mask: bool = False) -> list[dict]:
    """One sample per length: token ids unique over the dataset, labels = the next token (the
    last one a unique end label), and with `loss_mask` a mask of 0 on the first third."""
    stride = max(lengths) + 1
    samples = []
    for i, n in enumerate(lengths):
        ids = [1 + stride * i + j for j in range(n)]
        sample = {"input_ids": ids, "labels": ids[1:] + [ids[-1] + EOS_LABEL_OFFSET]}
        if loss_mask:
            sample["loss_mask"] = [0 if j < n // 3 else 1 for j in range(n)]
        samples.append(sample)
    return samples


def packer_options(options: dict) -> dict:
    """pack_dataset's options with their defaults filled in."""
    return {
        "max_packs": options.get("max_packs"),
        "padding_idx": options.get("padding_idx", 0),
        "drop_long_samples": options.get("drop_long_samples", True),
        "pad_to_multiple_of": options.get("pad_to_multiple_of", 1),
    }


def alignment(cp: int, pad_to_multiple_of: int) -> int:
    return math.lcm(2 * cp if cp > 1 else 1, pad_to_multiple_of)


def expected_packing(lengths: list[int], cp: int, size: int, options: dict):
    """(packs as lists of document indices, the refusal or None). The packs are those a correct
    packer builds; with a refusal, those it would build if it went on anyway."""
    opts = packer_options(options)
    multiple = opts["pad_to_multiple_of"]
    if multiple < 1 or size % multiple:
        return [], f"packed_sequence_size {size} is not a multiple of pad_to_multiple_of {multiple}"
    unit = alignment(cp, multiple)
    refusal = None
    if size % unit:
        refusal = (
            f"packed_sequence_size {size} is not a multiple of lcm(2*cp, pad_to_multiple_of) = "
            f"{unit}: fixed-length packs cannot keep every document span a multiple of 2*cp"
        )
    packs, current, used = [], [], 0
    for i, n in enumerate(lengths):
        span = -(-n // unit) * unit
        if span > size:
            if not opts["drop_long_samples"]:
                refusal = refusal or f"document {i} spans {span} > packed_sequence_size {size}"
                break
            continue
        if used + span > size:
            packs.append(current)
            current, used = [i], span
            if opts["max_packs"] is not None and len(packs) >= opts["max_packs"]:
                current = []
                break
        else:
            current.append(i)
            used += span
    if current and (opts["max_packs"] is None or len(packs) < opts["max_packs"]):
        packs.append(current)
    if not packs:
        refusal = refusal or "no document fits a pack"
    return packs, refusal


def _masked_labels(sample: dict) -> list[int]:
    mask = sample.get("loss_mask") or [1] * len(sample["labels"])
    return [label if keep else IGNORE for label, keep in zip(sample["labels"], mask)]


def truth_packs(case: dict, options: dict) -> dict:
    """What a correct packer returns on this case (the reproducer's output structure)."""
    lengths, cp, size = case["lengths"], case["cp"], case["pack_size"]
    packs, refusal = expected_packing(lengths, cp, size, options)
    if refusal is not None:
        return {"raised": f"ValueError: {refusal}"}
    opts = packer_options(options)
    samples = documents(lengths, options.get("loss_mask", False))
    unit = alignment(cp, opts["pad_to_multiple_of"])
    out = []
    for pack in packs:
        ids, labels, positions, spans = [], [], [], []
        for i in pack:
            n = len(samples[i]["input_ids"])
            span = -(-n // unit) * unit
            ids += samples[i]["input_ids"] + [opts["padding_idx"]] * (span - n)
            labels += _masked_labels(samples[i]) + [IGNORE] * (span - n)
            positions += list(range(span))
            spans.append(span)
        tail = size - len(ids)
        spans[-1] += tail
        out.append(
            {
                "input_ids": ids + [opts["padding_idx"]] * tail,
                "labels": labels + [IGNORE] * tail,
                "position_ids": positions
                + list(range(positions[-1] + 1, positions[-1] + 1 + tail)),
                "seq_lens": [len(samples[i]["input_ids"]) for i in pack],
                "seq_lens_padded": spans,
            }
        )
    return {"packs": out}


def pack_problems(case: dict, options: dict, outputs: dict) -> list:
    """Every way the packer's output (`{"packs": [...]}` or `{"raised": ...}`) breaks the
    contract on this case, as (impact, what), in the order found."""
    lengths, cp, size = case["lengths"], case["cp"], case["pack_size"]
    packs, refusal = expected_packing(lengths, cp, size, options)
    if "raised" in outputs:
        if refusal is not None:
            return []  # it refuses an input a correct packer refuses too
        return [(RAISES, f"raises {outputs['raised']}")]
    samples = documents(lengths, options.get("loss_mask", False))
    labelled = [_masked_labels(sample) for sample in samples]
    expected = {i for pack in packs for i in pack}
    where = {}  # token id -> (document, position)
    for i, sample in enumerate(samples):
        for j, token in enumerate(sample["input_ids"]):
            where[token] = (i, j)
    found = Problems()
    seen = {}  # token -> [(pack, slot)]
    for k, pack in enumerate(outputs["packs"]):
        ids, labels, positions = pack["input_ids"], pack["labels"], pack["position_ids"]
        if not len(ids) == len(labels) == len(positions) == size:
            found.add(
                MISPLACED,
                f"pack {k} holds {len(ids)} input_ids, {len(labels)} labels, "
                f"{len(positions)} position_ids; the pack size is {size}",
            )
            continue
        for s, token in enumerate(ids):
            if token not in where:
                if labels[s] != IGNORE:
                    found.add(
                        MISPLACED,
                        f"pack {k} slot {s}: a padding slot (token {token}) "
                        f"has label {labels[s]}: padding trains",
                    )
                continue
            seen.setdefault(token, []).append((k, s))
            i, j = where[token]
            want = {"position_ids": j, "labels": labelled[i][j]}
            got = {"position_ids": positions[s], "labels": labels[s]}
            for name in want:
                if want[name] != got[name]:
                    found.add(
                        MISPLACED,
                        f"pack {k} slot {s} (document {i}, position {j}): "
                        f"{name} expected {want[name]}, got {got[name]}",
                    )
    for i in sorted(expected):
        missing = [j for j, t in enumerate(samples[i]["input_ids"]) if t not in seen]
        if missing:
            found.add(
                LOST,
                f"document {i} (length {lengths[i]}): {len(missing)} real tokens "
                f"in no pack (positions {missing[:6]}{' ...' if len(missing) > 6 else ''})"
                ": they never train",
            )
    for token, places in seen.items():
        if len(places) > 1:
            i, j = where[token]
            found.add(
                MISPLACED,
                f"document {i} position {j} is in {len(places)} places "
                f"{places[:3]}: it trains {len(places)} times",
            )
    found += _document_layout_problems(samples, outputs["packs"], seen, cp)
    for i in sorted(set(range(len(samples))) - expected):
        tokens = [t for t in samples[i]["input_ids"] if t in seen]
        if tokens:
            k, s = seen[tokens[0]][0]
            found.add(
                MISPLACED,
                f"document {i} (length {lengths[i]}) should not be packed "
                f"(its span does not fit, or it comes after max_packs packs) but "
                f"{len(tokens)} of its tokens are in packs, the first at pack {k} "
                f"slot {s}",
            )
    if refusal is not None and not found:
        found.append((PADDING, f"does not refuse: {refusal}"))
    return found


def _document_layout_problems(samples: list[dict], packs: list[dict], seen: dict, cp: int):
    """Each document whole in one pack, at the start of its span, with its real length; the
    spans covering the pack; and (padding only) each span a multiple of 2*cp."""
    found, starts = Problems(), {}  # starts: pack -> [(first slot, document)]
    for i, sample in enumerate(samples):
        places = [seen[t][0] for t in sample["input_ids"] if t in seen]
        if not places:
            continue
        in_packs = sorted({k for k, _ in places})
        if len(in_packs) > 1:
            found.add(
                MISPLACED,
                f"document {i} (length {len(sample['input_ids'])}) is split "
                f"across packs {in_packs}",
            )
            continue
        slots = [s for _, s in places]
        if slots != list(range(slots[0], slots[0] + len(slots))):
            found.add(
                MISPLACED,
                f"document {i}'s tokens are not at consecutive slots of "
                f"pack {in_packs[0]}: {slots[:8]}",
            )
            continue
        starts.setdefault(in_packs[0], []).append((slots[0], i))
    for k, pack in enumerate(packs):
        docs = sorted(starts.get(k, []))
        real = [n for n in pack["seq_lens"] if n >= 0]
        spans = [n for n in pack["seq_lens_padded"] if n >= 0]
        cu = [0]
        for span in spans:
            cu.append(cu[-1] + span)
        want_real = [len(samples[i]["input_ids"]) for _, i in docs]
        if real != want_real or len(spans) != len(docs):
            found.add(
                MISPLACED,
                f"pack {k}: seq_lens {real}, seq_lens_padded {spans}; its "
                f"documents {[i for _, i in docs]} have lengths {want_real}: the "
                "attention boundaries are not the documents'",
            )
            continue
        for (start, i), span_start, span, n in zip(docs, cu, spans, real):
            if start != span_start or span < n:
                found.add(
                    MISPLACED,
                    f"pack {k}: document {i} starts at slot {start}, its "
                    f"span [{span_start}, {span_start + span}) by seq_lens_padded "
                    f"{spans}: the attention boundaries are not the documents'",
                )
        if cu[-1] != len(pack["input_ids"]):
            found.add(
                MISPLACED,
                f"pack {k}: seq_lens_padded {spans} sum to {cu[-1]}, the "
                f"pack holds {len(pack['input_ids'])} slots",
            )
        for (_, i), span in zip(docs, spans):
            if cp > 1 and span % (2 * cp):
                found.add(
                    PADDING,
                    f"pack {k}: document {i}'s padded span {span} (seq_lens_"
                    f"padded {spans}) is not a multiple of 2*cp={2 * cp}: zigzag CP "
                    "cannot split it (its real tokens are placed right)",
                )
    return found


# ---------------------------------------------------------------- calling the release

PACKER_OPTIONS = ("max_packs", "padding_idx", "drop_long_samples", "pad_to_multiple_of")


def call_packer(module, function_name: str, case: dict, options: dict) -> dict:
    """Run the release's packer on the case's documents, as its loader does (an HF Dataset; or
    a list of dicts, which its signature accepts too): `{"packs": [...]}` or `{"raised": ...}`."""
    samples = documents(case["lengths"], options.get("loss_mask", False))
    if options.get("input_form", "hf_dataset") == "hf_dataset":
        dataset = module.Dataset.from_list(samples)
    else:
        dataset = [dict(sample) for sample in samples]
    kwargs = {name: options[name] for name in PACKER_OPTIONS if name in options}
    function = getattr(module, function_name)
    try:
        out = function(dataset, None, case["pack_size"], cp_size=case["cp"], **kwargs)
    except Exception as err:  # noqa: BLE001 (a raise is an outcome the truth judges)
        return {"raised": f"{type(err).__name__}: {err}"}
    columns = out.to_dict()
    return {"packs": [{key: columns[key][j] for key in columns} for j in range(len(out))]}


# What a packer reproducer ships: these parts' sources, and the constants they read by value.
PACKER_SHIPPED = (
    Problems,
    documents,
    packer_options,
    alignment,
    expected_packing,
    _masked_labels,
    truth_packs,
    pack_problems,
    _document_layout_problems,
    call_packer,
)
PACKER_CONSTANTS = {
    "PADDING": PADDING,
    "RAISES": RAISES,
    "MISPLACED": MISPLACED,
    "LOST": LOST,
    "IGNORE": IGNORE,
    "EOS_LABEL_OFFSET": EOS_LABEL_OFFSET,
    "PACKER_OPTIONS": PACKER_OPTIONS,
}
