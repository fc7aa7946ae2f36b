"""fla-core's `get_cp_cu_seqlens` (flash-linear-attention's CP context), checked per rank.

flash-linear-attention's context parallelism (`fla/ops/cp/context.py`, wheel fla_core, not
flash-linear-attention) never splits tensors itself: the caller cuts the packed stream of T
tokens and `build_cp_context(cu_seqlens, group, ...)` (context.py:277) calls
`get_cp_cu_seqlens` (context.py:174-274), which returns an `FLACPContext` per rank: the local
cu_seqlens the linear-attention kernels run on and the metadata that passes recurrent states
and conv1d edges between ranks. It needs no process group when given `world_size` and `rank`.

Layouts (context.py:198-208, 230, the docstring at 299-302): "contiguous" (the default) cuts the
whole stream into W parts of T / W tokens, rank r holding part r; "zigzag" cuts the whole stream
(not each sequence) into 2W parts of T / 2W tokens, rank r holding parts r and 2W-1-r as
[front; back]. The parts form a chain (slots 0..2W-1 in stream order) along which states pass.
T must be a multiple of the part count (ValueError, context.py:202-207): the caller pads the
stream, as the input option `padding` says.

Ground truth (independent of the library: per token, which sequence and which part holds it),
per rank and per part of it:
- `cu_seqlens` and `cu_seqlens_cpu`: one local segment per piece of a sequence in the part, in
  order, every local token in exactly one segment, the boundaries at the sequence boundaries and
  the part's edges (zigzag: the back part's segments offset by the part length);
- `pre_num_ranks` (`_by_part`): how many earlier chain slots hold tokens of the sequence of the
  part's first token (the states it merges); `is_first_rank`: none does;
- `post_num_ranks` (`_by_part`): how many later slots hold tokens of the sequence of the part's
  last token; `is_last_rank`: none does;
- `pre_num_conv_tokens` (`_by_part`): the tokens of the first token's sequence before the part
  (the conv1d history there is);
- zigzag: `part_len` = T / 2W, `front_num_seqs` = the front part's segments, `layout`.

Impact: a real local token in no segment -> real tokens lost; a real token in a wrong segment,
or a wrong state/conv field for a real sequence (it starts from a wrong state) -> real tokens
misplaced; the call raising -> raises; only the padding sequence wrong -> padding only.

Options of `get_cp_cu_seqlens(cu_seqlens, cu_seqlens_cpu, world_size, rank, group,
conv1d_kernel_size, use_tf32x3_affine_chain, layout, **kwargs)`:
- `layout`: drawn ("contiguous", the default, and "zigzag").
- `cu_seqlens`: the drawn lengths packed (int32), padded to a multiple of W (2W for zigzag).
  How is the input option `padding`, drawn: "own_sequence" (the default) appends the padding as
  a sequence of its own; "last_sequence" adds it to the last sequence.
- `cu_seqlens_cpu`: None (the function copies `cu_seqlens`, context.py:194-196).
- `world_size`, `rank`: each case calls every rank of the drawn world size (2/4/8); `group`:
  None (with `world_size` given it is only stored).
- `conv1d_kernel_size`: None: it is stored unchanged (context.py:226, 265) and no output
  depends on it (the conv path's `part_len >= kernel-1` assert is a kernel-side matter).
- `use_tf32x3_affine_chain`: True: False raises by design (context.py:23-27).
- `kwargs`: none: any raises TypeError by design (context.py:28-29).
Any other option refuses the check (UpstreamUnavailable).

Stubs: context.py is loaded alone by path (not `fla.ops.cp`, whose package import needs triton
and einops); its one library import, `fla.utils` (context.py:16), is a placeholder with
`IS_NPU = IS_NVIDIA = False` (read only by `_check_cp_device`, which the function never calls)
and `tensor_cache` = identity: the release's decorator memoises the last calls by argument
identity (fla/utils/decorators.py:33-78); identity means every call is computed, as with the
release's FLA_DISABLE_TENSOR_CACHE=1. The module's own private name is a placeholder in
sys.modules while it runs, because `@dataclass` on `FLACPContext` (context.py:42) looks its
module up there to read its string annotations; the module is left unregistered afterwards.

Findings: none. fla-core 0.6.0 passes (searched at 400 cases each mode, both layouts and both
paddings); the tests pin that and a negative control (context.py:163 `last_pos` read one token
late) that the search flags on lengths [1], world size 2.
"""

from __future__ import annotations

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import Finding, Library
from recipe.checks.upstream.kit.module_checked import (
    ModuleChecked,
    ModuleTarget,
    each_rank,
    packed_cu_seqlens,
)
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import partition_options
from recipe.upstream.source import load_module

FILE = "fla/ops/cp/context.py"
FUNCTION = "get_cp_cu_seqlens"
HELPER = "_interval_cp_meta"
DEFAULTS = {"layout": "contiguous", "padding": "own_sequence"}
DRAWN = {"layout": ("contiguous", "zigzag"), "padding": ("own_sequence", "last_sequence")}
FIXED = {
    "cu_seqlens": "the drawn lengths packed, int32, padded to a multiple of the part count "
    "(the padding as the input option `padding` says)",
    "cu_seqlens_cpu": "None: the function copies cu_seqlens (context.py:194-196)",
    "world_size": "the drawn world size (2, 4, 8)",
    "rank": "every rank of the drawn world size, one process playing each",
    "group": "None: with world_size given it is only stored",
    "conv1d_kernel_size": "None: stored unchanged, no output depends on it (context.py:226, 265)",
    "use_tf32x3_affine_chain": "True: False raises by design (context.py:23-27)",
    "kwargs": "none: any raises TypeError by design (context.py:28-29)",
}
# What each case does besides the call, printed under the check's header.
NOTES = (
    "each case calls every rank of the world size; truth per token: its sequence and the part "
    "holding it (contiguous: W parts, zigzag: 2W parts of the whole stream)",
    "padding: own_sequence = a padding sequence of its own; last_sequence = added to the last "
    "sequence (T must divide into the parts, context.py:202-207)",
)
# The negative control: a part's last sequence located from its end, not its last token, so a
# sequence ending at a part's edge reads as running on into the next part.
CONTROL_LINE = "last_pos = (last_seq_global_end - 1) // part_len"
CONTROL_REPLACEMENT = "last_pos = last_seq_global_end // part_len"


def tensor_cache(fn):
    """fla.utils' `tensor_cache` as identity: every call computed (see the docstring)."""
    return fn


def context_stubs(own_name):
    """The stubs context.py loads with (the docstring's), and its own module name."""
    return {
        "fla": {},
        "fla.utils": {"IS_NPU": False, "IS_NVIDIA": False, "tensor_cache": tensor_cache},
        own_name: {},  # for @dataclass
    }


# ---- The model. Plain Python (and torch for the call): the reproducer carries this source,
# with the stubs and the functions below that load the release and check its outputs.

SCALARS = ("pre_num_ranks", "post_num_ranks", "is_first_rank", "is_last_rank",
           "pre_num_conv_tokens")  # fmt: skip
BY_PART = ("pre_num_ranks_by_part", "post_num_ranks_by_part", "is_first_by_part",
           "is_last_by_part", "pre_num_conv_tokens_by_part")  # fmt: skip


def call_outputs(function, bounds, world_size, layout):
    """Every rank's context, JSON-able: its fields, or what it raised."""
    import torch

    def fields(rank):
        cu = torch.tensor(bounds, dtype=torch.int32)
        ctx = function(cu, world_size=world_size, rank=rank, layout=layout)
        out = {"layout": ctx.layout, "conv1d_kernel_size": ctx.conv1d_kernel_size}
        for name in ("cu_seqlens", "cu_seqlens_cpu"):
            value = getattr(ctx, name)
            out[name] = None if value is None else [int(v) for v in value.tolist()]
        names = SCALARS if layout == "contiguous" else (*BY_PART, "part_len", "front_num_seqs")
        for name in names:
            value = getattr(ctx, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    return each_rank(fields, world_size)


def stream_bounds(lengths, world_size, layout, padding):
    """The cu_seqlens passed: `lengths` packed, padded to a multiple of the part count."""
    parts = world_size * (1 if layout == "contiguous" else 2)
    return packed_cu_seqlens(lengths, parts, padding)


def slots_of_rank(rank, world_size, layout):
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def part_truth(bounds, slot, part_len):
    """(segments as (seq, local lo, local hi), pre, post, conv) of chain slot `slot`, from
    the sequence of every token."""
    seq_of = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    lo = slot * part_len
    segments = []
    for i in range(part_len):
        if segments and segments[-1][0] == seq_of[lo + i]:
            segments[-1][2] = i + 1
        else:
            segments.append([seq_of[lo + i], i, i + 1])
    first, last = segments[0][0], segments[-1][0]
    pre = len({t // part_len for t in range(bounds[first], bounds[first + 1])} & set(range(slot)))
    later = {t // part_len for t in range(bounds[last], bounds[last + 1])}
    post = len({s for s in later if s > slot})
    return [tuple(s) for s in segments], pre, post, lo - bounds[first]


def reference_outputs(bounds, world_size, layout):
    """What a correct function returns on every rank, in `call_outputs`' structure."""
    parts = world_size * (1 if layout == "contiguous" else 2)
    part_len = bounds[-1] // parts
    outputs = []
    for rank in range(world_size):
        cu, fields = [0], {name: [] for name in BY_PART}
        front = None
        for k, slot in enumerate(slots_of_rank(rank, world_size, layout)):
            segments, pre, post, conv = part_truth(bounds, slot, part_len)
            cu += [k * part_len + hi for _, _, hi in segments]
            front = len(segments) if front is None else front
            for name, value in zip(BY_PART, (pre, post, pre == 0, post == 0, conv)):
                fields[name].append(value)
        out = {"layout": layout, "conv1d_kernel_size": None, "cu_seqlens": cu,
               "cu_seqlens_cpu": list(cu)}  # fmt: skip
        if layout == "contiguous":
            out.update({a: fields[b][0] for a, b in zip(SCALARS, BY_PART)})
        else:
            out.update(fields, part_len=part_len, front_num_seqs=front)
        outputs.append(out)
    return outputs


def context_problems(outputs, lengths, bounds, world_size, layout):
    """(level, message) per problem: 4 = a real local token in no segment, 3 = a real token in a
    wrong segment or a wrong state/conv field of a real sequence, 2 = a raise, 1 = padding only.
    Local tokens are 0-based in [front; back]; global tokens in the packed stream."""
    real = sum(lengths)
    real_seqs = len(lengths)  # the padding sequence (own_sequence) is the one past them
    truth = reference_outputs(bounds, world_size, layout)
    parts = world_size * (1 if layout == "contiguous" else 2)
    part_len = bounds[-1] // parts
    found = []
    for rank, (out, want) in enumerate(zip(outputs, truth)):
        if "raises" in out:
            found.append((2, f"rank {rank} raises {out['raises']}"))
            continue
        slots = slots_of_rank(rank, world_size, layout)
        glob = [s * part_len + i for s in slots for i in range(part_len)]
        seqs = [part_truth(bounds, s, part_len) for s in slots]
        first_real = [segs[0][0] < real_seqs for segs, *_ in seqs]
        last_real = [segs[-1][0] < real_seqs for segs, *_ in seqs]
        for name in ("cu_seqlens", "cu_seqlens_cpu"):
            got, exp = out[name], want[name]
            if got == exp:
                continue
            ok = got and got[0] == 0 and all(a <= b for a, b in zip(got, got[1:]))
            if ok and got[-1] < len(glob):  # the local tokens past the last segment
                level = 4 if any(t < real for t in glob[got[-1] :]) else 1
                lost = f"local tokens {got[-1]}..{len(glob) - 1} in no segment"
                found.append((level, f"rank {rank}: {name} {got} leaves {lost} (expected {exp})"))
                continue
            if not ok or got[-1] > len(glob):
                level = 3 if any(t < real for t in glob) else 1
                found.append((level, f"rank {rank}: {name} {got} is no split of its "
                              f"{len(glob)} local tokens (expected {exp})"))  # fmt: skip
                continue
            segs_got = [(a, b) for a, b in zip(got, got[1:])]
            segs_exp = [(a, b) for a, b in zip(exp, exp[1:])]
            bad = [i for i in range(len(glob)) if
                   [s for s in segs_got if s[0] <= i < s[1]] != [s for s in segs_exp
                                                                 if s[0] <= i < s[1]]]  # fmt: skip
            worst = 3 if any(glob[i] < real for i in bad) or not bad else 1
            where = f"local token {bad[0]} (token {glob[bad[0]]})" if bad else "an empty segment"
            found.append((worst, f"rank {rank}: {name} {got}, expected {exp} ({where} "
                          "in a wrong segment)"))  # fmt: skip
        for name in sorted(set(want) - {"cu_seqlens", "cu_seqlens_cpu"}):
            if out.get(name) == want[name]:
                continue
            if name in SCALARS or name in BY_PART:
                ends = first_real if "pre" in name or "first" in name else last_real
                differs = [k for k in range(len(slots)) if layout == "contiguous"
                           or out[name] is None or out[name][k] != want[name][k]]  # fmt: skip
                level = 3 if any(ends[k] for k in differs) else 1
            else:
                level = 3 if any(t < real for t in glob) else 1
            found.append((level, f"rank {rank}: {name} {out.get(name)}, expected {want[name]}"))
    return found


def released_outputs(wheel, case, options):
    """Every rank's context from the release in `wheel`, on the case."""
    module = load_from_wheel(wheel, FILE, context_stubs("released_context"))
    bounds = stream_bounds(case["lengths"], case["world_size"], options["layout"],
                           options["padding"])  # fmt: skip
    return call_outputs(getattr(module, FUNCTION), bounds, case["world_size"], options["layout"])


def released_problems(outputs, case, options):
    bounds = stream_bounds(case["lengths"], case["world_size"], options["layout"],
                           options["padding"])  # fmt: skip
    found = context_problems(outputs, case["lengths"], bounds, case["world_size"],
                             options["layout"])  # fmt: skip
    return [message for _, message in found]


def signature_options(function, label: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """(drawn, fixed) for the function's signature; an option not known refuses the check."""
    drawn, skipped = partition_options(function, label, __name__, FIXED, DRAWN)
    return {**drawn, "padding": DRAWN["padding"]}, skipped  # padding: an input option


class ContextChecked(ModuleChecked):
    """`get_cp_cu_seqlens` of one release, loaded."""

    function_name = FUNCTION
    defaults = DEFAULTS
    shipped = (tensor_cache, context_stubs, packed_cu_seqlens, each_rank, stream_bounds,
               call_outputs, slots_of_rank, part_truth, reference_outputs, context_problems,
               released_outputs, released_problems)  # fmt: skip
    title = "each rank's local cu_seqlens and state/conv metadata"

    def case_problems(self, lengths, world_size, chosen):
        bounds = stream_bounds(lengths, world_size, chosen["layout"], chosen["padding"])
        outputs = call_outputs(self.function, bounds, world_size, chosen["layout"])
        return bounds, context_problems(outputs, lengths, bounds, world_size, chosen["layout"])

    def broken_module(self):
        return layouts.mutated_copy(self.module, (HELPER, FUNCTION), HELPER, CONTROL_LINE,
                                    CONTROL_REPLACEMENT, self.label)  # fmt: skip

    def shipped_constants(self) -> dict:
        return {"FILE": FILE, "FUNCTION": FUNCTION, "SCALARS": SCALARS, "BY_PART": BY_PART}

    def truth_outputs(self, finding: Finding):
        options = self.chosen_options(dict(finding.options))
        world_size = finding.case["world_size"]
        bounds = stream_bounds(finding.case["lengths"], world_size, options["layout"],
                               options["padding"])  # fmt: skip
        return reference_outputs(bounds, world_size, options["layout"])


def load_release(path, library: str, version: str):
    name = f"recipe_upstream_{library}_{version}_context".replace(".", "_").replace("-", "_")
    return load_module(path, name, context_stubs(name))  # see the docstring


TARGET = ModuleTarget(FUNCTION, FILE, ContextChecked, NOTES, load_release, signature_options)
LIBRARY = Library("fla-core", (TARGET,), releases=("0.6.0",))
