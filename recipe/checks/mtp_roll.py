"""megatron-core's own MTP `roll_tensor` under THD + CP, checked on real gloo ranks.

Multi-token prediction shifts the labels and the loss mask left by one token inside each packed
sequence (`megatron.core.transformer.multi_token_prediction.roll_tensor`). With packed sequences
it goes to `_roll_tensor_packed_seq`, which reads only `packed_seq_params.cu_seqlens_q`, divides
those global offsets by cp_size to find each sequence's local slots, and trades the boundary tokens
of the two zigzag chunks with the neighbouring CP ranks. Real callers fill `cu_seqlens_q`
differently:

- verl passes the padded offsets (the stream's real layout) as `cu_seqlens_q`
  (`cu_kind="padded"`, also what `recipe.model.gpt.packed_seq_params` does);
- Megatron-Bridge's packed SFT passes the real (unpadded) offsets as `cu_seqlens_q` and the padded
  ones as `cu_seqlens_q_padded` (`cu_kind="unpadded"`; Megatron-LM issues #4494, #4495, #6205).

The ground truth is the recipe's: the global stream packed by `pack_sequences` (alignment 2*cp),
its labels and loss mask rolled left by one within each padded sequence (the slot after a
sequence's last padded slot is another sequence, so the rolled value there is 0), and sharded with
the zigzag index (`zigzag_index`), exactly as the inputs are. Every rank calls megatron's function
on its shard; the rolled loss mask is compared on every slot, the rolled labels where the rolled
loss mask is 1. Token ids are unique per slot, so a label from the wrong slot cannot match.

`check_roll_on_rank` is one case on every rank of a world of cp_size ranks (the test pool's, or
`check_roll`'s own); `check_cases_on_rank` runs many in one world and shrinks the first failing
one; `check_roll` starts one world per cp size on loopback and draws the cases. `broken=True`
runs a copy of megatron's function with one deliberate off-by-one: the negative control.

An exception of megatron's function is a finding too. Its exchange uses `torch.distributed.isend`
and `irecv` on the default group (cp_group only names the peers), so a rank that raised after a
send leaves that send unmatched for the next case: `_PointToPointLog` notes every op and posts
the missing counterparts after each case, and bounds every wait, so that a rank raising alone
is reported (PointToPointTimeout) instead of hanging its peers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import random
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from recipe.environment import cuda_available
from recipe.parallel.cp.contract import Mismatch, global_batch
from recipe.parallel.cp.zigzag import local_token_identity, zigzag_index

CU_KINDS = ("padded", "unpadded")
ROLLED = ("labels", "loss_mask")
FIELD_NAME = {name: f"rolled {name}" for name in ROLLED}
MAX_SEQUENCES = 8
# A rank that waits for a message from a peer which raised gives up after this long instead of
# hanging (megatron's ops are waited for with this bound; see _PointToPointLog).
DEFAULT_TIMEOUT_S = 30.0
# The line of `_roll_tensor_packed_seq` that the negative control moves by one slot.
MUTATED_LINE = "local_end_idx = end_idx // cp_size"


def _megatron_module() -> types.ModuleType:
    from megatron.core.transformer import multi_token_prediction

    return multi_token_prediction


@functools.cache
def broken_module() -> types.ModuleType:
    """A copy of megatron's MTP module whose `_roll_tensor_packed_seq` ends each sequence's
    local slice one slot late (the negative control): the slice takes the next sequence's first
    slot, so values go wrong without the function raising (moving the start instead leaves
    one-slot slices, which megatron's chunk(2) cannot split: the control would only raise).
    `roll_tensor` is executed in the copy too: the original calls the helper of its own module."""
    module = _megatron_module()
    helper = inspect.getsource(module._roll_tensor_packed_seq)
    if MUTATED_LINE not in helper:
        raise CheckerError(
            f"megatron-core's _roll_tensor_packed_seq ({module.__file__}) has no line "
            f"`{MUTATED_LINE}`: the negative control must learn this release's shape"
        )
    copy = types.ModuleType(module.__name__ + "_broken")
    vars(copy).update({k: v for k, v in vars(module).items() if k != "__name__"})
    exec(inspect.getsource(module.roll_tensor), vars(copy))  # noqa: S102 (megatron's own code)
    exec(helper.replace(MUTATED_LINE, MUTATED_LINE + " + 1", 1), vars(copy))  # noqa: S102
    return copy


def roll_function(broken: bool = False) -> Callable:
    return broken_module().roll_tensor if broken else _megatron_module().roll_tensor


def case_sequences(lengths: Sequence[int]) -> list[list[int]]:
    """Sequences of these lengths whose token ids are unique per slot (as `first_mismatch`)."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


def rolled_truth(values: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """`values` of the global stream rolled left by one inside each padded sequence: the value of
    the next slot, 0 on each sequence's last slot (its next slot is another sequence's)."""
    rolled = torch.zeros_like(values)
    rolled[:-1] = values[1:]
    ends = cu_seqlens_padded[1:].to(torch.int64) - 1
    rolled[ends[ends >= 0]] = 0
    return rolled


def packed_seq_params(batch, cu_kind: str):
    """megatron's PackedSeqParams as a caller of the given kind fills it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cu_kind not in CU_KINDS:
        raise ValueError(f"cu_kind must be one of {CU_KINDS}, got {cu_kind!r}")
    padded = batch.cu_seqlens_padded
    cu = padded if cu_kind == "padded" else batch.cu_seqlens
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=int(batch.max_seqlen),
        max_seqlen_kv=int(batch.max_seqlen),
    )


def _first_wrong_slot(
    lengths, cp_size: int, cp_rank: int, cu_padded, got: dict, want: dict
) -> Mismatch | None:
    """The lowest local slot where a rolled field differs (labels first on a tie)."""
    checked = {"labels": want["loss_mask"] > 0, "loss_mask": torch.ones_like(want["loss_mask"])}
    best = None
    for name in ROLLED:
        wrong = checked[name].bool() & (got[name].double() != want[name].double())
        if bool(wrong.any()):
            slot = int(wrong.nonzero()[0])
            if best is None or slot < best[1]:
                best = (name, slot)
    if best is None:
        return None
    name, slot = best
    sequence, position, chunk = local_token_identity(cu_padded, cp_size, cp_rank)
    return Mismatch(
        tuple(lengths), cp_size, 1, cp_rank, FIELD_NAME[name], slot, int(sequence[slot]),
        int(position[slot]), int(chunk[slot]), float(want[name][slot]), float(got[name][slot]),
    )  # fmt: skip


class CheckerError(RuntimeError):
    """The checker cannot go on (not a finding about megatron's roll)."""


class PointToPointTimeout(CheckerError):
    """A rank waited `timeout_s` for a peer's message: the finding is in the message. gloo closes
    a link whose wait timed out, so the world is not reused (the pool ends it; so does a
    launched world, as the job fails)."""


@dataclass(frozen=True)
class _PointToPoint:
    """One isend or irecv megatron posted: enough to post its missing counterpart."""

    kind: str
    """"send" or "recv"."""
    peer: int
    """The other end's global rank."""
    tag: int
    on_cp_group: bool
    """Posted on the cp_group handed to the roll (else on the default group)."""
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Bounded:
    """A point-to-point Work whose wait() gives up after the log's timeout: a rank waiting for a
    message that a peer, which raised, never sends reports the wait instead of hanging."""

    def __init__(self, work, log: _PointToPointLog):
        self._work, self._log = work, log
        self.waited = False
        """A gloo send or receive may be waited for once: a second wait waits for another."""

    def wait(self, timeout=None):
        try:
            done = self._work.wait(timeout or self._log.timeout)
        except RuntimeError:
            self._log.timed_out = True
            raise
        self.waited = True
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


class _PointToPointLog:
    """megatron's packed roll trades boundary tokens with `torch.distributed.isend/irecv` on the
    default group (cp_group only names the peers). When it raises (measured: ranks raise alike,
    but rank 0 before posting anything and the others after one isend), a send is left unmatched
    in the world, and the next case's first receive from that peer takes it: the next roll hangs.
    So while the roll runs, both functions are wrapped: each op is passed on unchanged and noted,
    its Work kept (its buffer must live until it is matched), and its wait bounded; `settle`
    then posts the missing counterparts, the same on every rank since it reads every rank's
    notes."""

    def __init__(self, timeout_s: float):
        from datetime import timedelta

        self.timeout = timedelta(seconds=timeout_s)
        self.ops: list[_PointToPoint] = []
        self.works: list[_Bounded] = []
        self.timed_out = False

    @contextlib.contextmanager
    def watching(self, cp_group):
        import torch.distributed as dist

        real = {"send": dist.isend, "recv": dist.irecv}

        def wrapped(kind, peer_name):
            def posted(tensor, *args, **kwargs):
                bound = dict(zip((peer_name, "group", "tag"), args), **kwargs)
                peer, group, tag = bound[peer_name], bound.get("group"), bound.get("tag", 0)
                if peer is None or group not in (None, dist.group.WORLD, cp_group):
                    raise CheckerError(
                        f"megatron's roll calls {kind} on another group or by group rank "
                        f"({bound}): the checker's _PointToPointLog must learn to settle it"
                    )
                work = real[kind](tensor, *args, **kwargs)
                self.ops.append(_PointToPoint(
                    kind, int(peer), int(tag), group is cp_group, tuple(tensor.shape), tensor.dtype
                ))  # fmt: skip
                self.works.append(_Bounded(work, self))
                return self.works[-1]

            return posted

        dist.isend, dist.irecv = wrapped("send", "dst"), wrapped("recv", "src")
        try:
            yield self
        finally:
            dist.isend, dist.irecv = real["send"], real["recv"]

    def settle(self, every_rank: list[list[_PointToPoint]], me: int, cp_group) -> int:
        """Post the counterpart of every op left unmatched (gloo matches point-to-point messages
        in order per peer, group and tag) and wait for all; how many were unmatched."""
        import torch.distributed as dist

        def matching(ops, kind, peer, tag, on_cp):
            wanted = (kind, peer, tag, on_cp)
            return [o for o in ops if (o.kind, o.peer, o.tag, o.on_cp_group) == wanted]

        missing = []  # (who posts, "send" | "recv", to or from whom, the op it answers)
        for src, src_ops in enumerate(every_rank):
            for dst, dst_ops in enumerate(every_rank):
                for tag, on_cp in {(op.tag, op.on_cp_group) for op in src_ops + dst_ops}:
                    sends = matching(src_ops, "send", dst, tag, on_cp)
                    recvs = matching(dst_ops, "recv", src, tag, on_cp)
                    missing += [(dst, "recv", src, op) for op in sends[len(recvs) :]]
                    missing += [(src, "send", dst, op) for op in recvs[len(sends) :]]
        posted = []
        for actor, kind, peer, op in missing:
            if actor == me:
                post = dist.isend if kind == "send" else dist.irecv
                group = cp_group if op.on_cp_group else None
                posted.append(post(torch.zeros(op.shape, dtype=op.dtype), peer, group, op.tag))
        for work in posted + [w for w in self.works if not w.waited]:
            work.wait(self.timeout)
        self.works.clear()
        return len(missing)


def _roll_on_this_rank(
    lengths, cp_size: int, cp_rank: int, cu_kind: str, roll: Callable, group, log
) -> Mismatch | None:
    batch = global_batch(case_sequences(lengths), cp_size, tp_size=1)
    cu_padded = batch.cu_seqlens_padded
    index = zigzag_index(cu_padded, cp_size, cp_rank)
    params = packed_seq_params(batch, cu_kind)
    got, want = {}, {}
    for name in ROLLED:
        values = getattr(batch, name)
        want[name] = rolled_truth(values, cu_padded).index_select(0, index)
        # megatron rolls [batch, sequence] tensors along the last dimension (batch 1 under THD).
        local = values.index_select(0, index).unsqueeze(0)
        try:
            with log.watching(group):
                rolled, _ = roll(local, shifts=-1, dims=-1, cp_group=group,
                                 packed_seq_params=params)  # fmt: skip
        except CheckerError:
            raise
        except Exception as err:  # noqa: BLE001 (a crash of the checked function is a finding)
            text = " ".join(str(err).split())[:300]
            return Mismatch(
                tuple(lengths), cp_size, 1, cp_rank, FIELD_NAME[name], -1, -1, -1, -1, 0, 0,
                note=f"roll_tensor({name}, cu_seqlens_q={cu_kind}) raised "
                f"{type(err).__name__}: {text}",
            )  # fmt: skip
        if rolled.shape != local.shape:
            return Mismatch(
                tuple(lengths), cp_size, 1, cp_rank, FIELD_NAME[name], -1, -1, -1, -1, 0, 0,
                note=f"roll_tensor({name}) returned shape {tuple(rolled.shape)}, expected "
                f"{tuple(local.shape)}",
            )  # fmt: skip
        got[name] = rolled.squeeze(0)
    return _first_wrong_slot(lengths, cp_size, cp_rank, cu_padded, got, want)


def _check_case(lengths, cp_size: int, cu_kind: str, roll: Callable, cp_rank: int,
                timeout_s: float) -> Mismatch | None:  # fmt: skip
    """One case in megatron's parallel state for cp=cp_size, in a world of exactly cp_size ranks
    (so CP ranks are global ranks): the lowest rank's finding, gathered over the CP group (a
    gloo context of its own: a timed-out wait closes the default group's links, not these)."""
    from recipe.parallel import collectives, groups

    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be positive, got {list(lengths)}")
    group = groups.cp_group()
    log = _PointToPointLog(timeout_s)
    mine = _roll_on_this_rank(lengths, cp_size, cp_rank, cu_kind, roll, group, log)
    verdicts = collectives.gather_to_all((mine, log.ops, log.timed_out), group)
    finding = next((v for v, _, _ in verdicts if v is not None), None)
    if any(timed_out for _, _, timed_out in verdicts):
        what = finding.describe() if finding else f"lengths={list(lengths)}"
        raise PointToPointTimeout(
            f"{what} (cu_seqlens_q={cu_kind}): a rank waited {timeout_s:g} s for a peer's "
            "message in megatron's roll, so ranks did not fail alike; gloo closed the link, and "
            "this world cannot run another case"
        )
    log.settle([ops for _, ops, _ in verdicts], cp_rank, group)
    return finding


def _world(cp_size: int, timeout_s: float):
    from recipe.config.layout import ParallelDims
    from recipe.parallel import groups

    # The groups' own timeout is longer than a point-to-point wait's: a rank that gave up
    # waiting must still find its peers in the gather that follows.
    return groups.parallel_world(ParallelDims(cp=cp_size), timeout_s=max(120.0, 4 * timeout_s))


def check_roll_on_rank(
    lengths: Sequence[int],
    cp_size: int,
    cu_kind: str,
    broken: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    roll: Callable | None = None,
) -> Mismatch | None:
    """One case on every rank of a world of cp_size gloo ranks: the first mismatch of any rank
    (the lowest rank's), the same on every rank, or None. An exception of megatron's roll is a
    finding (its note names it), when all ranks raise; a rank that waits `timeout_s` for a
    message from a peer that raised alone raises PointToPointTimeout with the finding. `roll`
    replaces megatron's function (tests of the checker itself)."""
    from recipe.megatron.cpu_patches import install_cpu_patches

    install_cpu_patches()  # idempotent; megatron's unpacked roll asks torch.cuda for its device
    roll = roll or roll_function(broken)
    with _world(cp_size, timeout_s) as layout:
        return _check_case(lengths, cp_size, cu_kind, roll, layout.cp_rank, timeout_s)


def _kind(finding: Mismatch) -> str:
    """What a shrunk case must keep failing with: a wrong value, or the same exception."""
    return finding.note.split(":")[0] if finding.note else "mismatch"


def _smaller(lengths: tuple[int, ...]):
    """Candidates one step simpler: a sequence dropped, then one sequence shorter."""
    if len(lengths) > 1:
        for i in range(len(lengths)):
            yield lengths[:i] + lengths[i + 1 :]
    for i, n in enumerate(lengths):
        for m in sorted({1, n // 2, n - 1}):
            if 1 <= m < n:
                yield lengths[:i] + (m,) + lengths[i + 1 :]


def shrink(lengths: Sequence[int], finding: Mismatch, check: Callable) -> tuple[Mismatch, int]:
    """Greedily simplify a failing case while `check(lengths)` fails the same way; the minimal
    finding and the number of cases tried. Every rank takes the same steps: `check` returns the
    same verdict on all of them."""
    current, tried = tuple(lengths), 0
    progress = True
    while progress:
        progress = False
        for candidate in _smaller(current):
            tried += 1
            found = check(candidate)
            if found is not None and _kind(found) == _kind(finding):
                current, finding, progress = candidate, found, True
                break
    return finding, tried


def check_cases_on_rank(
    cases: Sequence[Sequence[int]],
    cp_size: int,
    cu_kind: str = "padded",
    broken: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Mismatch | None, int]:
    """All `cases` (lists of lengths) on every rank of a world of cp_size ranks, stopping at the
    first failing one, which is shrunk in the same world; (minimal finding or None, cases run,
    shrinking not counted). One parallel state serves every case: building megatron's groups
    costs a few tenths of a second, a case a few milliseconds."""
    from recipe.megatron.cpu_patches import install_cpu_patches

    install_cpu_patches()
    roll = roll_function(broken)
    with _world(cp_size, timeout_s) as layout:

        def check(lengths):
            return _check_case(lengths, cp_size, cu_kind, roll, layout.cp_rank, timeout_s)

        for ran, lengths in enumerate(cases, start=1):
            finding = check(lengths)
            if finding is not None:
                return shrink(lengths, finding, check)[0], ran
    return None, len(cases)


def draw_cases(cp_size: int, count: int, rng: random.Random) -> list[list[int]]:
    """`count` micro-batches of 1 to MAX_SEQUENCES sequences, whose lengths favour the edges of
    the zigzag layout: 1, shorter than 2*cp, and k*2cp-1, k*2cp, k*2cp+1."""
    unit = 2 * cp_size

    def length() -> int:
        k = rng.randint(1, 3)
        return rng.choice([1, rng.randint(1, unit - 1), k * unit - 1, k * unit, k * unit + 1,
                           rng.randint(1, 3 * unit + 1)])  # fmt: skip

    return [[length() for _ in range(rng.randint(1, MAX_SEQUENCES))] for _ in range(count)]


def _launched_rank(cases, cp_size: int, cu_kind: str, broken: bool, timeout_s: float):
    """A rank started by `check_roll` (elastic's `record` sends its traceback back): join the
    world (check_cases_on_rank's parallel_world joins it from the launcher's variables and
    leaves it at the end), run the cases."""
    from recipe.log import quiet_libraries

    quiet_libraries()
    return check_cases_on_rank(cases, cp_size, cu_kind, broken, timeout_s)


def _start_method() -> str:
    """On a CPU, ranks fork from a server that imported torch and megatron-core once (seconds
    less per rank than spawn); with GPUs, spawn, so that no CUDA state is inherited."""
    import multiprocessing

    if cuda_available():
        return "spawn"
    # The fork server is one per process: the first to start it chooses what it preloads (in a
    # test session, usually the pool of tests/helpers/world.py, whose list includes this one).
    multiprocessing.set_forkserver_preload(["torch", "megatron.core.transformer"])
    return "forkserver"


def _launch(cp_size: int, args: tuple):
    """`_launched_rank(*args)` on cp_size local ranks (as recipe/launch/local.py starts a run's);
    rank 0's result, or RanksFailed with the failed rank's traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from recipe.launch.local import RanksFailed, describe_failures

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cp_size,
        run_id=f"mtp-roll-{os.getpid()}-{cp_size}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=_start_method(),
    )
    # The ranks import megatron-core, which warns about the GPU packages a CPU check does not
    # need; those warnings are all a rank would print, so they stay in the ranks.
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning"
    try:
        return elastic_launch(config, entrypoint=_launched_rank)(*args)[0]
    except ChildFailedError as err:
        raise RanksFailed(describe_failures(err.failures)) from None
    finally:
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved


def check_roll(
    cp_sizes: Sequence[int] = (2, 4),
    cases: int = 20,
    seed: int = 0,
    broken: bool = False,
    cu_kind: str = "padded",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Mismatch | None, int]:
    """Draw `cases` micro-batches per cp size (seeded) and check megatron's roll on one launched
    world of cp_size local gloo ranks each; (the first failing cp size's minimal finding or None,
    the drawn cases run; shrinking not counted). Shrinking happens inside the world, where a case
    costs milliseconds, not a launch (a launch costs about 1.5 s, plus some 7 s for the fork
    server's imports on the first one)."""
    if cu_kind not in CU_KINDS:
        raise ValueError(f"cu_kind must be one of {CU_KINDS}, got {cu_kind!r}")
    total = 0
    for cp_size in cp_sizes:
        if cp_size < 2:
            raise ValueError(f"check_roll launches CP worlds; cp sizes must be >= 2, got {cp_size}")
        drawn = draw_cases(cp_size, cases, random.Random(f"{seed}:{cp_size}"))
        finding, ran = _launch(cp_size, (drawn, cp_size, cu_kind, broken, timeout_s))
        total += ran
        if finding is not None:
            return finding, total
    return None, total
