"""OpenRLHF's ring-attention batch split (`openrlhf/models/ring_attn_utils.py`), as its actor,
critic and reward model call it in packing mode, checked against the contiguous layout.

The wheel holds the file at `openrlhf-VERSION.data/purelib/openrlhf/models/ring_attn_utils.py`
(source.py extracts any member path; lines below are its). `Actor.forward` (models/actor.py:
236-298) calls `unpad_and_slice_tensor(sequences, attention_mask, ring_attn_group)` (:103) on
its [B, S] batch: flash-attn's `unpad_input` packs the rows into one row of N tokens, positions
(`cumsum(mask) - 1`, :137) and next-token labels (`torch.roll` of each row, :129) are taken
before the split, `get_tensor_in_current_ring_attn_rank` (:72) pads the row with 0 to T, a
multiple of the ring size W, and slices it; `cu_seqlens[-1] += ring_attn_pad_len` (:146) joins
the padding to the last sample for ring-flash-attn (:147). `gather_and_pad_tensor` (:151)
brings the log-probs back.

Ground truth, "unpad" (every rank of one batch, then the round trip): rank r holds slots
[r*T/W, (r+1)*T/W) of the packed stream; every real token on exactly one rank, at its slot, with
its position in its own sample and, as label, the next token of its own sample. A sample's last
label is free: the actor never trains it (`log_probs[:, :-1]`, actor.py:292, drops a full row's
last column; the action mask, the rollout's `action_mask[1:]`, samples_generator.py:262, is 0 on
the padding a shorter row's last label predicts). The release puts the row's next column there
(padding), or for a full row its own first token: never another sample's. Padding slots hold
anything but a real token (the gather cuts them). cu_seqlens keep every sample's boundaries and
end at T (the padding joining the last sample, or a sequence of its own). Round trip: each
rank's shard of its token ids, gathered back, is the [B, S] batch (0 on padding).
"slice": `get_tensor_in_current_ring_attn_rank(tensors, group, pad_id)`, whose docstring takes
"(batch, seqlen) or (1, total_seqs)": rank r holds columns [r*S'/W, (r+1)*S'/W) of every row,
S' the width padded with pad_id to a multiple of W.

Options: each parameter fixed (FIXED says how) or the check refuses. Drawn inputs: `padding`
("right", the default: PPO, SFT and DPO, experience.py:113, sft_dataset.py:226; "left": the
reward model's, reward_dataset.py:195); for "slice" `shape` ("packed", the default: (1, N), all
OpenRLHF passes, :143; "rows": right-padded (B, S)). Cases: the checker's lengths, W 2/4/8.
Stubs: `flash_attn.bert_padding` (:3) by plain torch (flash-attn 2.8's `unpad_input`, int32
cu_seqlens); `all_gather` (:4) by `Gather`; `dist` answers for a (size, rank) group;
`ring_flash_attn` (imported at :67) records the cu_seqlens; `patch_transformers_for_ring_
flash_attn` (:9, a transformers shim) a no-op; RING_ATTN_GROUP set (as set_ring_attn_group).

Impact: a real token on no rank -> lost; on two ranks or a wrong slot, a wrong position or
label, a sample boundary missing in cu_seqlens, a shard of the wrong shape, a real value
gathered back elsewhere -> misplaced; a raise -> raises; a wrong pad length or cu_seqlens end,
a nonzero padding column gathered back -> padding only.
Findings in 0.11.2: none as OpenRLHF calls the functions (PASS). With shape="rows" (outside its
calls, inside its docstring), get_tensor_in_current_ring_attn_rank cuts columns by numel() // W
(ring_attn_utils.py:94-96): with B > 1 rank 0 holds B*S'/W columns (all once B >= W), the
higher ranks fewer or none -> misplaced (lengths [1, 1], W 2: shapes [2, 2] and [2, 0]).
Negative controls (one line): labels rolled the wrong way (`shifts=1`, :129), the gather
cutting the padding from the front (:180), the slice one column late (:96).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass

import torch

from recipe.checks.assess import Impact, micro_batches
from recipe.checks.upstream.kit import checked, layouts
from recipe.checks.upstream.kit.checked import Checked, CheckTarget, Finding, Library
from recipe.parallel.cp.contract import unique_sequences
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import partition_options
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

INSTALLED = "openrlhf/models/ring_attn_utils.py"
FUNCTIONS = {"unpad": "unpad_and_slice_tensor", "slice": "get_tensor_in_current_ring_attn_rank"}
INVERSE = "gather_and_pad_tensor"
CHAIN = (FUNCTIONS["slice"], FUNCTIONS["unpad"], INVERSE, "update_ring_attn_params")
DRAWN = {"unpad": {"padding": ("right", "left")}, "slice": {"shape": ("packed", "rows")}}
DEFAULTS = {kind: {k: v[0] for k, v in drawn.items()} for kind, drawn in DRAWN.items()}
GROUP = "a (size, rank) stand-in of the drawn ring size (2, 4, 8); every rank is called"
RETURNED = "what unpad_and_slice_tensor returned on the rank"
FIXED = {
    "unpad": {"sequences": "[B, S] token ids, sample i in row i, 0-padded to the longest on the "
              "side `padding` says (zero_pad_sequences, utils/utils.py:93)",
              "attention_mask": "int64, 1 on the real tokens (samples_generator.py:254)",
              "ring_attn_group": GROUP},
    "gather": {"tensor": "each rank's shard of a per-token value (as log_probs, actor.py:283)",
               "ring_attn_group": GROUP, "ring_attn_pad_len": RETURNED, "indices": RETURNED,
               "batch": "B of the batch (actor.py:250)", "seqlen": "S of the batch"},
    "slice": {"tensors": "one tensor, (1, N) or (B, S) as `shape` says", "ring_attn_group": GROUP,
              "pad_id": "0, as unpad_and_slice_tensor passes it (ring_attn_utils.py:144)"},
}  # fmt: skip
CONTROL = {  # kind, part -> (function, released line, the one-line break)
    ("unpad", "function"): (FUNCTIONS["unpad"], "torch.roll(sequences, shifts=-1, dims=1)",
                            "torch.roll(sequences, shifts=1, dims=1)"),
    ("unpad", "inverse"): (INVERSE, "tensor = tensor[:, :-ring_attn_pad_len]",
                           "tensor = tensor[:, ring_attn_pad_len:]"),
    ("slice", "function"): (FUNCTIONS["slice"], "tensor = tensor[:, start:end]",
                            "tensor = tensor[:, start + 1 : end + 1]"),
}  # fmt: skip


# ---- Calling the release, and the ground truth: plain Python and torch, the reproducer's too.


def rearrange(tensor, pattern):
    """einops' rearrange for the one pattern ring_attn_utils.py uses."""
    if pattern != "b s ... -> (b s) ...":
        raise NotImplementedError(pattern)
    return tensor.reshape(-1, *tensor.shape[2:])


def index_first_axis(tensor, indices):
    return tensor[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash-attn 2.8's: (the real rows, their flat indices, cu_seqlens, max_seqlen, seqused)."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices)
    return rows, indices, cu_seqlens, int(seqlens.max()), seqlens


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


class Gather:
    """flash-attn's all_gather: every rank's shard (`shards`), concatenated in rank order."""

    shards = ()

    def __call__(self, tensor, group):
        mine = [s.transpose(0, 1) for s in self.shards]
        if len({s.shape for s in mine}) > 1:
            raise RuntimeError(f"all_gather of shards of shapes {[list(s.shape) for s in mine]}")
        if not torch.equal(tensor, mine[group[1]]):
            raise RuntimeError("all_gather of a tensor that is not this rank's shard")
        return torch.cat(mine)


def stubs():
    padding = {"unpad_input": unpad_input, "pad_input": pad_input, "rearrange": rearrange,
               "index_first_axis": index_first_axis}  # fmt: skip
    return {"flash_attn": {}, "flash_attn.bert_padding": padding, "flash_attn.utils": {},
            "flash_attn.utils.distributed": {}}  # fmt: skip


def prepare(module):
    module.all_gather = Gather()  # torch.distributed, the group a (size, rank) tuple:
    module.dist = types.SimpleNamespace(get_world_size=lambda group: group[0],
                                        get_rank=lambda group: group[1])  # fmt: skip
    module.patch_transformers_for_ring_flash_attn = lambda: None  # a transformers import shim
    module.RING_ATTN_GROUP = "the ring group, as set_ring_attn_group sets it"
    return module


def batch_rows(lengths, padding):
    """[B, S]: sample i (ids 1 + (max+1)*i + p) in row i, 0-padded on `padding`'s side."""
    stride, width = max(lengths) + 1, max(lengths)
    rows = []
    for i, n in enumerate(lengths):
        row, pad = [1 + stride * i + p for p in range(n)], [0] * (width - n)
        rows.append(row + pad if padding == "right" else pad + row)
    return rows


def rank_outputs(kind, module, lengths, world, option):
    """Every rank's outputs, lists (and the round trip for "unpad"), or the raise."""
    rows = batch_rows(lengths, option if kind == "unpad" else "right")
    ranks, shards, sent, step = [], [], [], "rank 0"
    ring = types.ModuleType("ring_flash_attn")
    ring.update_ring_flash_attn_params = lambda cu, group: sent.append([int(v) for v in cu])
    saved, sys.modules["ring_flash_attn"] = sys.modules.get("ring_flash_attn"), ring
    try:
        for rank in range(world):
            step = f"rank {rank}"
            if kind == "slice":
                tensor = torch.tensor(rows if option == "rows" else [[t for r in rows for t in r]])
                tensor = tensor[tensor != 0][None] if option == "packed" else tensor
                out, pad_len = module.get_tensor_in_current_ring_attn_rank(tensor, (world, rank), 0)
                ranks.append({"input_ids": out.tolist(), "pad_len": pad_len})
                continue
            ids = torch.tensor(rows)
            got = module.unpad_and_slice_tensor(ids, (ids != 0).long(), (world, rank))
            shards.append(got[0].double())
            ranks.append({"input_ids": got[0].tolist(), "position_ids": got[1].tolist(),
                          "labels": got[2].tolist(), "pad_len": got[3], "indices": got[4],
                          "cu_seqlens": sent[-1] if len(sent) > rank else None})  # fmt: skip
        module.all_gather.shards = shards
        for rank, got in enumerate(ranks if kind == "unpad" else ()):
            step = f"rank {rank}, gather_and_pad_tensor"
            args = (got["pad_len"], got.pop("indices"), len(rows), len(rows[0]))
            back = module.gather_and_pad_tensor(shards[rank], (world, rank), *args)
            got["round_trip"] = [[int(v) for v in row] for row in back.tolist()]
    except Exception as err:  # noqa: BLE001 (the release raising on a valid input is a finding)
        return {"ranks": [], "error": f"{step} raises {type(err).__name__}: {err}"}
    finally:
        sys.modules.pop("ring_flash_attn")
        if saved is not None:
            sys.modules["ring_flash_attn"] = saved
    return {"ranks": ranks, "error": None}


def truth(kind, lengths, world, option):
    """What a right function gives each rank; None: anything (see the module docstring)."""
    rows = batch_rows(lengths, option if kind == "unpad" else "right")
    stride, n = max(lengths) + 1, len(lengths)
    if kind == "slice":
        rows = rows if option == "rows" else [[t for r in rows for t in r if t]]
        pad = -len(rows[0]) % world
        local = (len(rows[0]) + pad) // world
        rows = [r + [0] * pad for r in rows]
        return [{"input_ids": [r[k * local : (k + 1) * local] for r in rows], "pad_len": pad}
                for k in range(world)]  # fmt: skip
    stream = [t for r in rows for t in r if t]
    pad = -len(stream) % world
    local, stream = (len(stream) + pad) // world, stream + [None] * pad
    cu = [sum(lengths[:i]) for i in range(n + 1)]
    cu[-1] += pad
    out = []
    for k in range(world):
        mine = stream[k * local : (k + 1) * local]
        at = [None if t is None else (t - 1) % stride for t in mine]
        labels = [None if t is None or p + 1 == lengths[(t - 1) // stride] else t + 1
                  for t, p in zip(mine, at)]  # fmt: skip
        out.append({"input_ids": [mine], "position_ids": [at], "labels": [labels], "pad_len": pad,
                    "cu_seqlens": cu, "round_trip": rows})  # fmt: skip
    return out


def level_problems(outputs, want, lengths):
    """(level, message): 4 lost, 3 misplaced, 2 raises, 1 padding only (module docstring)."""
    if outputs["error"]:
        return [(2, outputs["error"])]
    stride, n, found, seen = max(lengths) + 1, len(lengths), [], {}

    def where(t):
        return f"sample {(t - 1) // stride}, position {(t - 1) % stride}" if t else "padding"

    real = {t for w in want for row in w["input_ids"] for t in row if t}
    for rank, got in enumerate(outputs["ranks"]):
        for t in (t for row in got["input_ids"] for t in row if t in real):
            seen.setdefault(t, []).append(rank)
    missing = sorted(real - set(seen))
    if missing:
        found.append((4, f"{len(missing)} of {len(real)} real tokens on no rank, the first "
                      f"{where(missing[0])}"))  # fmt: skip
    found += [(3, f"{where(t)} is on ranks {r}") for t, r in seen.items() if len(r) > 1][:1]
    for rank, (got, w) in enumerate(zip(outputs["ranks"], want)):
        if got["pad_len"] != w["pad_len"]:
            found.append((1, f"rank {rank}: pad length {got['pad_len']}, expected {w['pad_len']}"))
        cu, right, end = got.get("cu_seqlens"), w.get("cu_seqlens"), sum(lengths)
        own = right and [*right[:-1], end, right[-1]]  # the padding a sequence of its own
        if right and cu != right and not (cu == own and right[-1] > end):
            level = 3 if cu is None or cu[:n] != right[:n] else 1
            found.append((level, f"rank {rank}: cu_seqlens handed to ring-flash-attn {cu}, "
                          f"expected {w['cu_seqlens']}"))  # fmt: skip
        for field in (f for f in w if f not in ("pad_len", "cu_seqlens")):
            shape = [[len(x), len(x[0]) if x else 0] for x in (got[field], w[field])]
            if shape[0] != shape[1]:
                found.append((3, f"rank {rank}: {field} of shape {shape[0]}, expected {shape[1]}"))
                continue
            tokens = w["round_trip" if field == "round_trip" else "input_ids"]
            wrong = [(b, c, g, x) for b, (gr, wr) in enumerate(zip(got[field], w[field]))
                     for c, (g, x) in enumerate(zip(gr, wr)) if x not in (None, g)]  # fmt: skip
            for b, c, g, x in wrong[:1]:
                at = f"[{b}, {c}]" if field == "round_trip" else f"row {b}, local slot {c}"
                found.append((3 if tokens[b][c] else 1, f"rank {rank}, {field} {at} "
                              f"({where(tokens[b][c])}): expected {x}, got {g}"))  # fmt: skip
    return found


def wheel_outputs(wheel, relative, kind, case, option):
    """The release in `wheel`, prepared as its callers run it, on every rank of the case."""
    module = prepare(load_from_wheel(wheel, relative, stubs()))
    return rank_outputs(kind, module, case["lengths"], case["world_size"], option)


def case_problems(outputs, kind, case, option):
    """What a reproducer prints: the text of each problem against the case's truth."""
    want = truth(kind, case["lengths"], case["world_size"], option)
    return [message for _, message in level_problems(outputs, want, case["lengths"])]


SHIPPED = (
    rearrange, index_first_axis, unpad_input, pad_input, Gather, stubs, prepare, batch_rows,
    rank_outputs, truth, level_problems, wheel_outputs, case_problems,
)  # fmt: skip
ENTRY = checked.entry_points("wheel_outputs(wheel, RELATIVE, KIND, CASE, OPTION)",
                             "case_problems(outputs, KIND, CASE, OPTION)")  # fmt: skip


def signature_options(kind: str, module, label: str) -> tuple[dict, dict]:
    """(drawn, fixed) of the function (and for "unpad" its inverse); an unknown option refuses."""
    _, fixed = partition_options(getattr(module, FUNCTIONS[kind]), label, __name__, FIXED[kind])
    if kind == "unpad":
        _, more = partition_options(getattr(module, INVERSE), label, __name__, FIXED["gather"])
        fixed.update({f"{INVERSE}.{k}": v for k, v in more.items()})
    return dict(DRAWN[kind]), fixed


@dataclass
class OpenRLHFChecked(Checked):
    kind: str = ""  # "unpad" (with its inverse) or "slice"
    module: object = None
    inverse_name: str | None = None

    @property
    def function_name(self) -> str:
        return FUNCTIONS[self.kind]

    @property
    def line(self) -> int:
        return checked.function_line(self.module, self.function_name)

    def cases(self, min_length: int = 1):
        """(lengths, ring size): the checker's micro-batches; tp does not enter."""
        return micro_batches(min_length=min_length).map(lambda case: (case[0], case[1]))

    def option(self, options: dict):
        (name, default), = DEFAULTS[self.kind].items()  # fmt: skip
        return name, options.get(name) if options.get(name) is not None else default

    def finding(self, case, options: dict) -> Finding | None:
        lengths, world = list(case[0]), case[1]
        name, value = self.option(options)
        outputs = rank_outputs(self.kind, self.module, lengths, world, value)
        found = level_problems(outputs, truth(self.kind, lengths, world, value), lengths)
        if not found:
            return None
        level, what = max(found, key=lambda f: f[0])  # the first of the worst
        return Finding({"lengths": lengths, "world_size": world}, ((name, value),), Impact(level),
                       f"lengths={lengths} ring size {world}: {what}")  # fmt: skip

    def broken_copy(self, part: str = "function") -> OpenRLHFChecked:
        if (self.kind, part) not in CONTROL:
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        function, line, changed = CONTROL[self.kind, part]
        broken = layouts.mutated_copy(self.module, CHAIN, function, line, changed, self.label)
        return dataclasses.replace(self, module=broken)

    def reproducer(self, finding: Finding) -> str:
        option = self.option(dict(finding.options))[1]
        constants = {"RELATIVE": self.file, "KIND": self.kind, "OPTION": option}
        body = checked.script_body(SHIPPED, constants, imports=("torch",), entry=ENTRY)
        title = f"{self.label}: every rank of one batch, against the contiguous layout"
        return self.reproducer_script(title, finding, body)

    def truth_outputs(self, finding: Finding) -> dict:
        """The right outputs, stated again in torch: the stream chunked W ways."""
        lengths, world = finding.case["lengths"], finding.case["world_size"]
        option = self.option(dict(finding.options))[1]
        samples = [torch.tensor(s) for s in unique_sequences(lengths)]
        width = max(lengths)
        if self.kind == "slice":
            rows = [torch.nn.functional.pad(s, (0, width - len(s))) for s in samples]
            rows = [torch.cat(samples)] if option == "packed" else rows
            pad = -rows[0].numel() % world
            grid = torch.nn.functional.pad(torch.stack(rows), (0, pad))
            return {"ranks": [{"input_ids": c.tolist(), "pad_len": pad}
                              for c in grid.chunk(world, dim=1)], "error": None}  # fmt: skip
        pad = -sum(lengths) % world
        stream = {"input_ids": samples, "position_ids": [torch.arange(len(s)) for s in samples],
                  "labels": [torch.cat([s[1:], s[:1] * 0]) for s in samples]}  # fmt: skip
        stream = {k: torch.nn.functional.pad(torch.cat(v), (0, pad)) for k, v in stream.items()}
        batch = torch.zeros(len(lengths), width, dtype=torch.int64)
        for i, s in enumerate(samples):
            start = width - len(s) if option == "left" else 0
            batch[i, start : start + len(s)] = s
        cu = torch.tensor([0, *lengths]).cumsum(0)
        cu[-1] += pad
        ranks = [{k: [v.chunk(world)[r].tolist()] for k, v in stream.items()} for r in range(world)]
        for got in ranks:
            got.update(pad_len=pad, cu_seqlens=cu.tolist(), round_trip=batch.tolist())
        return {"ranks": ranks, "error": None}


class OpenRLHFTarget(CheckTarget):
    file = INSTALLED

    def __init__(self, kind: str):
        self.kind, self.name = kind, FUNCTIONS[kind]

    def load(self, library: str, distribution: str, version: str | None) -> OpenRLHFChecked:
        relative = INSTALLED if version is None else f"openrlhf-{version}.data/purelib/{INSTALLED}"
        path, found = source_file(distribution, version, relative)
        tag = f"{library}_{found}_{self.kind}".replace(".", "_").replace("-", "_")
        module = prepare(load_module(path, f"recipe_upstream_{tag}", stubs()))
        label = f"{library}@{found} {self.name}"
        if not all(callable(getattr(module, name, None)) for name in CHAIN):
            raise UpstreamUnavailable(f"{label}: {relative} lacks one of {CHAIN}")
        drawn, skipped = signature_options(self.kind, module, label)
        note = {
            "unpad": f"every rank of one [B, S] batch, then the round trip through {INVERSE}",
            "slice": "shape=rows: outside OpenRLHF's calls, in its docstring",
        }[self.kind]
        return OpenRLHFChecked(library, found, self.name, distribution, relative, drawn,
                               skipped, (note,), kind=self.kind, module=module,
                               inverse_name=INVERSE if self.kind == "unpad" else None)  # fmt: skip


TARGETS = (OpenRLHFTarget("unpad"), OpenRLHFTarget("slice"))
LIBRARY = Library("openrlhf", TARGETS, releases=("0.11.2",))
