"""torch's own context-parallel load balancers (`torch/distributed/tensor/experimental/
_context_parallel/_load_balancer.py`, private classes of the installed torch), checked on every
rank's shard.

torch's CP rearranges every buffer with a load balancer's index before it shards it with
`Shard(seq_dim)`, i.e. `torch.chunk`: rank r holds the r-th of world_size contiguous pieces of
`buffer[rearrange]` (`_attention.py` `_context_parallel_buffers`, 2.13.0:1064-1171, the shard
at :1153-1155), and puts the outputs back with the `restore` index. flex_attention's CP block
mask is built from the same rearrange index (`_create_cp_block_mask`, :1174, its
`qkv_idx_restore` at :1250-1263, the index at :1291-1292), so any permutation trains the same
numbers, given what torch itself asks of the shapes (its local-to-global query map, :1272,
counts whole blocks of 128 per rank, which the cases here, of a few tokens, do not model); what
a balancer decides is each rank's share of the attention work.
- `_HeadTailLoadBalancer(seq_length, world_size, device)` (2.14.1:87, 2.13.0:78): the default of
  `context_parallel` for a causal mask when seq_length is a multiple of 2*world_size
  (`_create_default_load_balancer`): rank r takes chunks r and 2W-1-r of 2W chunks.
- `_PerDocumentHeadTailLoadBalancer(seq_length_per_doc, world_size, device)` (2.14.1:176,
  2.13.0:167): for document masks: every document (each a multiple of 2W, asserted) split the
  same way, so every rank holds the head and tail chunks r and 2W-1-r of every document.
- `_PTRRLoadBalancer(block_mask, world_size)` is not checked: it schedules whole mask blocks by
  a greedy heuristic, with no layout or balance it promises to meet.

Ground truth: the rearrange index a permutation of the positions, `restore` its inverse, and
the ranks' shards (`torch.chunk` of the rearranged positions) carrying equal causal attention
work: the query-key pairs of a position are its place in its own document plus one (padding
inside a padded document counts: the document mask covers it). The recipe's zigzag layout
(`recipe/parallel/cp/zigzag.py`, chunks r and 2W-1-r of every document) meets it exactly; a
different permutation with equal work passes too.

Cases: the checker's micro-batches (lengths, world size 2/4/8). Per-document: each document
padded to a multiple of 2W, as the assertion asks (`seq_length_per_doc = [[...]]`, one batch
row). Head-tail: the documents packed as one causal sequence padded to a multiple of 2W (the
plain causal mask `context_parallel` uses it for; under a document mask the whole-sequence split
is unbalanced by design, the reason the per-document balancer exists).

Impact: a position on no rank -> lost; a position twice, or `restore` not undoing the rearrange
(outputs put back in the wrong places) -> misplaced; a raise -> raises; unequal work -> work
unbalanced (numbers unchanged, the slowest rank sets the step time).

Options: none drawn; every parameter fixed (`device` "cpu": the index does not depend on it).
Source: the installed torch (its wheel is hundreds of megabytes: "installed" is the release the
registry lists, and `torch@VERSION` reads the installed file when it is that version).
Negative control (one line): `tail_idx = 2 * world_size - 1 - head_idx` -> `world_size +
head_idx` (rank r takes chunks r and W+r: the later ranks get the later, heavier chunks); in
2.13.0's per-document loop, `2 * world_size - rank` -> `world_size + rank + 1`, and in 2.11.0's
head-tail loop `second_chunk_idx = world_size * 2 - rank - 1` -> `world_size + rank`: the same
break in each release's shape.

Finding in 2.13.0 and 2.11.0 (the legacy and image stacks; tests/test_upstream_torch_load_
balancers.py; fixed in 2.14.1, whose docstring now states the sharding contract):
`_generate_indices_for_batch` lays the indices out document by document (2.13.0:264-288: for
each document, for each rank, head then tail), so `torch.chunk` cuts across documents and rank 0
gets the first documents whole: documents of 4 and 12 tokens at world size 2 give the ranks 26
and 62 query-key pairs, not 44 and 44. The layout is a permutation with a consistent mask, so
the loss is right; the work is not balanced.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from recipe.checks.upstream.kit.checked import Finding, Library, reproducer_source
from recipe.checks.upstream.kit.layouts import mutated_copy, mutated_function
from recipe.checks.upstream.kit.module_checked import ModuleChecked, ModuleTarget
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import partition_options
from recipe.upstream.source import INSTALLED, load_module, public_version

FILE = "torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py"
FIXED = {
    "seq_length": "the case's documents packed as one causal sequence, padded to 2*world_size",
    "seq_length_per_doc": "one batch row: the case's documents, each padded to 2*world_size",
    "world_size": "the drawn world size (2, 4, 8)",
    "device": "cpu (the index does not depend on it)",
}
CONTROL = ("tail_idx = 2 * world_size - 1 - head_idx", "tail_idx = world_size + head_idx")
CONTROL_2_13 = ("2 * world_size - rank", "world_size + rank + 1")  # its per-document loop
CONTROL_2_11 = (
    "second_chunk_idx = world_size * 2 - rank - 1",
    "second_chunk_idx = world_size + rank",
)
# What a reproducer runs (its constants set both for the class of its finding).
CLASS, PER_DOCUMENT = "_PerDocumentHeadTailLoadBalancer", True
NOTES = (
    "every rank's shard: torch.chunk of the rearranged positions, as Shard(seq_dim) cuts them; "
    "the work of a position is its place in its own document plus one",
)


# ---- shipped into reproducers (inspect.getsource): plain Python and torch --------------------


def padded_documents(lengths, world_size, per_document):
    """The documents as the caller hands them over: each padded to a multiple of 2*world_size
    (per document), or all of them as one causal sequence padded so."""
    unit = 2 * world_size
    if per_document:
        return [-(-n // unit) * unit for n in lengths]
    return [-(-sum(lengths) // unit) * unit]


def call_outputs(balancer, lengths, world_size, per_document):
    """The balancer's rearrange and restore indices on the case, JSON-able, or its raise."""
    documents = padded_documents(lengths, world_size, per_document)
    try:
        made = balancer([documents] if per_document else documents[0], world_size, "cpu")
        indices = [made._generate_indices(restore=flag) for flag in (False, True)]
        rearrange, restore = ([int(i) for i in index.reshape(-1)] for index in indices)
    except Exception as err:  # noqa: BLE001 (a raise on a valid input is what is reported)
        return {"documents": documents, "raises": f"{type(err).__name__}: {err}"}
    return {"documents": documents, "rearrange": rearrange, "restore": restore}


def balance_problems(outputs, world_size):
    """(level, message) per problem: 4 = a position on no rank; 3 = a position twice, or restore
    not the inverse; 2 = a raise; 0 = the ranks' causal attention work unequal."""
    if "raises" in outputs:
        return [(2, f"the balancer raises {outputs['raises']}")]
    documents, rearrange, restore = outputs["documents"], outputs["rearrange"], outputs["restore"]
    total = sum(documents)
    missing = sorted(set(range(total)) - set(rearrange))
    if missing:
        return [(4, f"{len(missing)} of {total} positions are in no rank's shard (first: "
                    f"{missing[0]}): they never train")]  # fmt: skip
    if len(rearrange) != total:
        return [(3, f"the rearrange index has {len(rearrange)} entries for {total} positions: "
                    "some are on two ranks")]  # fmt: skip
    found, identity = [], list(range(total))
    if sorted(restore) != identity or [rearrange[i] for i in restore] != identity:
        found.append((3, "restore does not undo the rearrange (x[rearrange][restore] != x): "
                         "outputs go back to the wrong positions"))  # fmt: skip
    place = [p for n in documents for p in range(n)]
    width = total // world_size
    shards = [rearrange[r * width : (r + 1) * width] for r in range(world_size)]
    work = [sum(place[i] + 1 for i in shard) for shard in shards]
    if len(set(work)) > 1:
        found.append((0, f"documents {documents} (padded) on world size {world_size}: the ranks' "
                         f"query-key pairs are {work}, not {sum(work) // world_size} each; rank "
                         f"0 holds positions {sorted(shards[0])}"))  # fmt: skip
    return found


def released_outputs(wheel, case, options):
    """The release's indices on the case, its file read from `wheel` (or installed folder)."""
    module = load_from_wheel(wheel, FILE, {})
    balancer = getattr(module, CLASS)
    return call_outputs(balancer, case["lengths"], case["world_size"], PER_DOCUMENT)


def released_problems(outputs, case, options):
    return [message for _, message in balance_problems(outputs, case["world_size"])][:12]


# ---- the checker's side ----------------------------------------------------------------------


class BalancerChecked(ModuleChecked):
    """One load balancer class of one torch release, loaded. Its cases: (lengths, world size)."""

    defaults: dict = {}
    per_document: bool
    control_method: str  # the method the negative control changes one line of
    shipped = (padded_documents, call_outputs, balance_problems, released_outputs,
               released_problems)  # fmt: skip

    @staticmethod
    def present(value) -> bool:
        return isinstance(value, type)

    @property
    def line(self) -> int:
        lines = Path(self.module.__file__).read_text().splitlines()
        start = f"class {self.function_name}("
        return 1 + next(i for i, text in enumerate(lines) if text.startswith(start))

    def case_problems(self, lengths, size, chosen):
        outputs = call_outputs(self.function, lengths, size, self.per_document)
        return None, balance_problems(outputs, size)

    def broken_module(self):
        """A copy of the module whose class has one line of `control_method` changed."""
        cls = self.function
        method = getattr(cls, self.control_method)
        source = inspect.getsource(method)
        line, replacement = next(
            (c for c in (CONTROL, CONTROL_2_13, CONTROL_2_11) if c[0] in source), CONTROL
        )  # fmt: skip
        changed = {method.__name__: mutated_function(method, line, replacement, self.label)}
        subclass = type(self.function_name, (cls,), changed)
        return mutated_copy(self.module, (), None, line, replacement, self.label,
                            overrides={self.function_name: subclass})  # fmt: skip

    def reproducer_script(self, title: str, finding: Finding, body: str) -> str:
        """The script asks for the public release ("2.13.0", not the local build "2.13.0+cpu"):
        it reads the installed torch when that is the release, else pip fetches it."""
        return reproducer_source(title, finding, body, self.distribution,
                                 public_version(self.version))  # fmt: skip

    def shipped_constants(self) -> dict:
        return {"FILE": FILE, "CLASS": self.function_name, "PER_DOCUMENT": self.per_document}

    def truth_outputs(self, finding: Finding) -> dict:
        """The recipe's zigzag: chunks r and 2W-1-r of every (padded) document on rank r."""
        lengths, size = finding.case["lengths"], finding.case["world_size"]
        documents = padded_documents(lengths, size, self.per_document)
        cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()])
        rearrange = torch.cat([zigzag_index(cu, size, rank) for rank in range(size)])
        return {"documents": documents, "rearrange": rearrange.tolist(),
                "restore": torch.argsort(rearrange).tolist()}  # fmt: skip


class HeadTailChecked(BalancerChecked):
    function_name = "_HeadTailLoadBalancer"
    per_document = False
    control_method = "_generate_indices"
    title = f"every rank's shard of one causal sequence ({FILE})"


class PerDocumentChecked(BalancerChecked):
    function_name = "_PerDocumentHeadTailLoadBalancer"
    per_document = True
    control_method = "_generate_indices_for_batch"
    title = f"every rank's shard of a packed row of documents ({FILE})"


def load_release(path, library: str, version: str):
    name = f"recipe_upstream_{library}_{version}_load_balancer"
    return load_module(path, "".join(c if c.isalnum() else "_" for c in name), {})


def signature_options(function, label: str) -> tuple[dict, dict]:
    return partition_options(function, label, __name__, FIXED)


TARGETS = tuple(
    ModuleTarget(checked.function_name, FILE, checked, NOTES, load_release, signature_options)
    for checked in (HeadTailChecked, PerDocumentChecked)
)
LIBRARY = Library("torch", TARGETS, releases=(INSTALLED,))
