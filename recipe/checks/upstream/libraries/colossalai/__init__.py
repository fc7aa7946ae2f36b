"""ColossalAI's zigzag batch split for ring attention, as its Llama shardformer forward calls it,
checked against the zigzag contract (`recipe/parallel/cp/contract.py`).

0.5.0 is on PyPI as an sdist only (lines are its files'). With sequence_parallelism_mode
"ring_attn", `LlamaPipelineForwards` (`shardformer/modeling/llama.py`) splits its [B, S] batch:
the input (llama.py:151-158) by `RingAttention.prepare_varlen_batch(attention_mask, sp_group,
hidden_states, position_ids)` (`shardformer/layer/attn.py:1173`) when the mask is not all ones,
else by `split_batch_zigzag([hidden_states, position_ids], sp_group)` (`layer/utils.py:331`),
position_ids being arange(S)[None] unless passed (llama.py:127); the labels (llama.py:319-326)
alike, with is_label=True. The loss (`layer/loss.py:152`) weights every label but -100
(loss.py:213, :217). prepare_varlen_batch splits rows with `split_varlen_zigzag` (utils.py:381),
whose packed mode (is_batched_seq=False) is a utility the forward never calls.

Ground truth: the contract's, each sequence padded to a multiple of 2*sp (ColossalAI's own
precondition, attn.py:511-512, asserted at utils.py:436-438). The batch: a sequence per row,
right-padded (utils.py:441 reads a row's first slots), the mask counting its padded length,
labels = the token ids with -100 on padding (as ColossalAI's test data, tests/kit/model_zoo/
transformers/llama.py:48-50). Each case calls every rank of:
- `RingAttention.prepare_varlen_batch`: returns [B, max_seqlen/sp] rows, row j's first P_j/sp
  slots its chunks, the rest local padding. The contract reads those slots (row after row, its
  local layout); the case also checks that the local padding has label -100 and that mask_info's
  cu_seqlens and valid_indices (ring attention unpads with them, attn.py:587) fit the rows.
- `split_batch_zigzag`: rows padded to the longest padded length S, the mask all ones (the
  forward's branch then); a row is a sequence of S slots (cu_seqlens_padded [0, S, 2S, ..]).
- `split_varlen_zigzag`: the packed stream of the padded sequences, with its cu_seqlens.

Findings in 0.5.0 (pinned in tests/test_upstream_colossalai.py): prepare_varlen_batch leaves
label 0 on the local padding of shorter rows (utils.py:425, :448-449) and cuts position_ids by
the longest row (attn.py:1229-1236), tokens by each row's length (utils.py:446-449);
split_batch_zigzag asserts chunks of more than one token (utils.py:358-360); split_varlen_zigzag
splits packed labels with `torch.cat(seq[1:], tensor)` (utils.py:453), a TypeError.

Options: each parameter is drawn, fixed (FIXED says why) or refuses the check. Drawn:
position_ids ("shared" = arange(S)[None], the forward's default; "per_row" = [B, S]),
extra_columns (varlen: S past the longest padded row, 0 or 3, a fixed-width dataloader's),
is_label (packed: True = the function rolls the labels, as the forward asks; False = the caller
rolls them in each sequence). tp is no input (ring_attn's sp group is its own): tp=1.

Stubs (nothing the checked functions call): `colossalai.accelerator` (utils.py:10),
`colossalai.kernel.kernel_loader`, `colossalai.logging` (attn.py:11-18), `einops` (attn.py:8).
attn.py is loaded in a private package whose `utils` has utils.py's names; `dist` in both
answers for a (size, rank) group; attn's `_pad_input`/`_unpad_input` (flash-attn's, not called)
are set, so `_load_varlen_helpers` (attn.py:334) imports nothing.

Impact: a real token on no rank -> lost; a wrong position, label or loss weight, padding with a
label but -100, or mask_info not describing the slots -> misplaced; a raise -> raises.
Negative control (one line each): the back chunk taken as chunk sp+r, not 2*sp-1-r (attn.py:1230,
utils.py:371, utils.py:455), flagged on cases the release passes.

Calling the release, and what checks.assess.assess does not see (`rank_outputs`, `row_problems`), is
`shipped.py`: real code the checker calls and each reproducer carries (`inspect.getsource`).
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
import warnings
from dataclasses import dataclass, field

import torch

from recipe.checks.assess import Impact, micro_batches
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import CheckTarget, ContractChecked, Finding, Library
from recipe.checks.upstream.libraries.colossalai.shipped import (
    ATTN,
    STUBS,
    UTILS,
    Dist,
    rank_outputs,
    reproducer_body,
    row_problems,
    rows_truth,
)
from recipe.parallel.cp.contract import LAYOUT_KEY
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

FIXED = {
    "varlen": {
        "padding_mask": "1 on each row's padded length (a multiple of 2*sp), right padding",
        "inputs_embeds": "the hidden states [B, S, 1] (llama.py:154), the labels (:326)",
        "is_label": "False for the hidden states, True for the labels (llama.py:326)",
        "is_batched_seq": "True, the forward's; a [B, S] mask cannot mark packed documents",
    },
    "rows": {
        "batch": "[hidden states [B, S, 1], position_ids] (llama.py:158), the labels (:323)",
        "seq_dim": "1, as the forward passes it (llama.py:158 by default, :323)",
        "is_label": "False for the hidden states and positions, True for the labels (:323)",
    },
    "packed": {
        "batch": "[token ids, positions] of the packed stream, then its labels ([T])",
        "cu_seqlens": "the stream's padded boundaries (int32, as get_pad_info gives them)",
        "max_seqlen": "0, the default: read only in the batched mode (utils.py:409, :421-425)",
        "is_batched_seq": "False: the batched mode is prepare_varlen_batch's, checked there",
    },
}
for fixed in FIXED.values():
    fixed["sp_group"] = "a (size, rank) stand-in of the drawn sp size; every rank is called"
DRAWN = {
    "varlen": {"position_ids": ("shared", "per_row"), "extra_columns": (0, 3)},
    "rows": {"position_ids": ("shared", "per_row")},
    "packed": {"is_label": (True, False)},
}
INPUT_OPTIONS = {"varlen": {"extra_columns"}, "rows": {"position_ids"}, "packed": set()}
DEFAULTS = {kind: {k: v[0] for k, v in drawn.items()} for kind, drawn in DRAWN.items()}
CONTROL = {  # the line whose back chunk, 2*sp - 1 - r, the control makes sp + r
    "varlen": "indices = torch.tensor([sp_rank, 2 * sp_size - sp_rank - 1], device=inputs_embeds."
    "device)",
    "rows": "indices = torch.tensor([sp_rank, 2 * sp_size - 1 - sp_rank], device=tensor.device)",
    "packed": "local_seq.extend([seq[sp_rank], seq[2 * sp_size - 1 - sp_rank]])",
}
NOTES = {
    "varlen": "rows of several lengths; each case also checks the local padding and mask_info",
    "rows": "rows padded to one length S, the mask all ones (the forward's other branch)",
    "packed": "a packed 1-D stream (a utility: the forward never calls this mode)",
}


@functools.cache
def load_release(library: str, distribution: str, version: str | None):
    """(utils, attn, version): both files, loaded with the stubs and stand-ins of shipped.py."""
    utils_path, version = source_file(distribution, version, UTILS)
    attn_path, _ = source_file(distribution, version, ATTN)
    package = f"recipe_upstream_{library}_{version}".replace(".", "_").replace("-", "_")
    stubs = {name: {} for name in (*STUBS, package)}
    with warnings.catch_warnings():  # utils.py:522's torch.jit.script, a function not checked
        warnings.simplefilter("ignore", FutureWarning)
        utils = load_module(utils_path, f"{package}.utils", stubs)
        names = {k: v for k, v in vars(utils).items() if not k.startswith("__")}
        attn = load_module(attn_path, f"{package}.attn", {**stubs, f"{package}.utils": names})
    utils.dist = attn.dist = Dist()
    attn._pad_input = attn._unpad_input = "flash-attn's pad/unpad: not called"
    return utils, attn, version


def signature_options(function, kind: str, label: str) -> tuple[dict, dict]:
    """(drawn, fixed) for `function`'s signature; a parameter the plugin does not know, or one
    it fixes that is gone, refuses the check."""
    params = set(inspect.signature(function).parameters)
    known = set(FIXED[kind]) | (set(DRAWN[kind]) - INPUT_OPTIONS[kind])
    if params != known:
        raise UpstreamUnavailable(
            f"{label}: options the checker does not know: {sorted(params - known)}, gone: "
            f"{sorted(known - params)}. They may change the layout, so the check stops; teach "
            "recipe/checks/upstream/libraries/colossalai/__init__.py what they do"
        )
    return dict(DRAWN[kind]), dict(FIXED[kind])


@dataclass
class ColossalChecked(ContractChecked):
    kind: str = ""  # "varlen", "rows" or "packed"
    function: object = None
    def_line: int = 0
    seen: dict = field(default_factory=dict, repr=False)  # rank -> rank_outputs, of one case

    @property
    def line(self) -> int:
        return self.def_line

    def cases(self, min_length: int = 1):
        return micro_batches(min_length=min_length).map(lambda case: (case[0], case[1], 1))

    def sequence_parallel(self, options: dict) -> bool:
        return False  # tp is no input here

    def contract_function(self, options: dict):
        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            sequences, padded = [s.tolist() for s in sequences], cu_seqlens_padded.diff().tolist()
            got = rank_outputs(self.kind, self.function, sequences, padded, cp_size, cp_rank,
                               options)  # fmt: skip
            self.seen[cp_rank] = got
            fields = {k: torch.tensor(v) for k, v in got["fields"].items()}
            return {**fields, LAYOUT_KEY: torch.tensor(got["cu_seqlens_padded"])}

        return per_rank

    def finding(self, case, options: dict) -> Finding | None:
        """The contract's finding, or the worse one of the varlen rows (`row_problems`)."""
        lengths, cp_size, tp_size = case
        chosen = {**DEFAULTS[self.kind], **{k: v for k, v in options.items() if v is not None}}
        self.seen = {}
        contract = super().finding(case, chosen)
        cu = self.seen.get(0, {}).get("cu_seqlens_padded", [0])  # the contract's, for "varlen"
        padded = [b - a for a, b in zip(cu, cu[1:])]
        found = [(level, f"rank {rank}, {what}") for rank, got in sorted(self.seen.items())
                 for level, what in row_problems(got, padded, cp_size)]  # fmt: skip
        if not found or len(self.seen) < cp_size:  # a raise: the contract reports it
            return contract
        level, what = max(found, key=lambda f: f[0])
        head = {"lengths": list(lengths), "cp": cp_size, "tp": tp_size}
        what = f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: {what}"
        rows = Finding(head, tuple(sorted(chosen.items())), Impact(level), what)
        return layouts.worst(contract, rows)

    def broken_copy(self, part: str = "function") -> ColossalChecked:
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        line = CONTROL[self.kind]
        changed = re.sub(r"2 \* sp_size - (sp_rank - 1|1 - sp_rank)", "sp_size + sp_rank", line)
        namespace = dict(self.function.__globals__)
        source = layouts.mutated_source(self.function, line, changed, self.label)
        exec(textwrap.dedent(source), namespace)  # noqa: S102 (the release's, one line changed)
        broken = namespace[self.function.__name__]
        return ColossalChecked(
            self.library, self.version, self.name, self.distribution, self.file, self.drawn,
            self.skipped, self.notes, kind=self.kind, function=getattr(broken, "__func__", broken),
            def_line=self.def_line,
        )  # fmt: skip

    def reproducer(self, finding: Finding) -> str:
        body = reproducer_body(self.kind)
        title = f"{self.label}: every rank of one batch ({NOTES[self.kind]})"
        return self.reproducer_script(title, finding, body)

    def truth_outputs(self, finding: Finding) -> dict:
        lengths, cp_size, tp_size = (finding.case[k] for k in ("lengths", "cp", "tp"))
        truth = layouts.truth_outputs(lengths, cp_size, tp_size)
        cu = truth["cu_seqlens_padded"]
        padded = [b - a for a, b in zip(cu, cu[1:])]
        rows = {"rows": rows_truth(padded, cp_size, max(padded) // cp_size)}
        return {**truth, "rows": [rows if self.kind == "varlen" else {}] * cp_size}


class ColossalTarget(CheckTarget):
    def __init__(self, kind: str, name: str, file: str):
        self.kind, self.name, self.file = kind, name, file

    def load(self, library: str, distribution: str, version: str | None) -> ColossalChecked:
        utils, attn, version = load_release(library, distribution, version)
        owner = attn.RingAttention if self.kind == "varlen" else utils
        function = getattr(owner, self.name.split(".")[-1], None)
        if not callable(function):
            raise UpstreamUnavailable(f"{library}@{version} has no {self.name} in {self.file}")
        drawn, skipped = signature_options(function, self.kind, f"{library}@{version} {self.name}")
        lines, start = inspect.getsourcelines(function)  # from the decorator, where one is
        line = start + next(i for i, text in enumerate(lines) if text.lstrip().startswith("def "))
        return ColossalChecked(library, version, self.name, distribution, self.file, drawn,
                               skipped, (NOTES[self.kind],), kind=self.kind, function=function,
                               def_line=line)  # fmt: skip


TARGETS = (
    ColossalTarget("varlen", "RingAttention.prepare_varlen_batch", ATTN),
    ColossalTarget("rows", "split_batch_zigzag", UTILS),
    ColossalTarget("packed", "split_varlen_zigzag", UTILS),
)
LIBRARY = Library("colossalai", TARGETS, releases=("0.5.0",))
