"""AReaL's packed context-parallel split, label roll and reassembly (PyPI `areal`), read from
its wheel and run the way its Megatron engine runs them.

What is run, all of it the release's own code (line numbers: areal 1.0.4):
- the padding: `pad_mb_list` (areal/utils/data.py:981, which calls `pad_packed_tensor_dict`,
  :818) with the engine's alignment, i.e. the statements of `MegatronEngine._prepare_mb_list`
  (areal/engine/megatron_engine.py:2081-2092): `align_to_multiple_of = tp_size * cp_size * 2 if
  cp_size > 1 else tp_size`, `lcm(., DEFAULT_VECTORIZED_ALIGNMENT_BYTES = 16)` with fp8, then
  `pad_mb_list(mb_list, pad_value=0.0, pad_to_maximum=..., seq_align_to=align_to_multiple_of)`.
  Each sequence is padded to a multiple of the alignment, then one padding sequence is appended
  so the micro-batch is a multiple of lcm(alignment, 256) tokens (or of `max_tokens_per_mb`
  rounded up to it, with `pad_to_maximum`);
- the split (target `preprocess_packed_seqs_context_parallel`, packed_context_parallel.py:14):
  the tokens of each rank, and the labels as the engine makes them, `torch.roll` of the whole
  padded stream by -1 and then `split_packed_seqs_for_context_parallel` (:74) of it
  (megatron_engine.py:898-904). Checked with the zigzag contract (`ContractChecked`, `assess`):
  tokens on real slots, labels wherever the same sequence has a next token. AReaL shards no
  position ids and no loss mask: megatron derives RoPE positions from the padded cu_seqlens (the
  full-length position_ids the forward passes unsplit, :294/:381, are read only by mrope and
  learned absolute embeddings: not checked), and the loss mask is applied after the
  reassembly, on the unpadded stream;
- the reassembly (target `reassemble_cp_packed_logprobs`, :148, with `_build_cp_reassemble_indices`
  :110): every rank's shard of a per-token tensor (made by the release's split, the layout of the
  model's output) gathered back and unpadded as `_compute_logprobs_and_loss` does it
  (megatron_engine.py:2187-2206, `unpad_logits` at data.py:1046) must be the original per-token
  tensor, on every rank;
- `postprocess_packed_seqs_context_parallel` (:188): the same round trip through its gather.
  The engine's forward calls `packed_context_parallel_forward` (:286) with `gather_cp_output=not
  cp_local` (megatron_engine.py:875-881), which passes it on as `gather_output` (:411-413): with
  CP > 1, 1.0.4's engine never reaches the gather. The function is public and is checked with
  each option drawn.

The engine's statements are not retyped here: they are found in the wheel's
megatron_engine.py by their targets (`ast`), their names checked against what the check
provides (an unknown one refuses the check: it may change the layout) and executed.

Options. Drawn (every target): `enable_fp8` (the engine's alignment becomes lcm(2*cp*tp, 16)),
`pad_to_maximum` and `max_tokens_per_mb` (the micro-batch padded to that length, rounded up).
Drawn for the postprocess target: `post_process` (False: a pipeline stage that is not the last
returns its input), `gather_output`, `pass_cu_seqlens` (False: `cu_seqlens=None`) and
`output_width` (the last dim of [1, T/cp, V]: 1 a critic's value, 3 a small vocabulary).
Fixed, with the reason: `pad_value` 0.0 (what the engine passes; padding's content is never
compared), `batch_align_to` None (the engine does not pass it), the functions' tensor arguments
(the engine's padded micro-batch), `is_vision_model`/`use_padded_seq` False (the engine refuses
CP > 1 with either, megatron_engine.py:355-376) and tree training off (it asserts cp_size == 1,
:2030). cp (2, 4, 8) and tp (1, 2) are drawn with the micro-batch; cp = 1 splits nothing. An
option of a checked signature that is neither is
unknown and refuses the check (UpstreamUnavailable).

Stubs (imports the run code never calls): for packed_context_parallel.py, `areal.utils.data`
(only `is_multi_modal_key`, the real one from the loaded data.py); for data.py, `einops`,
`torchdata.stateful_dataloader`, `areal.api.cli_args` (config dataclasses used as annotations),
`areal.infra.platforms`, `areal.utils.seqpack` (the allocator that splits a batch into
micro-batches, not run: each case is one micro-batch, packed by the release's
`pack_tensor_dict`, data.py:492, as `_prepare_mb_list` packs each, megatron_engine.py:2075),
`areal.utils` (its `logging` is the standard one, what areal's `getLogger` wraps) and
`areal.utils.math` (`align`, the real one from the wheel's math.py). megatron-core and torch
are the real installed ones; the module's `mpu`, `dist` and `dist_F` are stand-ins while one
process plays every rank (the all-gathers hand back each rank's shard as that rank's split
made it).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    ContractChecked,
    Finding,
    Library,
    function_line,
    reproducer_source,
)
from recipe.parallel.cp.contract import Impact, global_batch
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

DISTRIBUTION = "areal"
PCP = "areal/engine/megatron_utils/packed_context_parallel.py"
ENGINE = "areal/engine/megatron_engine.py"

# The options every target draws: the engine's padding.
PADDING_OPTIONS = {
    "enable_fp8": (False, True),
    "pad_to_maximum": (False, True),
    "max_tokens_per_mb": (None, 256, 1000, 4096),
}
POSTPROCESS_OPTIONS = {
    "post_process": (True, False),
    "gather_output": (True, False),
    "pass_cu_seqlens": (True, False),
    "output_width": (3, 1),
}
# Arguments of the checked signatures, with why they are fixed.
FIXED = {
    "input_ids": "the engine's padded micro-batch (pad_mb_list)",
    "cu_seqlens": "the engine's padded cu_seqlens (pad_mb_list)",
    "tensor": "the engine's rolled padded input_ids (the labels)",
    "local_tensor": "this rank's shard, as the release's split made it",
    "padded_cu_seqlens": "the engine's padded cu_seqlens",
    "mb_list": "one micro-batch, packed as pack_tensor_dict packs it",
    "pad_value": "0.0, as the engine passes it; padding's content is never compared",
    "batch_align_to": "None: the engine does not pass it",
    "data": "pad_mb_list's micro-batch",
    "pad_to_length": "set by pad_mb_list",
    "logits": "the reassembled tensor",
    "padding_length": "pad_mb_list's trailing padding",
    "old_cu_seqlens": "pad_mb_list's unpadded cu_seqlens",
    "output": "this rank's shard as [1, T/cp, V], as megatron's GPTModel returns it",
    "is_vision_model": "False: the engine refuses CP > 1 for vision models",
    "use_padded_seq": "False: the engine refuses CP > 1 for models that need [B, S] input",
    "tree_training": "off: the engine asserts cp_size == 1 with tree training",
    "seq_align_to": "the engine's alignment: 2*cp*tp, lcm with 16 under fp8 (cp, tp, enable_fp8 "
    "drawn)",
}
# The release functions each target runs, whose every argument is drawn or fixed.
FUNCTIONS = {
    "split": ("preprocess_packed_seqs_context_parallel", "split_packed_seqs_for_context_parallel"),
    "reassembly": (
        "preprocess_packed_seqs_context_parallel",
        "reassemble_cp_packed_logprobs",
        "unpad_logits",
    ),
    "postprocess": (
        "preprocess_packed_seqs_context_parallel",
        "postprocess_packed_seqs_context_parallel",
    ),
}
# Arguments of postprocess that its drawn options set.
POSTPROCESS_DRAWN = {"post_process", "gather_output", "cu_seqlens"}
# What each release function is called with (its signature is checked against these).
SIGNATURES = {
    "preprocess_packed_seqs_context_parallel": ("input_ids", "cu_seqlens"),
    "split_packed_seqs_for_context_parallel": ("tensor", "cu_seqlens"),
    "reassemble_cp_packed_logprobs": ("local_tensor", "padded_cu_seqlens"),
    "postprocess_packed_seqs_context_parallel": (
        "output",
        "cu_seqlens",
        "post_process",
        "gather_output",
    ),
    "pad_mb_list": ("mb_list", "pad_value", "pad_to_maximum", "batch_align_to", "seq_align_to"),
    "pad_packed_tensor_dict": ("data", "pad_to_length", "pad_value", "seq_align_to"),
    "unpad_logits": ("logits", "padding_length", "cu_seqlens", "old_cu_seqlens"),
}
# The engine's state its statements may read, by dotted name.
ENGINE_STATE = {"self.enable_fp8", "self.config.pad_to_maximum"}
_QUIET = logging.getLogger("recipe.checks.upstream.libraries.areal.data")
_QUIET.setLevel(logging.ERROR)  # pad_mb_list's "unable to pad to maximum" note, per case


# ---- shipped into reproducers: self-contained (imports inside, no module globals) ----------


def engine_statements(source: str) -> dict:
    """The engine's own statements around the checked functions, by role: [(line, code)].

    align: `_prepare_mb_list`'s assignments of `align_to_multiple_of`; pad: its `mb_list =
    pad_mb_list(...)`; roll: `forward_step`'s padded cu_seqlens, rolled ids and CP labels;
    gather: `_compute_logprobs_and_loss`'s `logprobs = reassemble_cp_packed_logprobs(...)` and
    `logprobs = unpad_logits(...)` (the entropy and vocab statistics repeat the same two)."""
    import ast

    tree = ast.parse(source)
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def assigned(method, test):
        if method not in methods:
            raise LookupError(f"the engine has no method {method}")
        found = []
        for node in ast.walk(methods[method]):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and test(node.targets[0].id, node.value)
            ):
                found.append(node)
        return sorted(found, key=lambda n: n.lineno)

    def calls(name):
        return lambda target, value: (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == name
        )

    roles = {
        "align": (assigned("_prepare_mb_list", lambda t, v: t == "align_to_multiple_of"), 2),
        "pad": (
            assigned(
                "_prepare_mb_list", lambda t, v: t == "mb_list" and calls("pad_mb_list")(t, v)
            ),
            1,
        ),
        "roll": (
            assigned(
                "forward_backward_batch",
                lambda t, v: t in ("padded_cu_seqlens", "rolled_ids", "cp_labels"),
            ),
            3,
        ),
        "gather": (
            assigned(
                "_compute_logprobs_and_loss",
                lambda t, v: (
                    t == "logprobs"
                    and (
                        calls("reassemble_cp_packed_logprobs")(t, v) or calls("unpad_logits")(t, v)
                    )
                ),
            ),
            2,
        ),
    }
    statements = {}
    for role, (nodes, count) in roles.items():
        if len(nodes) != count:
            raise LookupError(
                f"the engine's {role} statements are {len(nodes)}, the check knows {count}: "
                + "; ".join(f"line {n.lineno}: {ast.unparse(n)}" for n in nodes)
            )
        statements[role] = [(n.lineno, n.end_lineno, ast.unparse(n)) for n in nodes]
    return statements


def run_statements(statements, namespace: dict) -> dict:
    for line, _end, code in statements:
        exec(compile(code, f"<megatron_engine.py:{line}>", "exec"), namespace)  # noqa: S102
    return namespace


class GatherStandIn:
    """torch.distributed (`dist`) and torch.distributed.nn.functional (`dist_F`) as one rank
    sees them: all_gather hands back every rank's shard, this rank's being the one it passes."""

    def __init__(self, shards, rank):
        self.shards, self.rank = list(shards), rank

    def _gathered(self, tensor):
        return [tensor if r == self.rank else s for r, s in enumerate(self.shards)]

    def all_gather(self, *args, group=None):
        if len(args) == 2:  # dist.all_gather(output_list, tensor, group)
            outputs, tensor = args
            for out, shard in zip(outputs, self._gathered(tensor), strict=True):
                out.copy_(shard)
            return None
        return tuple(self._gathered(args[0]))  # dist_F.all_gather(tensor, group)


def load_modules(load) -> dict:
    """The release's files the check runs, each loaded by `load(relative, stubs)`."""
    import logging

    math_module = load("areal/utils/math.py", {})
    constants = load("areal/utils/constants.py", {})
    data = load(
        "areal/utils/data.py",
        {
            "einops": {},
            "torchdata": {},
            "torchdata.stateful_dataloader": {},
            "areal.api.cli_args": {},
            "areal.infra.platforms": {},
            "areal.utils": {"logging": logging},
            "areal.utils.seqpack": {},
            "areal.utils.math": {"align": math_module.align},
        },
    )
    stubs = {"areal.utils.data": {"is_multi_modal_key": data.is_multi_modal_key}}
    pcp = load("areal/engine/megatron_utils/packed_context_parallel.py", stubs)
    return {"pcp": pcp, "data": data, "constants": constants}


def case_values(lengths):
    """Token ids unique over the micro-batch (0 is padding), as the contract draws them."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


def micro_batch(modules, statements, values, cp, tp, options):
    """The engine's padded micro-batch of these per-token tensors (one per sequence):
    (padded_mb, padding_length, old_cu_seqlens), by the engine's own alignment and pad call."""
    import math
    import types

    import torch

    data = modules["data"]
    # the [B, S] batch the engine receives (right-padded rows and their attention mask), packed
    # by the release's pack_tensor_dict as _prepare_mb_list packs each micro-batch
    lengths = [int(v.shape[0]) for v in values]
    rows = torch.zeros(len(values), max(lengths), dtype=values[0].dtype)
    mask = torch.zeros(len(values), max(lengths), dtype=torch.bool)
    for i, v in enumerate(values):
        rows[i, : v.shape[0]] = v
        mask[i, : v.shape[0]] = True
    mb = data.pack_tensor_dict({"input_ids": rows, "attention_mask": mask})
    engine = types.SimpleNamespace(
        enable_fp8=options.get("enable_fp8", False),
        config=types.SimpleNamespace(pad_to_maximum=options.get("pad_to_maximum", False)),
    )
    spec = types.SimpleNamespace(max_tokens_per_mb=options.get("max_tokens_per_mb"))
    namespace = {
        "self": engine,
        "tp_size": tp,
        "cp_size": cp,
        "math": math,
        "DEFAULT_VECTORIZED_ALIGNMENT_BYTES": modules[
            "constants"
        ].DEFAULT_VECTORIZED_ALIGNMENT_BYTES,
        "pad_mb_list": data.pad_mb_list,
        "mb_list": data.MicroBatchList(data={}, mb_spec=spec, mbs=[mb], group_lens=[sum(lengths)]),
    }
    mb_list = run_statements(statements["align"] + statements["pad"], namespace)["mb_list"]
    return mb_list.padded_mbs[0], mb_list.padding_lengths[0], mb_list.old_cu_seqlens_list[0]


def split_on_rank(modules, statements, padded_mb, cp, rank, tp):
    """(tokens, labels, layout) of one rank: the split of the tokens, and the engine's labels
    (its roll of the padded stream and the split of that); layout = the attention's
    cu_seqlens_q_padded."""
    import types

    import torch

    pcp = modules["pcp"]
    pcp.mpu = ParallelStateStandIn(cp, rank, tp)
    tokens, params = pcp.preprocess_packed_seqs_context_parallel(
        padded_mb["input_ids"], padded_mb["cu_seqlens"]
    )
    namespace = {
        "torch": torch,
        "mb_input": types.SimpleNamespace(padded_mb=padded_mb),
        "split_packed_seqs_for_context_parallel": pcp.split_packed_seqs_for_context_parallel,
    }
    labels = run_statements(statements["roll"], namespace)["cp_labels"]
    return tokens.reshape(-1), labels.reshape(-1), params.cu_seqlens_q_padded


def split_outputs(modules, statements, case, options):
    """Every rank's tokens and labels, and the layout, or the error the run raised."""
    import torch

    values = [torch.tensor(s, dtype=torch.int64) for s in case_values(case["lengths"])]
    ranks = []
    try:
        padded_mb = micro_batch(modules, statements, values, case["cp"], case["tp"], options)[0]
        for rank in range(case["cp"]):
            tokens, labels, layout = split_on_rank(
                modules, statements, padded_mb, case["cp"], rank, case["tp"]
            )
            ranks.append({"input_ids": tokens, "labels": labels})
    except Exception as err:  # noqa: BLE001 (a raise on a valid input is what is reported)
        return {"error": f"rank {len(ranks)} raises {type(err).__name__}: {err}"}
    return {"error": None, "cu": [int(c) for c in layout], "ranks": ranks}


def shards_and_stream(modules, statements, case, options):
    """The per-token values of the case (float), the engine's padded micro-batch of them, and
    every rank's shard as the release's split makes it (the model's output layout)."""
    import torch

    pcp = modules["pcp"]
    values = [torch.tensor(s, dtype=torch.float64) for s in case_values(case["lengths"])]
    padded_mb, padding, old_cu = micro_batch(
        modules, statements, values, case["cp"], case["tp"], options
    )
    shards = []
    for rank in range(case["cp"]):
        pcp.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
        shard = pcp.preprocess_packed_seqs_context_parallel(
            padded_mb["input_ids"], padded_mb["cu_seqlens"]
        )[0]
        shards.append(shard.reshape(-1))
    return values, padded_mb, padding, old_cu, shards


def reassembly_outputs(modules, statements, case, options):
    """Every rank's per-token tensor after the engine's reassemble + unpad of the shards."""
    pcp = modules["pcp"]
    got = []
    try:
        _, padded_mb, padding, old_cu, shards = shards_and_stream(
            modules, statements, case, options
        )
        for rank in range(case["cp"]):
            pcp.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
            pcp.dist_F = GatherStandIn(shards, rank)
            namespace = {
                "logprobs": shards[rank],
                "cp_padded_cu_seqlens": padded_mb["cu_seqlens"],
                "cp_padding_length": padding,
                "cp_old_cu_seqlens": old_cu,
                "reassemble_cp_packed_logprobs": pcp.reassemble_cp_packed_logprobs,
                "unpad_logits": modules["data"].unpad_logits,
            }
            got.append(run_statements(statements["gather"], namespace)["logprobs"])
    except Exception as err:  # noqa: BLE001 (as above)
        return {"error": f"rank {len(got)} raises {type(err).__name__}: {err}"}
    return {"error": None, "ranks": got}


def postprocess_outputs(modules, statements, case, options):
    """Every rank's input shard ([1, T/cp, V]) and what postprocess returns for it."""
    import torch

    pcp = modules["pcp"]
    width = options.get("output_width", 3)
    ranks = []
    try:
        _, padded_mb, _, _, shards = shards_and_stream(modules, statements, case, options)
        wide = [(s[:, None] + torch.arange(width) / 4).unsqueeze(0) for s in shards]
        cu = padded_mb["cu_seqlens"] if options.get("pass_cu_seqlens", True) else None
        for rank in range(case["cp"]):
            pcp.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
            pcp.dist = GatherStandIn(wide, rank)
            out = pcp.postprocess_packed_seqs_context_parallel(
                wide[rank].clone(),
                cu,
                options.get("post_process", True),
                gather_output=options.get("gather_output", True),
            )
            ranks.append({"input": wide[rank], "output": out})
    except Exception as err:  # noqa: BLE001 (as above)
        return {"error": f"rank {len(ranks)} raises {type(err).__name__}: {err}"}
    return {"error": None, "cu": [int(c) for c in padded_mb["cu_seqlens"]], "ranks": ranks}


def zigzag_slots(cu, cp, rank):
    """The global slots rank `rank` holds, in its local order: chunks rank and 2*cp-1-rank of
    every sequence of the padded layout `cu`."""
    slots = []
    for i in range(len(cu) - 1):
        half = (cu[i + 1] - cu[i]) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            slots.extend(range(cu[i] + chunk * half, cu[i] + (chunk + 1) * half))
    return slots


def padded_stream(lengths, cu):
    """The ground truth on the padded layout `cu` (which may end with padding sequences):
    token, next token of the same sequence (-1 where none) and (sequence, position) per slot
    (None on padding)."""
    import torch

    total = cu[-1]
    tokens = torch.zeros(total, dtype=torch.float64)
    labels = torch.full((total,), -1.0, dtype=torch.float64)
    where = [None] * total
    for i, seq in enumerate(case_values(lengths)):
        for p, token in enumerate(seq):
            tokens[cu[i] + p] = token
            where[cu[i] + p] = (i, p)
            if p + 1 < len(seq):
                labels[cu[i] + p] = seq[p + 1]
    return tokens, labels, where


def _value(x):
    x = float(x)
    return int(x) if x.is_integer() else x


def split_problems(outputs, case):
    """(impact, what) of every way the split's tokens and labels differ from the zigzag truth."""
    import torch

    if outputs["error"]:
        return [("raises", outputs["error"])]
    lengths, cp, cu = case["lengths"], case["cp"], outputs["cu"]
    problems = []
    for i, n in enumerate(lengths):
        padded = cu[i + 1] - cu[i]
        if padded < n or padded % (2 * cp):
            return [
                (
                    "misplaced",
                    f"sequence {i} ({n} tokens) is padded to {padded}, not a "
                    f"multiple of 2*cp={2 * cp} that holds it",
                )
            ]
    tokens, labels, where = padded_stream(lengths, cu)
    seen = torch.zeros(cu[-1], dtype=torch.bool)
    for rank, got in enumerate(outputs["ranks"]):
        slots = zigzag_slots(cu, cp, rank)
        shapes = [
            f"rank {rank}: {name} has {got[name].numel()} slots, the layout gives it {len(slots)}"
            for name in ("input_ids", "labels")
            if got[name].numel() != len(slots)
        ]
        if shapes:
            return [("misplaced", what) for what in shapes]
        index = torch.tensor(slots, dtype=torch.int64)
        real = torch.tensor([where[g] is not None for g in slots], dtype=torch.bool)
        seen[index[real]] = True
        for name, truth, checked in (
            ("input_ids", tokens[index], real),
            ("labels", labels[index], labels[index] >= 0),
        ):
            have = got[name].to(torch.float64)
            wrong = (checked & (have != truth)).nonzero().flatten().tolist()
            for slot in wrong[:1]:
                i, p = where[slots[slot]]
                problems.append(
                    (
                        "misplaced",
                        f"rank {rank}, local slot {slot} (sequence {i}, position {p}): {name} "
                        f"expected {_value(truth[slot])}, got {_value(have[slot])}",
                    )
                )
    missing = [where[g] for g in range(cu[-1]) if where[g] is not None and not seen[g]]
    if missing:
        problems.append(
            (
                "lost",
                f"{len(missing)} real tokens are on no rank (first: sequence "
                f"{missing[0][0]} position {missing[0][1]})",
            )
        )
    return problems


def _compare(name, want, got, where, real):
    """(impact, what) of the first slot where `got` differs from `want` (1-D or [T, V])."""
    if tuple(got.shape) != tuple(want.shape):
        return ("misplaced", f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    differs = (got != want).reshape(got.shape[0], -1).any(dim=1)
    if real is not None:
        for kind, mask in (("real", real), ("padding", ~real)):
            slots = (differs & mask).nonzero().flatten().tolist()
            if not slots:
                continue
            slot = slots[0]
            expected, have = want[slot].flatten()[0], got[slot].flatten()[0]
            if kind == "padding":
                return (
                    "padding",
                    f"{name}: padding slot {slot} expected {_value(expected)}, "
                    f"got {_value(have)}; every real token is right",
                )
            i, p = where[slot]
            anywhere = bool((got.reshape(got.shape[0], -1)[:, 0] == expected).any())
            impact = "misplaced" if anywhere else "lost"
            lost = (
                ""
                if anywhere
                else f" ({_value(expected)} is nowhere in it: that token never reaches the loss)"
            )
            return (
                impact,
                f"{name}: slot {slot} (sequence {i}, position {p}) expected "
                f"{_value(expected)}, got {_value(have)}{lost}",
            )
    slots = differs.nonzero().flatten().tolist()
    if slots:
        slot = slots[0]
        return (
            "misplaced",
            f"{name}: slot {slot} expected {_value(want[slot].flatten()[0])}, "
            f"got {_value(got[slot].flatten()[0])}",
        )
    return None


def reassembly_problems(outputs, case):
    """(impact, what) per rank whose reassembled, unpadded tensor is not the original."""
    import torch

    if outputs["error"]:
        return [("raises", outputs["error"])]
    seqs = case_values(case["lengths"])
    want = torch.tensor([t for s in seqs for t in s], dtype=torch.float64)
    where = [(i, p) for i, s in enumerate(seqs) for p in range(len(s))]
    real = torch.ones(want.numel(), dtype=torch.bool)
    problems = []
    for rank, got in enumerate(outputs["ranks"]):
        found = _compare(
            "the reassembled, unpadded tensor", want, got.to(torch.float64), where, real
        )
        if found:
            problems.append((found[0], f"rank {rank}: {found[1]}"))
    return problems


def postprocess_problems(outputs, case, options):
    """(impact, what) per rank whose postprocess result is not what its options promise: the
    input unchanged (post_process=False), this rank's shard ([T/cp, V]: no cu_seqlens or
    gather_output=False), else the whole padded stream [T, V]."""
    import torch

    if outputs["error"]:
        return [("raises", outputs["error"])]
    width = options.get("output_width", 3)
    gathers = options.get("gather_output", True) and options.get("pass_cu_seqlens", True)
    tokens, _, where = padded_stream(case["lengths"], outputs["cu"])
    full = tokens[:, None] + torch.arange(width) / 4
    real = torch.tensor([w is not None for w in where], dtype=torch.bool)
    problems = []
    for rank, r in enumerate(outputs["ranks"]):
        got = r["output"].to(torch.float64)
        if not options.get("post_process", True) or not gathers:
            # the input unchanged, or squeezed to this rank's shard: compared slot by slot
            want = r["input"] if not options.get("post_process", True) else r["input"][0]
            if tuple(got.shape) != tuple(want.shape):
                found = (
                    "misplaced",
                    f"the output has shape {tuple(got.shape)}, expected {tuple(want.shape)}",
                )
            else:
                found = _compare(
                    "the output", want.reshape(-1, width), got.reshape(-1, width), None, None
                )
        else:
            found = _compare("the gathered output", full, got, where, real)
        if found:
            problems.append((found[0], f"rank {rank}: {found[1]}"))
    return problems


_SHIPPED = (
    engine_statements,
    run_statements,
    ParallelStateStandIn,
    GatherStandIn,
    load_modules,
    case_values,
    micro_batch,
    split_on_rank,
    split_outputs,
    shards_and_stream,
    reassembly_outputs,
    postprocess_outputs,
    zigzag_slots,
    padded_stream,
    _value,
    split_problems,
    _compare,
    reassembly_problems,
    postprocess_problems,
)

# ---- the checker's side -------------------------------------------------------------------

IMPACTS = {
    "padding": Impact.PADDING,
    "raises": Impact.RAISES,
    "misplaced": Impact.MISPLACED,
    "lost": Impact.LOST,
}


def _case_text(case) -> str:
    return f"lengths={list(case['lengths'])} cp={case['cp']} tp={case['tp']}"


def _worst(problems, case) -> tuple[Impact, str] | None:
    if not problems:
        return None
    impact, what = max(problems, key=lambda p: IMPACTS[p[0]])
    return IMPACTS[impact], f"{_case_text(case)}: {what}"


# The negative controls: one line of the release's own source, with one realistic slip.
MUTATIONS = {
    "preprocess_packed_seqs_context_parallel": {
        # the back chunk starts one row late
        "function": (
            "preprocess_packed_seqs_context_parallel",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1)",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1) + 1",
        ),
        "labels": (
            "split_packed_seqs_for_context_parallel",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1)",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1) + 1",
        ),
    },
    "reassemble_cp_packed_logprobs": {
        # each rank's shard read from one slot early
        "function": (
            "_build_cp_reassemble_indices",
            "src_offset = j * local_len + local_start",
            "src_offset = j * local_len + local_start - 1",
        ),
    },
    "postprocess_packed_seqs_context_parallel": {
        # rank j's chunks taken from the mirror rank's shard
        "function": (
            "postprocess_packed_seqs_context_parallel",
            "o = output_list[j].squeeze(0)",
            "o = output_list[cp_size - 1 - j].squeeze(0)",
        ),
    },
}
# The functions of packed_context_parallel.py a check runs (a broken copy re-executes them all,
# so each finds the mutated one in its namespace).
RUN = (
    "preprocess_packed_seqs_context_parallel",
    "split_packed_seqs_for_context_parallel",
    "_build_cp_reassemble_indices",
    "reassemble_cp_packed_logprobs",
    "postprocess_packed_seqs_context_parallel",
)


@dataclass(frozen=True)
class Release:
    """One release's files, loaded, and the engine's statements found in it."""

    version: str
    modules: dict
    statements: dict
    lines: dict  # role -> (first, last) line in megatron_engine.py


@dataclass(frozen=True)
class ArealTarget(CheckTarget):
    name: str
    file: str = PCP
    kind: str = "split"  # split | reassembly | postprocess

    def load(self, library: str, distribution: str, version: str | None) -> Checked:
        release = load_release(distribution, version)
        cls = {
            "split": SplitChecked,
            "reassembly": ReassemblyChecked,
            "postprocess": PostprocessChecked,
        }[self.kind]
        return cls.create(library, distribution, release, self)


def _load(distribution: str, version: str | None):
    def load(relative, stubs):
        path, _ = source_file(distribution, version, relative)
        tag = f"{version}_{relative}".replace("/", "_").replace(".", "_").replace("-", "_")
        return load_module(path, f"recipe_upstream_areal_{tag}", stubs)

    return load


@functools.cache
def load_release(distribution: str, version: str | None) -> Release:
    _, version = source_file(distribution, version, PCP)
    modules = load_modules(_load(distribution, version))
    modules["data"].logger = _QUIET
    engine_path, _ = source_file(distribution, version, ENGINE)
    source = engine_path.read_text()
    try:
        statements = engine_statements(source)
    except LookupError as err:
        raise UpstreamUnavailable(
            f"areal@{version} {ENGINE}: {err}; the check runs the engine's own statements and "
            "must learn their new shape"
        ) from None
    _check_names(version, statements)
    for name, params in SIGNATURES.items():
        module = (
            modules["data"]
            if name in ("pad_mb_list", "pad_packed_tensor_dict", "unpad_logits")
            else modules["pcp"]
        )
        fn = getattr(module, name, None)
        if fn is None:
            raise UpstreamUnavailable(f"areal@{version} has no {name}")
        have = tuple(inspect.signature(fn).parameters)
        unknown = [p for p in have if p not in params]
        if unknown:
            raise UpstreamUnavailable(
                f"areal@{version} {name} has an option the check does not know: "
                f"{', '.join(map(repr, unknown))}. It may change the layout, so the check "
                "stops; teach recipe/checks/upstream/libraries/areal.py what it does (draw it or "
                "fix it)"
            )
    lines = {role: (s[0][0], s[-1][1]) for role, s in statements.items()}
    return Release(version, modules, statements, lines)


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


# The names each role's statements may read: what the check puts in their namespace.
ROLE_NAMES = {
    "align": {
        "tp_size",
        "cp_size",
        "math",
        "DEFAULT_VECTORIZED_ALIGNMENT_BYTES",
        "self",
        "align_to_multiple_of",
    },
    "pad": {"pad_mb_list", "mb_list", "self", "align_to_multiple_of"},
    "roll": {
        "mb_input",
        "torch",
        "split_packed_seqs_for_context_parallel",
        "padded_cu_seqlens",
        "rolled_ids",
        "cp_labels",
    },
    "gather": {
        "logprobs",
        "reassemble_cp_packed_logprobs",
        "unpad_logits",
        "cp_padded_cu_seqlens",
        "cp_padding_length",
        "cp_old_cu_seqlens",
    },
}
PAD_KEYWORDS = {"pad_value", "pad_to_maximum", "seq_align_to"}


def _check_names(version: str, statements: dict) -> None:
    """Every name and engine attribute the statements read is one the check provides; the
    engine's pad call passes only the keywords the check knows."""
    for role, found in statements.items():
        for line, _end, code in found:
            tree = ast.parse(code)
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            state = {
                d
                for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and (d := _dotted(n)) and d.startswith("self.")
            }
            state = {d for d in state if not any(o.startswith(d + ".") for o in state)}
            unknown = sorted((names - ROLE_NAMES[role]) | (state - ENGINE_STATE))
            if role == "pad":
                call = tree.body[0].value
                unknown += sorted({k.arg for k in call.keywords} - PAD_KEYWORDS)
                if len(call.args) != 1:
                    unknown.append(f"{len(call.args)} positional arguments")
            if unknown:
                raise UpstreamUnavailable(
                    f"areal@{version} {ENGINE}:{line} `{code}` reads {', '.join(unknown)}, "
                    "which the check does not know; it may change the layout, so the check "
                    "stops (teach recipe/checks/upstream/libraries/areal.py what it is)"
                )


class _ArealChecked:
    """What the three targets share: the loaded release, its notes, the broken copy."""

    release: Release
    def_line: int
    function_name: str
    mutated: str | None

    @property
    def line(self) -> int:
        return self.def_line

    @classmethod
    def create(
        cls,
        library,
        distribution,
        release: Release,
        target: ArealTarget,
        mutated: str | None = None,
        line: int | None = None,
    ):
        pcp = release.modules["pcp"]
        lines = release.lines
        drawn = dict(PADDING_OPTIONS)
        if target.kind == "postprocess":
            drawn.update(POSTPROCESS_OPTIONS)
        skipped = {}
        for name in (*FUNCTIONS[target.kind], "pad_mb_list", "pad_packed_tensor_dict"):
            for p in SIGNATURES[name]:
                drawn_here = target.kind == "postprocess" and name == target.name
                if p not in drawn and not (drawn_here and p in POSTPROCESS_DRAWN):
                    skipped[p] = FIXED[p]
        skipped.update(
            {k: FIXED[k] for k in ("is_vision_model", "use_padded_seq", "tree_training")}
        )
        notes = (
            f"padding: the engine's alignment and pad_mb_list call ({ENGINE}:"
            f"{lines['align'][0]}-{lines['pad'][1]}), run from the wheel",
            *cls.NOTES(lines),
        )
        return cls(
            library=library,
            version=release.version,
            name=target.name,
            distribution=distribution,
            file=target.file,
            drawn=drawn,
            skipped=skipped,
            notes=notes,
            release=release,
            def_line=function_line(pcp, target.name) if line is None else line,
            function_name=target.name,
            mutated=mutated,
        )

    def broken_copy(self, part: str = "function"):
        known = MUTATIONS[self.function_name]
        if part not in known:
            raise UpstreamUnavailable(
                f"{self.label} has no part {part!r} to break; known: {', '.join(known)}"
            )
        victim, line, slip = known[part]
        pcp = self.release.modules["pcp"]
        broken = layouts.mutated_copy(pcp, RUN, victim, line, slip, self.label)
        modules = {**self.release.modules, "pcp": broken}
        release = Release(self.version, modules, self.release.statements, self.release.lines)
        target = ArealTarget(self.name, self.file, self.KIND)
        return type(self).create(
            self.library, self.distribution, release, target, mutated=part, line=self.def_line
        )

    def _reproducer(self, finding: Finding, outputs: str, problems: str) -> str:
        body = "\n\n".join(inspect.getsource(f) for f in _SHIPPED)
        body += f"""

def release_outputs(wheel):
    modules = load_modules(lambda relative, stubs: load_from_wheel(wheel, relative, stubs))
    with zipfile.ZipFile(wheel) as archive:
        engine = archive.read({ENGINE!r}).decode()
    return {outputs}(modules, engine_statements(engine), CASE, OPTIONS)


def problems(outputs):
    return [what for _impact, what in {problems}]
"""
        title = (
            f"{self.library}@{self.version} {self.name} ({self.file}:{self.line}), run as "
            "AReaL's Megatron engine runs it"
        )
        return reproducer_source(title, finding, body, self.distribution, self.version)


def _finding(case, options, found) -> Finding | None:
    if found is None:
        return None
    impact, what = found
    return Finding(dict(case), tuple(sorted(options.items())), impact, what)


def _case(case) -> dict:
    if isinstance(case, dict):
        return case
    lengths, cp, tp = case
    return {"lengths": list(lengths), "cp": cp, "tp": tp}


@dataclass
class SplitChecked(_ArealChecked, ContractChecked):
    """The tokens and the engine's labels of every rank, against the zigzag contract."""

    KIND = "split"
    release: Release | None = None
    def_line: int = 0
    function_name: str = ""
    mutated: str | None = None

    @staticmethod
    def NOTES(lines):  # noqa: N802 (a per-class constant that needs the engine's lines)
        return (
            f"labels: the engine's roll of the padded stream and split of it ({ENGINE}:"
            f"{lines['roll'][0]}-{lines['roll'][1]}); the tokens' split and the labels' split "
            "checked on every rank (AReaL shards no positions and no loss mask)",
        )

    def contract_function(self, options: dict) -> Callable:
        release = self.release
        cache: dict = {}

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            key = (tuple(tuple(s.tolist()) for s in sequences), cp_size, tp_size)
            if key not in cache:
                cache.clear()
                values = [s.to(torch.int64) for s in sequences]
                cache[key] = micro_batch(
                    release.modules, release.statements, values, cp_size, tp_size, options
                )[0]
            tokens, labels, layout = split_on_rank(
                release.modules, release.statements, cache[key], cp_size, cp_rank, tp_size
            )
            # The engine's trailing padding sequence sits last on every rank: the contract's
            # layout is the drawn sequences, so this rank's slots of it are left out.
            n = len(sequences)
            local = int(layout[n]) // cp_size
            return {
                "input_ids": tokens[:local],
                "labels": labels[:local],
                "cu_seqlens_padded": layout[: n + 1],
            }

        return per_rank

    def reproducer(self, finding: Finding) -> str:
        return self._reproducer(finding, "split_outputs", "split_problems(outputs, CASE)")

    def truth_outputs(self, finding: Finding):
        case = finding.case
        sequences = case_values(case["lengths"])
        batch = global_batch(sequences, case["cp"], case["tp"])
        ranks = []
        for rank in range(case["cp"]):
            index = zigzag_index(batch.cu_seqlens_padded, case["cp"], rank)
            ranks.append({"input_ids": batch.input_ids[index], "labels": batch.labels[index]})
        return {"error": None, "cu": batch.cu_seqlens_padded.tolist(), "ranks": ranks}


@dataclass
class ReassemblyChecked(_ArealChecked, Checked):
    """Every rank's shard gathered back and unpadded as the engine does: the original tensor."""

    KIND = "reassembly"
    release: Release | None = None
    def_line: int = 0
    function_name: str = ""
    mutated: str | None = None

    @staticmethod
    def NOTES(lines):  # noqa: N802
        return (
            "round trip: a per-token tensor sharded by the release's split on every rank, "
            f"gathered and unpadded by the engine's own statements ({ENGINE}:"
            f"{lines['gather'][0]}-{lines['gather'][1]}), the all-gather a stand-in",
        )

    def finding(self, case, options: dict) -> Finding | None:
        case = _case(case)
        outputs = reassembly_outputs(self.release.modules, self.release.statements, case, options)
        return _finding(case, options, _worst(reassembly_problems(outputs, case), case))

    def reproducer(self, finding: Finding) -> str:
        return self._reproducer(finding, "reassembly_outputs", "reassembly_problems(outputs, CASE)")

    def truth_outputs(self, finding: Finding):
        seqs = case_values(finding.case["lengths"])
        values = torch.tensor([t for s in seqs for t in s], dtype=torch.float64)
        return {"error": None, "ranks": [values.clone() for _ in range(finding.case["cp"])]}


@dataclass
class PostprocessChecked(_ArealChecked, Checked):
    """postprocess on every rank's shard: the input (not the last stage), the shard (no
    gather) or the whole padded stream (gathered)."""

    KIND = "postprocess"
    release: Release | None = None
    def_line: int = 0
    function_name: str = ""
    mutated: str | None = None

    @staticmethod
    def NOTES(lines):  # noqa: N802
        return (
            "round trip: a [1, T/cp, V] tensor sharded by the release's split on every rank, "
            "gathered back by postprocess (the all-gather a stand-in); the engine itself "
            "passes gather_output = not cp_local, so it gathers only without CP",
        )

    def finding(self, case, options: dict) -> Finding | None:
        case = _case(case)
        outputs = postprocess_outputs(self.release.modules, self.release.statements, case, options)
        return _finding(case, options, _worst(postprocess_problems(outputs, case, options), case))

    def reproducer(self, finding: Finding) -> str:
        return self._reproducer(
            finding, "postprocess_outputs", "postprocess_problems(outputs, CASE, OPTIONS)"
        )

    def truth_outputs(self, finding: Finding):
        case, options = finding.case, dict(finding.options)
        width = options.get("output_width", 3)
        batch = global_batch(case_values(case["lengths"]), case["cp"], case["tp"])
        cu = batch.cu_seqlens_padded
        full = batch.input_ids.to(torch.float64)[:, None] + torch.arange(width) / 4
        ranks = []
        for rank in range(case["cp"]):
            shard = full[zigzag_index(cu, case["cp"], rank)].unsqueeze(0)
            if not options.get("post_process", True):
                out = shard
            elif options.get("gather_output", True) and options.get("pass_cu_seqlens", True):
                out = full
            else:
                out = shard.squeeze(0)
            ranks.append({"input": shard, "output": out.clone()})
        return {"error": None, "cu": cu.tolist(), "ranks": ranks}


LIBRARY = Library(
    DISTRIBUTION,
    (
        ArealTarget("preprocess_packed_seqs_context_parallel", kind="split"),
        ArealTarget("reassemble_cp_packed_logprobs", kind="reassembly"),
        ArealTarget("postprocess_packed_seqs_context_parallel", kind="postprocess"),
    ),
    releases=("1.0.4",),
)
