"""DeepSpeed's Ulysses/ALST data adapter, `UlyssesSPDataLoaderAdapter`
(`deepspeed/runtime/sequence_parallel/ulysses_sp.py:571`), checked on packed rows of several
documents.

0.19.8 is on PyPI as an sdist only (lines are its files'). The adapter wraps each SP rank's
dataloader (`__init__`, :573-639). `refill` (:651-727) takes one batch from this rank's
dataloader, requires `position_ids` in it (ValueError, :666-671), all-gathers the sequence
lengths (:676-679) and every tensor of the batch (:681-692; non-tensors with all_gather_object,
:694-695) from all SP ranks, then for each gathered batch j (one per rank): raises ValueError
when its length does not divide by the SP size (:706-707), pops `labels`, pads them with one
-100 and sets `shift_labels = labels[..., 1:]` over the WHOLE row (:712-714), and keeps the
contiguous chunk `[:, chunk_len*rank : chunk_len*(rank+1)]` of every tensor (:724). So rank r
yields sp micro-batches, the j-th being chunk r of rank j's batch. No cu_seqlens are produced:
documents are marked only by the position_ids resets. A batch with `shift_labels` but no
`labels` raises KeyError at :712; the docstring names `labels` as a required key (:611-614), so
the check always passes `labels`.

Ground truth: each rank's j-th micro-batch is the contiguous chunk r of rank j's row; every real
token of each row is on exactly one rank, with its position within its own document, its label
(`shift_labels`) the next token of its own document (each document's last token: -100, never the
next document's first token); padding (the collator's, or any a right implementation adds to
reach a multiple of sp) has label -100.

Options (`releases.partition_options`): the constructor's are all fixed (FIXED says why). Input
options, drawn:
- `labels`: "as_given" (labels = input_ids, a plain packed dataset) or "separator" (-100 at each
  document's first label, as HF's `DataCollatorWithFlattening` gives by default, separator_id
  -100; which one ALST's own pipelines give is not verified).
- `pad_to_multiple_of`: "sp" (the collator pads the row to a multiple of the SP size: token 0,
  label -100, positions 0, 1, ..) or 1 (no padding, as `DataCollatorWithFlattening` gives). The
  adapter does not document that the length must divide by sp (its docstring, :575-620, says
  nothing of it): it raises at :706-707, so an unpadded row of such a length is a raise.
Each rank's dataloader is a one-batch list (the adapter calls only `iter` and `len` on it):
rank j's row holds the documents j*n .. j*n+n-1 (token ids unique over all rows).

Stubs: `deepspeed.sequence.layer` and `deepspeed.utils.logging` (:35-36, used by the attention
class only), `deepspeed.comm` (:43) and `einops` (:37, not installed here). `import
deepspeed.comm as dist` reads the `comm` attribute of the `deepspeed` stub, set to a stand-in
whose `all_gather`/`all_gather_object` hand back every rank's tensor, the group argument
carrying the ranks' batches (one process plays every rank).

Impact: a real token on no rank -> lost; a wrong token, position or label on a real token, or
padding with a label -> misplaced; a raise -> raises. Negative control (one line):
`labels[..., :-1]` for `labels[..., 1:]` at :714 (each token labelled with itself), flagged with
labels "separator", where the release passes.

Findings in 0.19.8 (tests/test_upstream_deepspeed_ulysses.py): real tokens misplaced at the
defaults: :713-714 shift the labels over the whole packed row before the split, so each
document's last token gets the next document's first token as its label (lengths=[1, 1] sp=2);
with labels "separator" every padded case passes. Unpadded rows whose length sp does not divide
raise ValueError at :706-707 (lengths=[1] sp=2).
"""

from __future__ import annotations

import contextlib
import inspect
import sys

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
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import partition_options
from recipe.upstream.source import load_module

FILE = "deepspeed/runtime/sequence_parallel/ulysses_sp.py"
CLASS = "UlyssesSPDataLoaderAdapter"
STUBS = ("deepspeed", "deepspeed.comm", "deepspeed.sequence", "deepspeed.sequence.layer",
         "deepspeed.utils", "deepspeed.utils.logging", "einops")  # fmt: skip
DEFAULTS = {"labels": "as_given", "pad_to_multiple_of": "sp"}
INPUT = {"labels": ("as_given", "separator"), "pad_to_multiple_of": ("sp", 1)}
FIXED = {
    "dl": "a one-batch list per rank: that rank's packed row (input_ids, labels, position_ids)",
    "sp_rank": "every rank of the drawn sp, one process playing each",
    "sp_group": "a stand-in carrying every rank's batch for the all-gather stand-in",
    "sp_world_size": "the drawn sp (2, 4, 8)",
    "device": '"cpu"',
}
CONTROL = 'batch["shift_labels"] = labels[..., 1:].contiguous()'
# What each case does besides the call, printed under the check's header.
NOTES = (
    "packed rows, one per SP rank (its one-batch dataloader), every rank; the label is "
    "shift_labels (the adapter pops labels); the layout is contiguous chunks of each row",
    "labels: as_given = labels equal input_ids, separator = -100 at each document start; "
    "pad_to_multiple_of: sp = the collator pads each row to a multiple of sp, 1 = none",
)


# ---- The rows, the call and the check: plain Python and torch, carried by the reproducer.


def packed_row(lengths, row, labels, multiple):
    """Rank `row`'s batch: documents row*n+i (tokens 1 + (max+1)*(row*n+i) + p) packed back to
    back, per-document position_ids, labels the tokens ("as_given") or -100 first ("separator");
    right-padded to a `multiple` (token 0, label -100, positions 0, 1, ..)."""
    import torch

    stride, ids, positions, targets = max(lengths) + 1, [], [], []
    for i, n in enumerate(lengths):
        tokens = [1 + stride * (row * len(lengths) + i) + p for p in range(n)]
        ids, positions = ids + tokens, positions + list(range(n))
        targets += [-100] + tokens[1:] if labels == "separator" else tokens
    pad = -len(ids) % multiple
    ids, positions, targets = ids + [0] * pad, positions + list(range(pad)), targets + [-100] * pad
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([targets]),
            "position_ids": torch.tensor([positions])}  # fmt: skip


class RanksGroup:
    """The SP group as one process playing `rank` sees it: the all-gathers (the lengths first,
    then each key of the batch in its order, :678, :692, :695) hand back every rank's value."""

    def __init__(self, rows, rank):
        self.rows, self.keys = rows, ["seqlen", *rows[rank]]

    def gather(self, outputs, is_tensor):
        import torch

        key = self.keys.pop(0)
        for i, row in enumerate(self.rows):
            if key == "seqlen":
                outputs[i].copy_(torch.tensor([row["input_ids"].shape[1]]))
            elif is_tensor:
                outputs[i].copy_(row[key])
            else:
                outputs[i] = row[key]


class Collectives:
    """The module's `dist` (deepspeed.comm): the group stand-in plays each collective."""

    ProcessGroup = object  # an annotation of the attention class (:98)

    @staticmethod
    def all_gather(outputs, tensor, group=None):
        group.gather(outputs, True)

    @staticmethod
    def all_gather_object(outputs, value, group=None):
        group.gather(outputs, False)


def release_stubs():
    """The stubs the file loads with (the docstring's): `deepspeed.comm` is `Collectives`."""
    return {name: {"comm": Collectives} if name == "deepspeed" else {} for name in STUBS}


def call_outputs(module, lengths, sp, options):
    """Every rank's micro-batches (JSON-able: tokens, positions, shift_labels), or the raise."""
    module.dist = Collectives
    multiple = sp if options["pad_to_multiple_of"] == "sp" else options["pad_to_multiple_of"]
    ranks = []
    for rank in range(sp):
        rows = [packed_row(lengths, j, options["labels"], multiple) for j in range(sp)]
        try:
            adapter = module.UlyssesSPDataLoaderAdapter([rows[rank]], sp_rank=rank,
                                                        sp_group=RanksGroup(rows, rank),
                                                        sp_world_size=sp, device="cpu")  # fmt: skip
            ranks.append([{name: out[name][0].tolist() if name in out else None
                           for name in ("input_ids", "position_ids", "shift_labels")}
                          for out in adapter])  # fmt: skip
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is what is reported)
            return {"ranks": ranks, "error": f"rank {rank} raises {type(err).__name__}: {err}"}
    return {"ranks": ranks, "error": None}


def shard_problems(outputs, lengths, sp):
    """(level, message) per problem: 4 = a real token on no rank, 3 = a real token with a wrong
    token, position or label, padding with a label, or not a contiguous split; 2 = a raise."""
    if outputs["error"]:
        return [(2, outputs["error"])]
    stride, n, starts = max(lengths) + 1, len(lengths), [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    real, ranks, found = starts[-1], outputs["ranks"], []
    if any(len(batches) != sp for batches in ranks):
        return [(3, f"the ranks yield {[len(b) for b in ranks]} micro-batches, not {sp} each")]
    tokens = {1 + stride * (j * n + i) + p for j in range(sp) for i, m in enumerate(lengths)
              for p in range(m)}  # fmt: skip
    present = {t for batches in ranks for got in batches for t in got["input_ids"] or []}
    lost = lost_tokens(tokens, present, stride)
    if lost:
        return lost
    widths = {len(got[k] or []) for b in ranks for got in b for k in ("input_ids", "position_ids",
                                                                      "shift_labels")}  # fmt: skip
    width = widths.pop()
    if widths or width * sp < real:
        return [(3, f"the ranks hold {sorted(widths | {width})} slots of each field: not a "
                    f"contiguous split of a {real}-token row over {sp} ranks")]  # fmt: skip
    for rank, batches in enumerate(ranks):
        for j, got in enumerate(batches):
            for slot in range(width):
                where = f"rank {rank}, micro-batch {j}, local slot {slot}"
                found += slot_problems(got, slot, rank * width + slot, where, lengths, stride,
                                       tokens, j * n)  # fmt: skip
    return found


def released_outputs(wheel, case, options):
    """Every rank's micro-batches from the release in `wheel`, on the case."""
    module = load_from_wheel(wheel, FILE, release_stubs())
    return call_outputs(module, case["lengths"], case["sp"], options)


def released_problems(outputs, case, options):
    return [message for _, message in shard_problems(outputs, case["lengths"], case["sp"])][:12]


def signature_options(function, label: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """(drawn, fixed) for the constructor, then the input options; an unknown one refuses."""
    drawn, skipped = partition_options(function, label, __name__, FIXED, {})
    return {**drawn, **INPUT}, skipped


@contextlib.contextmanager
def registered(module):
    """`module` in sys.modules while `inspect` reads its class's source (a class's file is its
    module's, looked up there; the private load is not registered)."""
    before = sys.modules.get(module.__name__)
    sys.modules[module.__name__] = module
    try:
        yield
    finally:
        if before is None:
            sys.modules.pop(module.__name__, None)
        else:
            sys.modules[module.__name__] = before


class AdapterChecked(ModuleChecked):
    """`UlyssesSPDataLoaderAdapter` of one release, loaded. Its cases: (lengths, sp, 1), the
    checker's micro-batches as one packed row per rank."""

    function_name = CLASS
    size_name = "sp"
    case_rest = (1,)
    present = staticmethod(inspect.isclass)
    defaults = DEFAULTS
    shipped = (packed_row, RanksGroup, Collectives, release_stubs, call_outputs, lost_tokens,
               slot_problems, shard_problems, released_outputs, released_problems)  # fmt: skip
    title = f"every rank's micro-batches of packed rows ({FILE})"

    @property
    def line(self) -> int:
        with registered(self.module):
            return super().line

    def case_problems(self, lengths, sp, chosen):
        return None, shard_problems(call_outputs(self.module, lengths, sp, chosen), lengths, sp)

    def broken_module(self):
        """Each token labelled with itself (:714), the class re-executed in the copy."""
        with registered(self.module):
            return layouts.mutated_copy(self.module, (CLASS,), CLASS, CONTROL,
                                        CONTROL.replace("[..., 1:]", "[..., :-1]"),
                                        self.label)  # fmt: skip

    def shipped_constants(self) -> dict:
        return {"FILE": FILE, "STUBS": STUBS}

    def truth_outputs(self, finding: Finding) -> dict:
        """The right shards from the recipe's own packing (`pack_sequences`, documents back to
        back): each row padded to a multiple of sp (label -100), cut in sp contiguous chunks."""
        lengths, sp = finding.case["lengths"], finding.case["sp"]
        sequences, n = unique_sequences(list(lengths) * sp), len(lengths)
        fields = []
        for j in range(sp):
            batch = pack_sequences(sequences[j * n : (j + 1) * n], 1, PAD_ID)
            real = int(batch.cu_seqlens[-1])
            pad = -real % sp
            labels = torch.where(batch.loss_mask > 0, batch.labels, -100)
            fields.append({
                "input_ids": torch.cat([batch.input_ids, torch.full((pad,), PAD_ID)]),
                "position_ids": torch.cat([batch.position_ids, torch.arange(pad)]),
                "shift_labels": torch.cat([labels, torch.full((pad,), -100)]),
            })  # fmt: skip
        width = len(fields[0]["input_ids"]) // sp
        ranks = [[{k: v[r * width : (r + 1) * width].tolist() for k, v in row.items()}
                  for row in fields] for r in range(sp)]  # fmt: skip
        return {"ranks": ranks, "error": None}


def load_release(path, library: str, version: str):
    name = f"recipe_upstream_{library}_{version}_ulysses_sp".replace(".", "_").replace("-", "_")
    return load_module(path, name, release_stubs())


TARGET = ModuleTarget(CLASS, FILE, AdapterChecked, NOTES, load_release, signature_options)
TARGETS = (TARGET,)
LIBRARY = Library("deepspeed", TARGETS, releases=("0.19.8",))
