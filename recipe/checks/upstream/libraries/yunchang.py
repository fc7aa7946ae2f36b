"""yunchang's sequence-parallel shard functions, loaded from its PyPI wheel.

`zigzag_extract_local`, `stripe_extract_local` and `basic_extract_local`
(`yunchang/comm/extract_local.py`) cut one dense tensor `[batch, seqlen, ...]` into the shard
one rank of a sequence-parallel group feeds `LongContextAttention`. That group is ring x ulysses,
built by `set_seq_parallel_pg(ulysses_degree, ring_degree, rank, world_size, use_ulysses_low)`
(`yunchang/globals.py`). The attention (`yunchang/hybrid/attn_layer.py`) first all-to-alls q, k, v
over the ulysses group, which concatenates the ulysses ranks' shards in group-rank order
(`comm/all_to_all.py`, `all_to_all_4D`), then runs ring attention over the ring group, whose
ring rank r must then hold:
- basic (`ring/ring_flash_attn.py`): positions [r*s/rd, (r+1)*s/rd), the contiguous block r;
- zigzag (`ring/zigzag_ring_flash_attn.py`): chunks r and 2*rd-1-r of 2*rd equal chunks (its
  causal steps use the first half of a peer's k/v and the second half of its own q);
- stripe (`ring/stripe_flash_attn.py`): positions r, r+rd, r+2rd, ... (a peer's k/v is causal
  with the diagonal when it sits at a lower ring rank, without it otherwise).
So the shard of a rank with ring rank r and ulysses rank u is the u-th of ud equal consecutive
pieces of ring rank r's positions: the ground truth here, written from that reading alone.
A length the layout cannot split (basic and stripe: not a multiple of rd*ud; zigzag: of
lcm(2*rd, rd*ud), or of ud when rd = 1) is judged against the sequence padded at its tail to
the next multiple: the functions take no padding, so a raise is RAISES, a real element on no rank
LOST, one in the wrong slot (or on two ranks) MISPLACED, and ranks holding unequal shards whose
real elements all sit right PADDING (only the missing padding differs; yunchang's exchanges then
get shards of unequal length).

What a case draws: batch 1-2, the sequence length, trailing feature axes (none, one or two),
and (ring degree, ulysses degree) with 2 <= rd*ud <= 8. Every element of the value is a unique
id, so one id names its batch row, position and feature, and a misplaced element cannot match
by accident (the functions have no position output: an id's position is where it came from).

Options (the drawn ones, with their defaults first):
- `use_ulysses_low` (True, False): set_seq_parallel_pg's choice of which degree gets the
  consecutive ranks; the release's own set_seq_parallel_pg builds the groups, which must agree
  with the checker's model of them (ulysses-low: u = g % ud, r = g // ud; else r = g % rd,
  u = g // rd), or the check refuses.
- `dim` (1, 2), zigzag only: the axis it chunks. With dim=2 the value is laid out
  [batch, feature, seqlen, ...] (the sequence on the chunked axis, a feature axis of 1 added to a
  [batch, seqlen] case) and its shard is expected in the same layout.
Fixed: `value` (the drawn tensor); `rank` (each rank g of the group in turn) and `world_size`
(rd*ud) as yunchang's own test passes them (test/test_hybrid_attn.py:201-203), with dp = 1: the
functions lay out one sequence-parallel group, and set_seq_parallel_pg gives every dp group the
same layout offset by dp_rank * rd * ud; `rd`, `ud` the case's degrees (basic takes them in
**kwargs and reads neither); `*args`/`**kwargs` nothing more (the functions read nothing else).
An option of the functions or of set_seq_parallel_pg not named here refuses the check.

Stand-ins, no stubs of called code: `yunchang.globals` is replaced while extract_local.py loads by
a module holding only PROCESS_GROUP, the release's own singleton from its globals.py (loaded by
path, its optional kernel imports made to fail: see OPTIONAL_KERNELS); set_seq_parallel_pg's
`torch.distributed.new_group` returns a group object listing its ranks sorted, as torch's
new_group numbers them; the functions' `dist.get_rank(group)` / `get_world_size(group)` answer
from those lists for the rank being played. One process plays every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
from dataclasses import dataclass, field

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    Finding,
    Library,
    function_line,
    reproducer_source,
)
from recipe.parallel.cp.contract import Impact
from recipe.upstream.releases import unknown_option
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

DISTRIBUTION = "yunchang"
EXTRACT_FILE = "yunchang/comm/extract_local.py"
GLOBALS_FILE = "yunchang/globals.py"
LAYOUTS = {
    "zigzag_extract_local": "zigzag",
    "stripe_extract_local": "stripe",
    "basic_extract_local": "basic",
}
DEGREES = ((2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (3, 1), (1, 3), (2, 3), (3, 2), (2, 4), (4, 2))
FEATURES = ((), (1,), (2,), (4,), (2, 3), (4, 2))

# Parameters of the functions and of set_seq_parallel_pg the checker sets itself, and why.
FIXED = {
    "value": "the drawn [batch, seqlen, *features] tensor of unique ids",
    "rank": "each rank of one sequence-parallel group in turn (dp 1), as yunchang's test passes "
    "it; zigzag reads its ring and ulysses ranks from the groups instead",
    "world_size": "rd * ud, the sequence-parallel degree",
    "rd": "the case's ring degree",
    "ud": "the case's ulysses degree",
    "args": "nothing more is passed",
    "kwargs": "only rd and ud (basic takes them here and reads neither)",
}
PG_FIXED = {
    "sp_ulysses_degree": "the case's ulysses degree",
    "sp_ring_degree": "the case's ring degree",
    "rank": "the rank being played",
    "world_size": "rd * ud: dp 1, every dp group has the same layout",
}
DRAWN = {"use_ulysses_low": (True, False), "dim": (1, 2)}
# globals.py's optional kernel imports (globals.py:83-135), each in try/except ImportError:
# set_seq_parallel_pg uses none, and a found flashinfer makes the module set TORCH_CUDA_ARCH_LIST
# in this process's environment (globals.py:99-108), so they are made to fail while it loads.
OPTIONAL_KERNELS = (
    "flash_attn",
    "flash_attn_interface",
    "flashinfer",
    "aiter",
    "sageattention",
    "spas_sage_attn",
    "torch_npu",
)
IMPACTS = {
    "padding": Impact.PADDING,
    "raises": Impact.RAISES,
    "misplaced": Impact.MISPLACED,
    "lost": Impact.LOST,
}

# The broken copies (negative controls): one line of the release's own source, mutated.
MUTATIONS = {
    "zigzag_extract_local": (
        "value_chunks[2 * rd - r_rank - 1]",
        "value_chunks[2 * rd - r_rank - 2]",
    ),
    "stripe_extract_local": (
        "value = value.transpose(1, 2).reshape(batch_size, seqlen, -1).contiguous()",
        "value = value.reshape(batch_size, seqlen, -1).contiguous()",
    ),
    "basic_extract_local": (
        "value.chunk(world_size, dim=1)[rank]",
        "value.chunk(world_size, dim=1)[rank - 1]",
    ),
}


# The ground truth and the rank runner. Self-contained (torch and math only): a reproducer
# carries their source, so it judges a release exactly as the checker does.


class StandInMissing(RuntimeError):
    """The release asked a stand-in for something it does not play: the checker must learn it."""


class Group:
    """A process group as torch's new_group numbers it: group rank = index in the sorted ranks."""

    def __init__(self, ranks):
        self.ranks = sorted(int(r) for r in ranks)

    def __repr__(self):
        return f"Group({self.ranks})"


class GroupMaker:
    """The `torch` set_seq_parallel_pg sees: only distributed.new_group, returning a Group."""

    def __init__(self):
        self.distributed = self

    def new_group(self, ranks=None, *args, **kwargs):
        return Group(ranks)

    def __getattr__(self, name):
        raise StandInMissing(f"set_seq_parallel_pg asked torch for {name!r}")


class DistOfRank:
    """torch.distributed as the functions see it on rank `rank`: group ranks and sizes."""

    def __init__(self, rank):
        self.rank = rank

    def get_rank(self, group=None):
        if group is None:
            return self.rank
        if self.rank not in group.ranks:
            raise StandInMissing(f"rank {self.rank} asks its rank in {group}, not its own group")
        return group.ranks.index(self.rank)

    def get_world_size(self, group=None):
        if group is None:
            raise StandInMissing("the functions asked the world size of the default group")
        return len(group.ranks)

    def __getattr__(self, name):
        raise StandInMissing(f"the functions asked torch.distributed for {name!r}")


def layout_unit(layout, ring, ulysses):
    """What the length must be a multiple of for `layout` over ring x ulysses ranks."""
    if layout == "zigzag" and ring > 1:
        return math.lcm(2 * ring, ring * ulysses)
    return ring * ulysses


def ring_positions(layout, length, ring, r):
    """The positions ring rank r holds, in order, as the ring attention of `layout` reads them."""
    if layout == "basic":
        block = length // ring
        return list(range(r * block, (r + 1) * block))
    if layout == "zigzag" and ring == 1:
        return list(range(length))  # chunks 0 and 1: the whole sequence, even of odd length
    if layout == "zigzag":
        chunk = length // (2 * ring)
        back = 2 * ring - 1 - r
        return list(range(r * chunk, (r + 1) * chunk)) + list(
            range(back * chunk, (back + 1) * chunk)
        )
    if layout == "stripe":
        return list(range(r, length, ring))
    raise ValueError(f"unknown layout {layout!r}")


def group_ranks(rank, ring, ulysses, ulysses_low):
    """(ring rank, ulysses rank) of rank `rank` of one group, as set_seq_parallel_pg lays them."""
    if ulysses_low:
        return rank // ulysses, rank % ulysses
    return rank % ring, rank // ring


def shard_positions(layout, length, ring, ulysses, r, u):
    """The positions of the rank with ring rank r and ulysses rank u: the u-th of `ulysses`
    consecutive pieces of ring rank r's, which the ulysses all-to-all concatenates in order."""
    held = ring_positions(layout, length, ring, r)
    piece = len(held) // ulysses
    return held[u * piece : (u + 1) * piece]


def value_shape(case, dim):
    """[batch, seqlen, *features], with the sequence on axis `dim` (dim 2: after one feature)."""
    features = list(case["features"])
    if dim == 2 and not features:
        features = [1]
    return [case["batch"], *features[: dim - 1], case["length"], *features[dim - 1 :]]


def make_value(case, dim):
    shape = value_shape(case, dim)
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.int64).reshape(shape)


def truth_outputs(layout, case, options):
    """Every rank's shard by the ground truth: {"shape", "ids"}; a length the layout cannot split
    is padded at its tail with 0 (padding) to the next multiple first."""
    dim = options.get("dim", 1)
    ring, ulysses = case["ring"], case["ulysses"]
    value = make_value(case, dim)
    unit = layout_unit(layout, ring, ulysses)
    padded_length = -(-case["length"] // unit) * unit
    pad_shape = list(value.shape)
    pad_shape[dim] = padded_length - case["length"]
    value = torch.cat([value, value.new_zeros(pad_shape)], dim=dim)
    outputs = []
    for rank in range(ring * ulysses):
        r, u = group_ranks(rank, ring, ulysses, options.get("use_ulysses_low", True))
        positions = shard_positions(layout, padded_length, ring, ulysses, r, u)
        index = torch.tensor(positions, dtype=torch.int64)
        shard = value.index_select(dim, index)
        outputs.append({"shape": list(shard.shape), "ids": shard.flatten().tolist()})
    return outputs


def run_ranks(module, groups, function_name, case, options):
    """The release's function on every rank of one sequence-parallel group: per rank
    {"shape", "ids"} of its shard, or {"raises": "..."}. `groups` is the release's globals module
    (its set_seq_parallel_pg builds the groups the function reads)."""
    ring, ulysses = case["ring"], case["ulysses"]
    world = ring * ulysses
    low = options.get("use_ulysses_low", True)
    extra = {"dim": options["dim"]} if "dim" in options else {}
    value = make_value(case, options.get("dim", 1))
    groups.torch = GroupMaker()
    outputs = []
    for rank in range(world):
        groups.set_seq_parallel_pg(ulysses, ring, rank, world, use_ulysses_low=low)
        made = groups.PROCESS_GROUP
        says = (made.RING_PG.ranks.index(rank), made.ULYSSES_PG.ranks.index(rank))
        if says != group_ranks(rank, ring, ulysses, low):
            raise StandInMissing(
                f"set_seq_parallel_pg gives rank {rank} (ring, ulysses) ranks {says} in "
                f"{made.RING_PG} and {made.ULYSSES_PG}; the checker expects "
                f"{group_ranks(rank, ring, ulysses, low)}"
            )
        module.dist = DistOfRank(rank)
        try:
            shard = getattr(module, function_name)(
                value.clone(), rank, world_size=world, rd=ring, ud=ulysses, **extra
            )
        except StandInMissing:
            raise
        except Exception as err:  # noqa: BLE001 (a raise is the release's answer on this case)
            outputs.append({"raises": f"{type(err).__name__}: {err}".strip()})
            continue
        outputs.append({"shape": list(shard.shape), "ids": shard.flatten().tolist()})
    return outputs


def describe_case(case, options):
    text = (
        f"batch={case['batch']} length={case['length']} features={list(case['features'])} "
        f"ring={case['ring']} ulysses={case['ulysses']}"
    )
    if options.get("dim", 1) != 1:
        text += (
            f" (value shape {value_shape(case, options['dim'])}, chunked on dim {options['dim']})"
        )
    return text


def name_id(case, options, token):
    """What an id is: its batch row, position and feature index in the value, or padding."""
    if token == 0:
        return "padding"
    dim = options.get("dim", 1)
    shape = value_shape(case, dim)
    if not 1 <= token <= math.prod(shape):
        return f"id {token} (not in the value)"
    coords, rest = [], token - 1
    for size in reversed(shape):
        coords.append(rest % size)
        rest //= size
    coords.reverse()
    features = [c for axis, c in enumerate(coords) if axis not in (0, dim)]
    feature = f" feature {features}" if features else ""
    return f"batch {coords[0]} position {coords[dim]}{feature} (id {token})"


def layout_problems(layout, case, options, outputs):
    """[(kind, what)] of every rank's output against the ground truth; kind is raises, lost,
    misplaced or padding. Empty when every rank holds its shard."""
    head = describe_case(case, options)
    raised = [(rank, out["raises"]) for rank, out in enumerate(outputs) if "raises" in out]
    if raised:
        return [("raises", f"{head}: rank {rank} raises {why}") for rank, why in raised]
    ring, ulysses = case["ring"], case["ulysses"]
    low = options.get("use_ulysses_low", True)
    dim = options.get("dim", 1)
    real = math.prod(value_shape(case, dim))
    truth = truth_outputs(layout, case, options)
    problems = []
    seen = {}
    for rank, out in enumerate(outputs):
        for token in out["ids"]:
            if 1 <= token <= real:
                seen.setdefault(token, []).append(rank)
    missing = [token for token in range(1, real + 1) if token not in seen]
    if missing:
        listed = ", ".join(name_id(case, options, t) for t in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        problems.append(
            ("lost", f"{head}: {len(missing)} of {real} elements are on no rank ({listed}{more})")
        )
    twice = [(token, ranks) for token, ranks in seen.items() if len(ranks) > 1]
    if twice:
        token, ranks = twice[0]
        problems.append(
            ("misplaced", f"{head}: {name_id(case, options, token)} is on ranks {ranks}")
        )
    for rank, (out, want) in enumerate(zip(outputs, truth, strict=True)):
        r, u = group_ranks(rank, ring, ulysses, low)
        who = f"{head}: rank {rank} (ring {r}, ulysses {u})"
        if out["shape"] == want["shape"]:
            wrong = [j for j, (g, w) in enumerate(zip(out["ids"], want["ids"])) if g != w]
            real_wrong = [j for j in wrong if want["ids"][j] != 0]
            if wrong:
                j = (real_wrong or wrong)[0]
                slot = list(torch.unravel_index(torch.tensor(j), want["shape"]))
                slot = tuple(int(s) for s in slot)
                problems.append(
                    (
                        "misplaced" if real_wrong else "padding",
                        f"{who}, local slot {slot}: expected "
                        f"{name_id(case, options, want['ids'][j])}, got "
                        f"{name_id(case, options, out['ids'][j])}",
                    )
                )
            continue
        got_shape, want_shape = out["shape"], want["shape"]
        same_but_seq = (
            len(got_shape) == len(want_shape)
            and all(g == w for axis, (g, w) in enumerate(zip(got_shape, want_shape)) if axis != dim)
            and got_shape[dim] < want_shape[dim]
        )
        if same_but_seq:
            wanted = torch.tensor(want["ids"]).reshape(want_shape)
            held = wanted.narrow(dim, 0, got_shape[dim])
            dropped = wanted.narrow(dim, got_shape[dim], want_shape[dim] - got_shape[dim])
            if held.flatten().tolist() == out["ids"] and not bool(dropped.any()):
                problems.append(
                    (
                        "padding",
                        f"{who} holds {got_shape[dim]} position(s) where its shard has "
                        f"{want_shape[dim]}, the rest padding: its real elements sit right, but "
                        "the ranks' shards are of unequal length",
                    )
                )
                continue
        problems.append(
            ("misplaced", f"{who} returns shape {got_shape}; its shard is {want_shape}")
        )
    return problems


SCRIPT_PARTS = (
    StandInMissing,
    Group,
    GroupMaker,
    DistOfRank,
    layout_unit,
    ring_positions,
    group_ranks,
    shard_positions,
    value_shape,
    make_value,
    truth_outputs,
    run_ranks,
    describe_case,
    name_id,
    layout_problems,
)

_REPRODUCER_BODY = """
import math

import torch

{parts}


LAYOUT = {layout!r}
FUNCTION = {function!r}


def release_outputs(wheel):
    groups = load_from_wheel(wheel, {globals_file!r}, {{}})
    module = load_from_wheel(
        wheel, {extract_file!r}, {{"yunchang.globals": {{"PROCESS_GROUP": groups.PROCESS_GROUP}}}}
    )
    return run_ranks(module, groups, FUNCTION, CASE, OPTIONS)


def problems(outputs):
    return [what for _, what in layout_problems(LAYOUT, CASE, OPTIONS, outputs)]
"""


# The checker's side.


@dataclass
class ExtractChecked(Checked):
    """One of the three functions of one release."""

    module: object = None
    groups: object = None  # the release's globals.py, loaded by path
    function_name: str = ""
    layout: str = ""
    broken: bool = False

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    def cases(self, min_length: int = 1):
        from hypothesis import strategies as st

        layout = self.layout

        @st.composite
        def draw(draw):
            ring, ulysses = draw(st.sampled_from(DEGREES))
            unit = layout_unit(layout, ring, ulysses)
            length = st.one_of(
                st.integers(1, 6).map(lambda k: k * unit),
                st.tuples(st.integers(1, 6), st.sampled_from([-1, 1])).map(
                    lambda kd: kd[0] * unit + kd[1]
                ),
                st.integers(1, 64),
            )
            return {
                "batch": draw(st.sampled_from([1, 2])),
                "length": max(draw(length), min_length),
                "features": list(draw(st.sampled_from(FEATURES))),
                "ring": ring,
                "ulysses": ulysses,
            }

        return draw()

    def _options(self, options: dict) -> dict:
        unknown = set(options) - set(self.drawn)
        if unknown:
            raise UpstreamUnavailable(
                f"{self.label}: {', '.join(sorted(unknown))} is not an option of this function "
                f"(drawn: {', '.join(self.drawn)})"
            )
        return {k: v for k, v in options.items() if v is not None}

    def outputs(self, case: dict, options: dict) -> list[dict]:
        """Every rank's output of the release (or the broken copy) on this case."""
        try:
            return run_ranks(self.module, self.groups, self.function_name, case, options)
        except StandInMissing as err:
            raise UpstreamUnavailable(
                f"{self.label}: {err}; teach recipe/checks/upstream/libraries/yunchang.py what it "
                "does"
            ) from None

    def finding(self, case, options: dict) -> Finding | None:
        options = self._options(options)
        found = layout_problems(self.layout, case, options, self.outputs(case, options))
        if not found:
            return None
        kind, what = max(found, key=lambda kw: IMPACTS[kw[0]])
        return Finding(dict(case), tuple(sorted(options.items())), IMPACTS[kind], what)

    def broken_copy(self, part: str = "function") -> ExtractChecked:
        """The release's function with one line mutated (MUTATIONS): zigzag takes chunk
        2*rd-r-2 as its back chunk, stripe forgets the transpose that strides the positions,
        basic takes chunk rank-1."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break (only: function)")
        line, mutated = MUTATIONS[self.function_name]
        name = self.function_name
        broken = layouts.mutated_copy(self.module, (name,), name, line, mutated, self.label)
        return dataclasses.replace(self, module=broken, broken=True)

    def reproducer(self, finding: Finding) -> str | None:
        if self.broken:
            return None  # a reproducer runs the release from its wheel, not a mutated copy
        parts = "\n\n".join(inspect.getsource(part).strip() for part in SCRIPT_PARTS)
        body = _REPRODUCER_BODY.format(
            parts=parts,
            layout=self.layout,
            function=self.function_name,
            globals_file=GLOBALS_FILE,
            extract_file=EXTRACT_FILE,
        )
        title = f"{self.label}: {self.file}:{self.line}, the minimal case the checker found"
        return reproducer_source(title, finding, body, self.distribution, self.version)

    def truth_outputs(self, finding: Finding):
        return truth_outputs(self.layout, finding.case, dict(finding.options))


@dataclass(frozen=True)
class ExtractTarget(CheckTarget):
    name: str
    file: str = EXTRACT_FILE
    notes: tuple[str, ...] = field(default=())

    def load(self, library: str, distribution: str, version: str | None) -> ExtractChecked:
        path, version = source_file(distribution, version, self.file)
        groups_path, _ = source_file(distribution, version, GLOBALS_FILE)
        tag = f"{library}_{version}".replace(".", "_").replace("-", "_")
        with _blocked(OPTIONAL_KERNELS):
            groups = load_module(groups_path, f"recipe_upstream_{tag}_globals", {})
        module = load_module(
            path,
            f"recipe_upstream_{tag}_extract_local",
            {"yunchang.globals": {"PROCESS_GROUP": getattr(groups, "PROCESS_GROUP", None)}},
        )
        layout = LAYOUTS[self.name]
        label = f"{library}@{version} {self.name}"
        function = getattr(module, self.name, None)
        make_groups = getattr(groups, "set_seq_parallel_pg", None)
        if not callable(function) or not callable(make_groups):
            raise UpstreamUnavailable(
                f"{label}: {self.file} has no {self.name} or {GLOBALS_FILE} no set_seq_parallel_pg"
            )
        drawn: dict[str, tuple] = {}
        skipped: dict[str, str] = {}
        for param in inspect.signature(function).parameters:
            if param in FIXED:
                skipped[param] = FIXED[param]
            elif param == "dim":
                drawn[param] = DRAWN[param]
            else:
                raise _unknown(label, self.name, param)
        for param in inspect.signature(make_groups).parameters:
            if param == "use_ulysses_low":
                drawn[param] = DRAWN[param]
            elif param in PG_FIXED:
                skipped[f"set_seq_parallel_pg.{param}"] = PG_FIXED[param]
            else:
                raise _unknown(label, "set_seq_parallel_pg", param)
        notes = (
            "every case plays each rank of one ring x ulysses group (dp 1) on a [batch, seqlen, "
            "*features] tensor of unique ids; each shard is compared with the "
            f"{layout} layout yunchang's attention reads (the ring layout over the ring ranks, "
            "cut in order among the ulysses ranks); a length it cannot split is judged against "
            "the sequence padded at its tail",
        )
        return ExtractChecked(library, version, self.name, distribution, self.file, drawn,
                              skipped, notes, module, groups, self.name, layout)  # fmt: skip


@contextlib.contextmanager
def _blocked(names: tuple[str, ...]):
    """Imports of `names` fail (ImportError) while the block runs; sys.modules is restored."""
    saved = {name: sys.modules.get(name, _ABSENT) for name in names}
    sys.modules.update(dict.fromkeys(names))
    try:
        yield
    finally:
        for name, before in saved.items():
            if before is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before


_ABSENT = object()


def _unknown(label: str, where: str, param: str) -> UpstreamUnavailable:
    return unknown_option(f"{label}: {where}", param, __name__)


LIBRARY = Library(
    DISTRIBUTION,
    tuple(ExtractTarget(name) for name in LAYOUTS),
    releases=("0.6.4",),
)
