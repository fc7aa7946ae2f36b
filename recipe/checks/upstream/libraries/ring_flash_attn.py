"""ring-flash-attn's `llama3_flash_attn_prepare_cu_seqlens`, checked as attention spans.

The llama3 variant of ring attention (ring-flash-attn's `llama3_flash_attn_varlen.py`, what
OpenRLHF's context parallelism runs) splits the packed stream of T tokens (T a multiple of the
world size) into world_size contiguous pieces of T / world_size tokens. Each rank all-gathers
K/V over the group (the whole stream, in rank order), slices out `local_k_slice`, and calls
flash-attn's varlen kernel with its local queries and the returned `cu_seqlens_q`,
`cu_seqlens_k`, `max_seqlen_q`, `max_seqlen_k`. The prepare function computes those five values
from the global `cu_seqlens`; it is pure torch.

Ground truth (independent of the library): every query token at global index g, in the sequence
[start, end) of the `cu_seqlens` the caller passes, attends exactly to the keys [start, g]
(causal) or [start, end) (not causal), whichever rank it is on.

What the kernel computes from the returned values (flash-attn's documented varlen semantics,
`flash_attn_varlen_func`'s docstring, flash-attn >= 2.1): batch entry b has the local queries
[cu_q[b], cu_q[b+1]) and the keys [cu_k[b], cu_k[b+1]) of `k[local_k_slice]`; with causal the
mask is aligned to the bottom right corner, so query i of the entry (0-based, seqlen_q rows,
seqlen_k keys) attends to keys j <= i + seqlen_k - seqlen_q (a row with no key left gives zero);
without causal to all of the entry's keys. `max_seqlen_q` / `max_seqlen_k` are "the maximum
query/key sequence length in the batch": the kernel launches max_seqlen_q rows per entry, so a
longer entry's later queries are never computed; an understated max_seqlen_k breaks the same
documented contract and is reported like a wrong key set. flash-attn refuses cu_seqlens that are
not int32 or not of the same length (its CHECKs), which is a raise. A key past the rows that
`local_k_slice` leaves of the gathered stream is an out-of-bounds read.

Impact, per local query: computed by no batch entry of its rank (so by no rank) -> real tokens
lost; a wrong key set (a key of another sequence, a future key, a missing key of its own
sequence, an out-of-bounds key, no key at all) -> real tokens misplaced; the call raising, or
returning what flash-attn refuses -> raises; only padding queries wrong -> padding only.

Options of `llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size)`:
- `causal`: drawn (True, False); the default mode uses True, the value the library's own caller
  `update_ring_flash_attn_params` passes (adapters/hf_adapter.py:51), which OpenRLHF calls.
- `rank`, `world_size`: fixed: each case calls every rank of the drawn world size (2/4/8).
- `cu_seqlens`: fixed: the drawn lengths packed (int32, as flash-attn's `unpad_input` returns
  them to OpenRLHF), with the stream padded to a multiple of the world size. How is the input
  option `padding`, drawn: "last_sequence" (the default) is OpenRLHF's way (0.8.4 to 0.11.2,
  `ring_attn_utils.py` `cu_seqlens[-1] += ring_attn_pad_len`): the padding joins the last real
  sequence; "own_sequence" appends it as a sequence of its own. Padding tokens are the tokens
  past sum(lengths); under causal attention the last sequence's real tokens never see them.
  The truth follows the cu_seqlens passed, so with causal=False and OpenRLHF's padding the last
  sequence's real tokens see the padding keys in the truth too: that is the caller's padding,
  not this function (and the library's HF adapter asserts causal, hf_adapter.py:142).
Any other option refuses the check (UpstreamUnavailable): a new option may change the layout.

Stubs: the file imports `flash_attn.flash_attn_interface` (the kernels, called only by the
forward/backward functions, not by the prepare function) and `.utils` (`get_default_args` and
`AllGatherComm`, used only by those functions too); both are inert placeholders. The file is
loaded as a module of a private package so that its relative import resolves to the stub.
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

FILE = "ring_flash_attn/llama3_flash_attn_varlen.py"
FUNCTION = "llama3_flash_attn_prepare_cu_seqlens"
DEFAULTS = {"causal": True, "padding": "last_sequence"}
DRAWN = {"causal": (True, False), "padding": ("last_sequence", "own_sequence")}
FIXED = {
    "cu_seqlens": "the drawn lengths packed, int32, padded to a multiple of the world size "
    "(the padding as the input option `padding` says)",
    "rank": "every rank of the drawn world size, one process playing each",
    "world_size": "the drawn world size (2, 4, 8)",
}
# What each case does besides the call, printed under the check's header.
NOTES = (
    "each case calls every rank of the world size; the spans are those flash-attn's varlen "
    "kernel computes from the outputs (bottom-right causal alignment)",
    "padding: last_sequence = OpenRLHF's (the stream's padding joins the last sequence); "
    "own_sequence = a padding sequence of its own",
)
# The break the negative control makes: each rank's last sequence keeps one key past the rank's
# own tokens (an inclusive end read as exclusive), so its last query sees a future token.
CONTROL_LINE = "slice_right = (rank + 1) * length_per_rank"


# ---- The span model. Plain Python (and torch for the call), so that the reproducer carries the
# same code (`PrepareChecked.shipped`: these functions' own source), with the stubs and the
# functions below that load the release and check its outputs.


def prepare_stubs(package):
    """The stubs the file loads with (the docstring's), `package` the private package it is
    loaded in (its `from .utils import` needs one)."""
    return {"flash_attn": {}, "flash_attn.flash_attn_interface": {}, package: {},
            package + ".utils": {}}  # fmt: skip


def call_outputs(function, bounds, causal, world_size):
    """What every rank's call returns, JSON-able: its fields, or what it raised."""
    import torch

    def fields(rank):
        returned = function(torch.tensor(bounds, dtype=torch.int32), causal, rank, world_size)
        cu_q, cu_k, max_q, max_k, local = returned
        return {
            "cu_seqlens_q": [int(v) for v in cu_q.tolist()],
            "cu_seqlens_k": [int(v) for v in cu_k.tolist()],
            "dtype_q": str(cu_q.dtype).removeprefix("torch."),
            "dtype_k": str(cu_k.dtype).removeprefix("torch."),
            "max_seqlen_q": int(max_q),
            "max_seqlen_k": int(max_k),
            "local_k_slice": [
                None if v is None else int(v) for v in (local.start, local.stop, local.step)
            ],
        }

    return each_rank(fields, world_size)


def kernel_spans(out, per_rank, total, causal):
    """(per local query: the global key ranges flash-attn's varlen kernel gives it, one per batch
    entry computing it; problems that are not one query's). A range is (lo, hi) of global
    token indices, or a string naming what the kernel would do instead."""
    cu_q, cu_k = out["cu_seqlens_q"], out["cu_seqlens_k"]
    spans = [[] for _ in range(per_rank)]
    problems = []
    # the rows k[local_k_slice] keeps of the gathered stream, as Python slicing keeps them
    rows = range(total)[slice(*out["local_k_slice"])]
    for b in range(len(cu_q) - 1):
        q_lo, q_hi, k_lo, k_hi = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        seqlen_q, seqlen_k = max(q_hi - q_lo, 0), max(k_hi - k_lo, 0)
        if q_lo + seqlen_q > per_rank:
            problems.append(
                f"batch entry {b} has query rows [{q_lo}, {q_hi}) past the {per_rank} local "
                "queries (the kernel reads q and writes out out of bounds)"
            )
        understated = seqlen_k > out["max_seqlen_k"]
        for i in range(min(seqlen_q, out["max_seqlen_q"])):
            row = q_lo + i
            if not 0 <= row < per_rank:
                continue
            last = seqlen_k if not causal else min(seqlen_k, i + seqlen_k - seqlen_q + 1)
            if last <= 0:
                spans[row].append("no key (a zero output)")
                continue
            first, last = k_lo, k_lo + last  # rows of k[local_k_slice]
            if understated:
                spans[row].append(f"max_seqlen_k {out['max_seqlen_k']} < its {seqlen_k} keys")
            if first < 0 or last > len(rows):
                spans[row].append(f"k rows [{first}, {last}) of {len(rows)} (out of bounds)")
            elif rows.step != 1:
                spans[row].append(f"k rows of a slice with step {rows.step}")
            else:
                spans[row].append((rows.start + first, rows.start + last))
    return spans, problems


def refused(out):
    """Why flash-attn's varlen forward would refuse this output, or None."""
    if out["dtype_q"] != "int32" or out["dtype_k"] != "int32":
        return f"cu_seqlens are {out['dtype_q']}/{out['dtype_k']}: flash-attn requires int32"
    if len(out["cu_seqlens_q"]) != len(out["cu_seqlens_k"]) or len(out["cu_seqlens_q"]) < 2:
        return (
            f"cu_seqlens_q has {len(out['cu_seqlens_q'])} entries, cu_seqlens_k "
            f"{len(out['cu_seqlens_k'])}: flash-attn requires batch_size + 1 in both"
        )
    return None


def span_problems(outputs, lengths, world_size, causal, padding):
    """(level, message) per problem, level 4 = a real query computed on no rank, 3 = a real
    query with a wrong key set, 2 = a call raises or returns what flash-attn refuses, 1 = only
    padding queries wrong. Key ranges are global token indices [lo, hi)."""
    import bisect

    bounds = packed_cu_seqlens(lengths, world_size, padding)
    total, real = bounds[-1], sum(lengths)
    per_rank = total // world_size
    found = []

    def shown(spans):
        return " + ".join(s if isinstance(s, str) else f"[{s[0]}, {s[1]})" for s in spans)

    for rank, out in enumerate(outputs):
        if "raises" in out:
            found.append((2, f"rank {rank} raises {out['raises']}"))
            continue
        why = refused(out)
        if why is not None:
            found.append((2, f"rank {rank}: {why}"))
            continue
        got, problems = kernel_spans(out, per_rank, total, causal)
        found += [(3, f"rank {rank}: {p}") for p in problems]
        for row in range(per_rank):
            token = rank * per_rank + row
            seq = bisect.bisect_right(bounds, token) - 1
            start, end = bounds[seq], bounds[seq + 1]
            want = (start, token + 1) if causal else (start, end)
            if got[row] == [want]:
                continue
            is_real = token < real
            name = f"sequence {seq}" if seq < len(lengths) else "the padding sequence"
            where = (
                f"rank {rank}, local query {row} (token {token}: {name}, position "
                f"{token - start}{'' if is_real else ', padding'})"
            )
            if not got[row]:
                level, what = (4 if is_real else 1), "computed by no batch entry of its rank"
            else:
                level, what = (3 if is_real else 1), f"keys {shown(got[row])}"
            found.append((level, f"{where}: keys expected [{want[0]}, {want[1]}), got: {what}"))
    return found


def reference_outputs(lengths, world_size, causal, padding):
    """What a correct prepare function returns on every rank (not the release's way: the
    sequences overlapping the rank's tokens, listed directly)."""
    bounds = packed_cu_seqlens(lengths, world_size, padding)
    per_rank = bounds[-1] // world_size
    outputs = []
    for rank in range(world_size):
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        seqs = [(s, e) for s, e in zip(bounds, bounds[1:]) if s < hi and e > lo]
        k_start = seqs[0][0]
        q_ends = [min(e, hi) - lo for _, e in seqs]
        k_ends = [(min(e, hi) if causal else e) - k_start for _, e in seqs]
        cu_q, cu_k = [0, *q_ends], [0, *k_ends]
        outputs.append(
            {
                "cu_seqlens_q": cu_q,
                "cu_seqlens_k": cu_k,
                "dtype_q": "int32",
                "dtype_k": "int32",
                "max_seqlen_q": max(b - a for a, b in zip(cu_q, cu_q[1:])),
                "max_seqlen_k": max(b - a for a, b in zip(cu_k, cu_k[1:])),
                "local_k_slice": [k_start, k_start + cu_k[-1], None],
            }
        )
    return outputs


def released_outputs(wheel, case, options):
    """What every rank's call of the release in `wheel` returns, on the case."""
    package = "released_ring_flash_attn"
    module = load_from_wheel(wheel, FILE, prepare_stubs(package), package=package)
    bounds = packed_cu_seqlens(case["lengths"], case["world_size"], options["padding"])
    return call_outputs(getattr(module, FUNCTION), bounds, options["causal"], case["world_size"])


def released_problems(outputs, case, options):
    found = span_problems(outputs, case["lengths"], case["world_size"], options["causal"],
                          options["padding"])  # fmt: skip
    return [message for _, message in found]


def signature_options(function, label: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """(drawn, fixed) for the function's signature; an option not known refuses the check."""
    drawn, skipped = partition_options(function, label, __name__, FIXED, DRAWN)
    return {"padding": DRAWN["padding"], **drawn}, skipped  # padding: an input option


class PrepareChecked(ModuleChecked):
    """`llama3_flash_attn_prepare_cu_seqlens` of one release, loaded. Its cases: the ring group
    is the CP group; tp does not change what this function returns."""

    function_name = FUNCTION
    defaults = DEFAULTS
    shipped = (prepare_stubs, packed_cu_seqlens, each_rank, call_outputs, kernel_spans, refused,
               span_problems, reference_outputs, released_outputs, released_problems)  # fmt: skip
    title = "the attention spans its outputs give flash-attn's varlen kernel"

    def case_problems(self, lengths, world_size, chosen):
        bounds = packed_cu_seqlens(lengths, world_size, chosen["padding"])
        outputs = call_outputs(self.function, bounds, chosen["causal"], world_size)
        found = span_problems(outputs, lengths, world_size, chosen["causal"], chosen["padding"])
        return bounds, found

    def broken_module(self):
        return layouts.mutated_copy(
            self.module, (FUNCTION,), FUNCTION, CONTROL_LINE, CONTROL_LINE + " + 1", self.label
        )

    def shipped_constants(self) -> dict:
        return {"FILE": FILE, "FUNCTION": FUNCTION}

    def truth_outputs(self, finding: Finding):
        options = self.chosen_options(dict(finding.options))
        case = finding.case
        return reference_outputs(
            case["lengths"], case["world_size"], options["causal"], options["padding"]
        )


def load_release(path, library: str, version: str):
    package = f"recipe_upstream_{library}_{version}".replace(".", "_").replace("-", "_")
    return load_module(path, f"{package}.llama3_flash_attn_varlen", prepare_stubs(package))


TARGET = ModuleTarget(FUNCTION, FILE, PrepareChecked, NOTES, load_release, signature_options)
LIBRARY = Library("ring-flash-attn", (TARGET,), releases=("0.1.8",))
