"""axolotl's collator-side CP split, `shard_collated_batch` of axolotl-ringmaster
(`ringmaster/shard.py:275`), checked on a packed row of several documents.

axolotl 0.21.0 installs it as `DataCollatorForSeq2Seq.cp_shard` (`axolotl/integrations/
context_parallel/collator.py:14-36`, load_balance = the runtime's `shard_load_balance`, only
"contiguous" or "head_tail"), applied to the padded batch at the end of the collator
(`axolotl/utils/collators/batching.py:135-137`). Each rank cuts its own shard of the same global
batch: `prepare_global_batch` (shard.py:222-272) derives per-document position_ids from a
segment-numbered attention_mask (:246-251) or from cu_seqlens (:253-269) when none are given;
`_ensure_global_shift_labels` (:120-127) builds `shift_labels[:, :-1] = labels[:, 1:]` over the
whole row before the split; `_pad_to` (:130-147) pads the row to a multiple of cp (contiguous) or
2*cp (head_tail), labels -100; contiguous is `chunk(cp)[rank]` of the padded row (:217), head_tail
the chunks r and 2cp-1-r of 2cp chunks of the WHOLE row (:165-175); `varlen_meta` (:57-76) puts
the global document boundaries (the padding a segment of its own) in `_cp_shard["varlen"]`.
The model's loss reads `shift_labels` (ringmaster/sp_context.py:142-143 counts the loss's tokens
from them; that HF's causal-LM loss uses them in place of `labels` when given is not verified
here), so a token's label is its `shift_labels` entry.

Ground truth, in the layout the function documents (neither is per-document zigzag): the padded
row split contiguously, or the whole-row zigzag; every real token on exactly one rank, with its
position within its own document, its label the next token of its own document (the last token
of each document: -100, never the next document's first token); padding never weighted (-100);
`_cp_shard["varlen"]` on every rank: [each document's start, (the padding's start), the row's
padded length] and its maximum; None is right only for one document (plain causal attention).

Options (each drawn, fixed with its reason, or refusing the check, `releases.partition_options`):
- `load_balance`: drawn ("contiguous", the signature's default; "head_tail"); "none" is the
  same layout as contiguous (:301) and axolotl never passes it (collator.py:25).
- `batch`: fixed: one packed row of the drawn documents, padded as the collator pads it before
  the call (the function then pads on to its own multiple). Input options, drawn:
  - `pad_to_multiple_of`: 64 (the default: axolotl's collator when pad_to_sequence_len is unset,
    `axolotl/core/builders/causal.py:393-401`; its padding is token 0, mask 0, label -100,
    positions 0, 1, .. (batching.py:85-98), a segment of its own in cu_seqlens) or 1 (none);
  - `boundaries`: "position_ids" (the default: axolotl's multipack collator,
    `V2BatchSamplerDataCollatorForSeq2Seq`, batching.py:212-248, concatenates each sample's
    position_ids and numbers the mask by sample), "segment_mask" (the mask only: positions from
    shard.py:246-251) or "cu_seqlens" (no mask: positions from shard.py:253-269);
  - `labels`: "as_given" (the default: labels equal input_ids, as axolotl's completion datasets
    give them, `axolotl/prompt_tokenizers.py:104` `result["labels"] = result["input_ids"].copy()`,
    concatenated unchanged by batching.py:244-248; pretraining datasets likely too, unverified)
    or "separator" (-100 at each document's first label, as a chat template with
    train_on_inputs=False masks the prompt, or HF's DataCollatorWithFlattening with
    separator_id=-100). Which one axolotl's default path gives depends on the dataset type and
    prompt strategy: that every strategy with train_on_inputs=False starts a sample's labels
    with -100 is NOT verified.
- `cp_rank`, `cp_size`: fixed: every rank of the drawn cp (2, 4, 8), one process playing each;
  tp is no input (tp=1).
Stubs: only the module's own name while it runs (its `@dataclass ShardInfo`, :14, reads
`sys.modules[__name__]`, which a private load does not set); shard.py imports torch only (its
`ringmaster.runtime` import, :195, runs only for load_balance None, which shard_collated_batch
never passes).

Impact: a real token on no rank -> lost; a wrong token, position, label or loss weight on a real
token, padding weighted, or a wrong `varlen` (the attention's document boundaries) -> misplaced;
a raise -> raises. Negative control (one line): `shift[:, :-1] = labels[:, :-1]` at :126 (each
token labelled with itself), flagged with labels "separator", where the release passes.

Finding in 0.2.7 (tests/test_upstream_axolotl_ringmaster.py): real tokens misplaced at the
defaults: shard.py:125-126 shift the labels over the whole packed row, so the last token of each
document gets the next document's first token as its label (lengths=[1, 1] cp=2: rank 0, local
slot 0 gets label 3, document 1's token, not -100), in both layouts and from all three boundary
inputs; with labels "separator" every case passes. axolotl without CP hands the same row to HF's
loss, which shifts it the same way (not verified here).
"""

from __future__ import annotations

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import Finding, Library
from recipe.checks.upstream.kit.module_checked import (
    ModuleChecked,
    ModuleTarget,
    lost_tokens,
    slot_problems,
)
from recipe.data.packing import pack_sequences
from recipe.parallel.cp.contract import PAD_ID, unique_sequences
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import partition_options
from recipe.upstream.source import load_module

FILE = "ringmaster/shard.py"
FUNCTION = "shard_collated_batch"
DEFAULTS = {"load_balance": "contiguous", "boundaries": "position_ids", "labels": "as_given",
            "pad_to_multiple_of": 64}  # fmt: skip
DRAWN = {"load_balance": ("contiguous", "head_tail")}
INPUT = {"boundaries": ("position_ids", "segment_mask", "cu_seqlens"),
         "labels": ("as_given", "separator"), "pad_to_multiple_of": (64, 1)}  # fmt: skip
FIXED = {
    "batch": "one packed row of the drawn documents (input_ids, labels, and the boundaries as "
    "the input option `boundaries` gives them), padded as axolotl's collator pads it",
    "cp_rank": "every rank of the drawn cp, one process playing each",
    "cp_size": "the drawn cp (2, 4, 8)",
}
CONTROL = "shift[:, :-1] = labels[:, 1:]"  # the negative control labels each token with itself
CONTROL_NAMES = ("_ensure_global_shift_labels", "_zigzag_shard", "shard_batch", FUNCTION)
# What each case does besides the call, printed under the check's header.
NOTES = (
    "one packed row of the drawn documents, every rank; the label is shift_labels (what "
    "the model's loss reads); the layout is the function's own (contiguous chunks of the "
    "padded row, or head_tail over the whole row)",
    "boundaries: position_ids = axolotl's multipack (positions + segment-numbered mask); "
    "labels: as_given = labels equal input_ids, separator = -100 at each document start",
)


# ---- The row, the call and the check: plain Python and torch, carried by the reproducer.


def packed_row(lengths, boundaries, labels, multiple):
    """The collated batch of one packed row: document i's tokens 1 + (max+1)*i + p, its labels
    the tokens ("as_given") or -100 first ("separator"), its boundaries as `boundaries` says;
    right-padded to a `multiple` as axolotl's collator pads (token 0, mask 0, label -100,
    positions 0, 1, ..: batching.py:85-98), the padding a segment of its own in cu_seqlens."""
    import torch

    stride, ids, positions, segments, targets, cu = max(lengths) + 1, [], [], [], [], [0]
    for i, n in enumerate(lengths):
        tokens = [1 + stride * i + p for p in range(n)]
        ids, positions, segments = ids + tokens, positions + list(range(n)), segments + [i + 1] * n
        targets += [-100] + tokens[1:] if labels == "separator" else tokens
        cu.append(cu[-1] + n)
    pad = -cu[-1] % multiple
    ids, positions, segments = ids + [0] * pad, positions + list(range(pad)), segments + [0] * pad
    targets, cu = targets + [-100] * pad, cu + [cu[-1] + pad] * (pad > 0)
    batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([targets])}
    if boundaries == "position_ids":  # axolotl's multipack collator gives both
        batch["position_ids"] = torch.tensor([positions])
    if boundaries in ("position_ids", "segment_mask"):
        batch["attention_mask"] = torch.tensor([segments])
    if boundaries == "cu_seqlens":
        batch["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    return batch


def call_outputs(function, lengths, cp, options):
    """Every rank's shard, JSON-able: tokens, positions, shift_labels and `varlen`; or the raise."""
    ranks = []
    for rank in range(cp):
        try:
            batch = packed_row(lengths, options["boundaries"], options["labels"],
                               options["pad_to_multiple_of"])  # fmt: skip
            out = function(batch, cp_rank=rank, cp_size=cp, load_balance=options["load_balance"])
            varlen = (out.get("_cp_shard") or {}).get("varlen")
            ranks.append({name: out[name][0].tolist() if name in out else None
                          for name in ("input_ids", "position_ids", "shift_labels")})  # fmt: skip
            ranks[-1]["varlen"] = None if varlen is None else [list(varlen[0]), int(varlen[1])]
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is what is reported)
            return {"ranks": ranks, "error": f"rank {rank} raises {type(err).__name__}: {err}"}
    return {"ranks": ranks, "error": None}


def global_slot(layout, cp, width, rank, slot):
    """The slot of the padded row that local `slot` of `rank` holds: contiguous = chunk(cp)[rank]
    of the row; head_tail = chunks rank and 2*cp-1-rank of 2*cp chunks of the whole row."""
    if layout == "head_tail":
        half = width // 2
        return (rank if slot < half else 2 * cp - 1 - rank) * half + slot % half
    return rank * width + slot


def shard_problems(outputs, lengths, cp, layout):
    """(level, message) per problem: 4 = a real token on no rank, 3 = a real token with a wrong
    token, position or label, padding with a label, or a wrong varlen; 2 = a raise."""
    if outputs["error"]:
        return [(2, outputs["error"])]
    stride, starts = max(lengths) + 1, [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    real, ranks = starts[-1], outputs["ranks"]
    tokens = {1 + stride * i + p for i, n in enumerate(lengths) for p in range(n)}
    lost = lost_tokens(tokens, {t for got in ranks for t in got["input_ids"] or []}, stride)
    if lost:
        return lost
    widths = {len(got[name] or []) for got in ranks for name in ("input_ids", "position_ids",
                                                                 "shift_labels")}  # fmt: skip
    width = widths.pop()
    unit = 2 * cp if layout == "head_tail" else cp
    if widths or width * cp < real or (width * cp) % unit:
        return [(3, f"the ranks hold {sorted(widths | {width})} slots of each field: not a "
                    f"{layout} split of a row padded to a multiple of {unit}")]  # fmt: skip
    total, found = width * cp, []
    for rank, got in enumerate(ranks):
        for slot in range(width):
            g = global_slot(layout, cp, width, rank, slot)
            where = f"rank {rank}, local slot {slot}"
            found += slot_problems(got, slot, g, where, lengths, stride, tokens)
    for rank, got in enumerate(ranks):  # the documents' starts, then any split of the padding
        cu, top = got["varlen"] or [[], 0]
        tail = cu[len(lengths) :]
        if (got["varlen"] is None and len(lengths) == 1) or (
            cu[: len(lengths)] == starts[:-1] and tail and tail == sorted(set(tail))
            and tail[0] >= real and tail[-1] == total
            and top == max(b - a for a, b in zip(cu, cu[1:]))
        ):  # fmt: skip
            continue
        found.append((3, f"rank {rank}: varlen {got['varlen']}, expected the documents' starts "
                         f"{starts[:-1]}, the padding's and {total}: the attention's document "
                         "boundaries are wrong"))  # fmt: skip
    return found


def released_outputs(wheel, case, options):
    """Every rank's shard from the release in `wheel`, on the case."""
    # its @dataclass reads the module's own entry in sys.modules: a placeholder while it runs
    module = load_from_wheel(wheel, FILE, {"released_shard": {}})
    return call_outputs(getattr(module, FUNCTION), case["lengths"], case["cp"], options)


def released_problems(outputs, case, options):
    found = shard_problems(outputs, case["lengths"], case["cp"], options["load_balance"])
    return [message for _, message in found][:12]


def signature_options(function, label: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """(drawn, fixed) for the signature, then the input options; an unknown option refuses."""
    drawn, skipped = partition_options(function, label, __name__, FIXED, DRAWN)
    return {**drawn, **INPUT}, skipped


class ShardChecked(ModuleChecked):
    """`shard_collated_batch` of one release, loaded. Its cases: (lengths, cp, 1), the
    checker's micro-batches as one packed row; tp is no input."""

    function_name = FUNCTION
    size_name = "cp"
    case_rest = (1,)
    defaults = DEFAULTS
    shipped = (packed_row, call_outputs, global_slot, lost_tokens, slot_problems, shard_problems,
               released_outputs, released_problems)  # fmt: skip
    title = f"every rank's shard of one packed row ({FILE})"

    def case_problems(self, lengths, cp, chosen):
        outputs = call_outputs(self.function, lengths, cp, chosen)
        return None, shard_problems(outputs, lengths, cp, chosen["load_balance"])

    def broken_module(self):
        """Each token labelled with itself (:126), the callers re-executed to call the copy."""
        return layouts.mutated_copy(
            self.module, CONTROL_NAMES, CONTROL_NAMES[0], CONTROL,
            "shift[:, :-1] = labels[:, :-1]", self.label,
        )  # fmt: skip

    def shipped_constants(self) -> dict:
        return {"FILE": FILE, "FUNCTION": FUNCTION}

    def truth_outputs(self, finding: Finding) -> dict:
        """The right shards from the recipe's own packing (`pack_sequences`, documents back to
        back) and zigzag index (one segment: the whole padded row)."""
        lengths, cp = finding.case["lengths"], finding.case["cp"]
        layout = self.chosen_options(dict(finding.options))["load_balance"]
        batch = pack_sequences(unique_sequences(lengths), 1, PAD_ID)
        real = int(batch.cu_seqlens[-1])
        multiple = self.chosen_options(dict(finding.options))["pad_to_multiple_of"]
        unit = 2 * cp if layout == "head_tail" else cp
        collated = -(-real // multiple) * multiple  # the collator's padding, then the function's
        total = -(-collated // unit) * unit
        pad = total - real
        fields = {
            "input_ids": torch.cat([batch.input_ids, torch.full((pad,), PAD_ID)]),
            "position_ids": torch.cat([batch.position_ids, torch.arange(pad)]),
            "shift_labels": torch.cat(
                [torch.where(batch.loss_mask > 0, batch.labels, -100), torch.full((pad,), -100)]
            ),  # fmt: skip
        }
        cu = batch.cu_seqlens.tolist() + ([total] if pad else [])
        varlen = None if len(lengths) == 1 else [cu, max(b - a for a, b in zip(cu, cu[1:]))]
        ranks = []
        for rank in range(cp):
            if layout == "head_tail":
                index = zigzag_index(torch.tensor([0, total]), cp, rank)
            else:
                index = torch.arange(rank * total // cp, (rank + 1) * total // cp)
            ranks.append({k: v.index_select(0, index).tolist() for k, v in fields.items()})
            ranks[-1]["varlen"] = varlen
        return {"ranks": ranks, "error": None}


def load_release(path, library: str, version: str):
    name = f"recipe_upstream_{library}_{version}_shard".replace(".", "_").replace("-", "_")
    return load_module(path, name, {name: {}})  # its @dataclass reads sys.modules[name]


TARGET = ModuleTarget(FUNCTION, FILE, ShardChecked, NOTES, load_release, signature_options)
TARGETS = (TARGET,)
LIBRARY = Library("axolotl-ringmaster", TARGETS, releases=("0.2.7",))
