"""The inverses, checked by round trips: every rank shards a tensor of distinct values with
mcore-bridge's split, every rank gathers it back through the checked inverse (all_gather played
by a stand-in), and each must get the original. ms-swift's two `reconstruct_tensor_cp` run on
the row its collator and prepare_batch lay out; mcore-bridge's on the contract's packed layout."""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import Checked, Finding, function_line
from recipe.checks.upstream.libraries.ms_swift.batch import (
    PATH_DEFAULTS,
    PATH_DRAWN,
    REFUSED_LEFT_PADDING,
    row_layout,
    run_path,
)
from recipe.checks.upstream.libraries.ms_swift.inverse_reproducer import round_trip_body
from recipe.checks.upstream.libraries.ms_swift.release import (
    Swift,
    Target,
    UnknownOption,
    load_bridge,
    load_swift,
    settings,
    swapped,
    token_sequences,
)
from recipe.checks.upstream.libraries.ms_swift.split import LAYOUTS
from recipe.checks.upstream.libraries.ms_swift.truth import (
    case_text,
    plain_number,
    shaped,
    unshaped,
)
from recipe.parallel.cp.contract import global_batch
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable

RECON_DEFAULTS = {**PATH_DEFAULTS, "cp_partition_mode": "zigzag", "dim": "bsh:1"}
RECON_DRAWN = {**PATH_DRAWN, "cp_partition_mode": ("zigzag", "contiguous"), "dim": LAYOUTS}
TRAINER_RECON_DEFAULTS = {**PATH_DEFAULTS, "cp_partition_mode": "zigzag"}
TRAINER_RECON_DRAWN = {**PATH_DRAWN, "cp_partition_mode": ("zigzag", "contiguous")}
BRIDGE_RECON_DEFAULTS = {"cp_partition_mode": "zigzag", "dim": "bsh:1", "packed_seq_params": "thd"}
BRIDGE_RECON_DRAWN = {
    "cp_partition_mode": ("zigzag", "contiguous"),
    "dim": LAYOUTS,
    "packed_seq_params": ("thd", "rows"),
}
ROUND_TRIP_FIXED = {
    "shards": "each rank's split by mcore-bridge's split_cp_inputs with the batch's cu_seqlens_q "
    "(None without padding_free), as get_batch_on_this_cp_rank splits the inputs the model's "
    "per-token output follows",
    "all_gather": "played by a stand-in handing back every rank's shard",
}
TRAINER_FIXED = {
    **ROUND_TRIP_FIXED,
    "tensor": "[b, s] per-token logps along 1, as its callers pass them (trainers/utils.py:467, "
    "grpo_trainer.py:906, rlhf_mixin.py:81)",
    "num_samples": "the real sample count its callers pass (seq_lens; the micro-batch size "
    "without padding_free)",
}
BRIDGE_RECON_FIXED = {
    **ROUND_TRIP_FIXED,
    "cu_seqlens_q_padded": "None (ms-swift sets it only on NPU, to the same boundaries)",
}


@dataclass
class _Row:
    """The row(s) a round trip shards: their boundaries and what is real."""

    sequences: list
    cu: torch.Tensor | None  # the split's and the params' cu_seqlens (None: rows)
    params: object  # packed_seq_params as the callers hold it, or None
    layout: torch.Tensor  # the samples' boundaries in the row(s) laid side by side
    rows: int
    width: int

    def values(self) -> torch.Tensor:
        """[rows, width] float64, a distinct value per slot: 1 + its global slot."""
        return torch.arange(1, self.rows * self.width + 1, dtype=torch.float64).reshape(
            self.rows, self.width
        )

    def describe(self, g: int) -> str:
        """Global slot g (of the rows side by side) as sample and position, or padding."""
        for i, tokens in enumerate(self.sequences):
            if int(self.layout[i]) <= g < int(self.layout[i + 1]):
                p = g - int(self.layout[i])
                return f"sequence {i} position {p}" + ("" if p < len(tokens) else " (padding)")
        return "tail padding"

    def real(self) -> torch.Tensor:
        real = torch.zeros(self.rows * self.width, dtype=torch.bool)
        for i, tokens in enumerate(self.sequences):
            start = int(self.layout[i])
            real[start : start + len(tokens)] = True
        return real.reshape(self.rows, self.width)


def _round_trip_problem(row: _Row, expected: torch.Tensor, got: torch.Tensor, rank: int,
                        real: torch.Tensor) -> tuple[Impact, str] | None:  # fmt: skip
    """The result on one rank against the original: a real slot's value nowhere is lost, at
    another slot misplaced; only padding slots differing is padding."""
    values = expected[real]
    present = set(got.flatten().tolist())
    missing = [v for v in values.tolist() if v not in present]
    if missing:
        listed = ", ".join(row.describe(int(v) - 1) for v in missing[:4])
        return Impact.LOST, (
            f"rank {rank}: the values of {len(missing)} real tokens are in no slot of the result "
            f"({listed}{' ...' if len(missing) > 4 else ''}); result shape "
            f"{tuple(got.shape)}, original {tuple(expected.shape)}"
        )
    if got.shape != expected.shape:
        return Impact.MISPLACED, (
            f"rank {rank}: result shape {tuple(got.shape)}, the original {tuple(expected.shape)}"
        )
    wrong = got != expected
    if bool((wrong & real).any()):
        b, s = (int(x) for x in (wrong & real).nonzero()[0])
        g = b * row.width + s
        return Impact.MISPLACED, (
            f"rank {rank}: row {b} slot {s} ({row.describe(g)}) gets the value of "
            f"{row.describe(int(got[b, s]) - 1)}"
        )
    if bool(wrong.any()):
        b, s = (int(x) for x in wrong.nonzero()[0])
        return Impact.PADDING, (
            f"rank {rank}: row {b} slot {s} ({row.describe(b * row.width + s)}) gets "
            f"{plain_number(float(got[b, s]))}; every real token comes back to its slot"
        )
    return None


class _RoundTripChecked(Checked):
    """A split and its inverse: every rank shards a tensor of distinct values, every rank
    gathers it back through the inverse; each must get the original."""

    split: Callable  # mcore-bridge's split_cp_inputs
    inverse: Callable  # the checked function
    inverse_module: types.ModuleType
    inverse_name = "reconstruct_tensor_cp"
    defaults: dict
    mutation: tuple[str, str]

    @property
    def line(self) -> int:
        return function_line(self.inverse_module, "reconstruct_tensor_cp")

    def _row(self, lengths, cp: int, tp: int, s: dict) -> _Row:
        raise NotImplementedError

    def _call(self, shard: torch.Tensor, row: _Row, cp: int, s: dict) -> torch.Tensor:
        raise NotImplementedError

    def _expected(self, row: _Row) -> torch.Tensor:
        return row.values()

    def _layout_option(self, s: dict) -> str:
        return s.get("dim", "bs:1")

    def _shards(self, row: _Row, cp: int, tp: int, s: dict) -> list[torch.Tensor]:
        tensor, dim = shaped(row.values(), self._layout_option(s))
        kwargs = {} if s["cp_partition_mode"] == "zigzag" else {"cp_partition_mode": "contiguous"}
        shards = []
        for rank in range(cp):
            self.split.__globals__["mpu"] = ParallelStateStandIn(cp, rank, tp)
            shards.append(self.split(tensor, row.cu, dim, **kwargs))
        return shards

    def round_trip(self, row: _Row, cp: int, tp: int, s: dict) -> list[torch.Tensor]:
        """Each rank's result as [rows, slots], from its own shard and the others' gathered."""
        shards = self._shards(row, cp, tp, s)
        namespace = self.inverse.__globals__
        results = []
        with swapped(namespace, torch=layouts.GatherStandIn(shards)):
            for rank in range(cp):
                namespace["mpu"] = ParallelStateStandIn(cp, rank, tp)
                results.append(unshaped(self._call(shards[rank], row, cp, s),
                                         self._layout_option(s)))  # fmt: skip
        return results

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp, tp = case
        s = settings(self.defaults, options)
        record = {"lengths": list(lengths), "cp": cp, "tp": tp}
        described = case_text(lengths, cp, tp)
        try:
            row = self._row(lengths, cp, tp, s)
            results = self.round_trip(row, cp, tp, s)
        except _Refused:
            return None
        except UnknownOption as err:
            raise UpstreamUnavailable(
                f"{self.label} reads {err}, an option the adapter does not know: teach "
                "recipe/checks/upstream/libraries/ms_swift/round_trip.py what it does"
            ) from None
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is the finding)
            return Finding(record, tuple(sorted(options.items())), Impact.RAISES,
                           f"{described}: raises {type(err).__name__}: {err}")  # fmt: skip
        expected = self._expected(row)
        real = row.real()[:, : expected.shape[1]]
        for rank, got in enumerate(results):
            found = _round_trip_problem(row, expected, got, rank, real)
            if found is not None:
                return Finding(record, tuple(sorted(options.items())), found[0],
                               f"{described}: {found[1]}")  # fmt: skip
        return None

    def broken_copy(self, part: str = "function") -> _RoundTripChecked:
        """The inverse with one deliberate bug (`mutation`); part "function" and "inverse" name
        the same function here, the inverse being the checked one."""
        if part not in ("function", "inverse"):
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = copy.copy(self)
        broken.inverse = layouts.mutated_function(self.inverse, *self.mutation, self.label)
        return broken

    call: str  # how the reproducer calls the inverse: "utils", "trainer" or "bridge"
    package: str  # the package the inverse's file sits in

    def _spec(self, finding: Finding) -> tuple[_Row, dict]:
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        s = settings(self.defaults, dict(finding.options))
        row = self._row(lengths, cp, tp, s)
        spec = {
            "relative": self.file,
            "package": self.package,
            "call": self.call,
            "cu": None if row.cu is None else [int(c) for c in row.cu],
            "rows": row.rows,
            "width": row.width,
            "layout": [int(c) for c in row.layout],
            "expected_width": int(self._expected(row).shape[1]),
            "dim": self._layout_option(s),
            "mode": s["cp_partition_mode"],
        }
        return row, spec

    def reproducer(self, finding: Finding) -> str | None:
        _, spec = self._spec(finding)
        return self.reproducer_script(
            f"{self.label} ({self.file}:{self.line}): a CP round trip, each rank gathering "
            "every rank's shard back",
            finding,
            round_trip_body(spec),
        )

    def truth_outputs(self, finding: Finding):
        row, _ = self._spec(finding)
        return {"ranks": [self._expected(row).tolist()] * finding.case["cp"]}


def _swift_row(checked, lengths, cp: int, tp: int, s: dict) -> _Row:
    """The packed row (or rows) ms-swift's collator and prepare_batch make of these samples."""
    sequences = token_sequences(lengths)
    unknown: list = []
    try:
        got = run_path(checked.swift, checked.swift.split.get_batch_on_this_cp_rank, sequences,
                        cp, 0, tp, {**s, "is_multimodal": False}, unknown)  # fmt: skip
    except AssertionError as err:
        if REFUSED_LEFT_PADDING in str(err):
            raise _Refused from None
        raise
    if unknown:
        raise UnknownOption(", ".join(sorted(set(unknown))))
    params = got.batch.get("packed_seq_params")
    cu = None if params is None else params.cu_seqlens_q
    return _Row(sequences, cu, params, row_layout(got, len(lengths)), got.rows, got.width)


class _Refused(Exception):
    """ms-swift refuses this configuration by design (not a finding)."""


class SwiftReconstructChecked(_RoundTripChecked):
    """ms-swift's swift/megatron/utils/utils.py reconstruct_tensor_cp (trainers/base.py:1138)."""

    swift: Swift
    defaults = RECON_DEFAULTS
    call, package = "utils", "swift.megatron.utils"
    mutation = (
        "out = _undo_attention_load_balancing(gathered, cp_size, packed_seq_params)",
        "out = _undo_attention_load_balancing(gathered, cp_size, None)",
    )

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: Target):
        swift = load_swift(version)
        checked = cls(library, swift.version, target.name, distribution, target.file,
                      dict(RECON_DRAWN), dict(ROUND_TRIP_FIXED))  # fmt: skip
        checked.swift, checked.split = swift, swift.bridge.split_cp_inputs
        checked.inverse_module, checked.inverse = swift.utils, swift.utils.reconstruct_tensor_cp
        _known_params(checked, ["tensor", "packed_seq_params", "dim", "cp_partition_mode"])
        return checked

    def _row(self, lengths, cp, tp, s):
        return _swift_row(self, lengths, cp, tp, s)

    def _call(self, shard, row, cp, s):
        return self.inverse(shard, row.params, dim=shaped(row.values(), s["dim"])[1],
                            cp_partition_mode=s["cp_partition_mode"])  # fmt: skip


class TrainerReconstructChecked(_RoundTripChecked):
    """ms-swift's swift/megatron/trainers/utils.py reconstruct_tensor_cp (per-token logps)."""

    swift: Swift
    defaults = TRAINER_RECON_DEFAULTS
    call, package = "trainer", "swift.megatron.trainers"
    mutation = ("(chunks >= cp_size) * half_chunks", "(chunks > cp_size) * half_chunks")

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: Target):
        swift = load_swift(version)
        checked = cls(library, swift.version, target.name, distribution, target.file,
                      dict(TRAINER_RECON_DRAWN), dict(TRAINER_FIXED))  # fmt: skip
        checked.swift, checked.split = swift, swift.bridge.split_cp_inputs
        checked.inverse_module = swift.trainer
        checked.inverse = swift.trainer.reconstruct_tensor_cp
        _known_params(checked, ["cp_size", "tensor", "packed_seq_params", "num_samples",
                                "cp_partition_mode"])  # fmt: skip
        return checked

    def _row(self, lengths, cp, tp, s):
        return _swift_row(self, lengths, cp, tp, s)

    def _call(self, shard, row, cp, s):
        return self.inverse(cp, shard, row.params, len(row.sequences), s["cp_partition_mode"])

    def _expected(self, row: _Row) -> torch.Tensor:
        """The samples' slots: the callers want [1, cu_seqlens_q[num_samples]] of a packed row
        (the tail dropped), the whole [b, s] without padding_free."""
        values = row.values()
        return values if row.params is None else values[:, : int(row.layout[-1])]


class BridgeReconstructChecked(_RoundTripChecked):
    """mcore-bridge's reconstruct_tensor_cp on the contract's packed layout."""

    module: types.ModuleType
    defaults = BRIDGE_RECON_DEFAULTS
    call, package = "bridge", "mcore_bridge.utils"
    mutation = SwiftReconstructChecked.mutation

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: Target):
        module, version = load_bridge(version)
        checked = cls(library, version, target.name, distribution, target.file,
                      dict(BRIDGE_RECON_DRAWN), dict(BRIDGE_RECON_FIXED))  # fmt: skip
        checked.module, checked.split = module, module.split_cp_inputs
        checked.inverse_module, checked.inverse = module, module.reconstruct_tensor_cp
        _known_params(checked, ["tensor", "packed_seq_params", "dim", "cp_partition_mode"])
        return checked

    def _row(self, lengths, cp, tp, s):
        from megatron.core.packed_seq_params import PackedSeqParams

        sequences = token_sequences(lengths)
        cu = global_batch(sequences, cp, tp).cu_seqlens_padded.to(torch.int32)
        if s["packed_seq_params"] == "rows":
            width = int(cu.diff().max())
            layout = torch.arange(len(lengths) + 1, dtype=torch.int64) * width
            return _Row(sequences, None, None, layout, len(lengths), width)
        longest = int(cu.diff().max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip
        return _Row(sequences, cu, params, cu.to(torch.int64), 1, int(cu[-1]))

    def _call(self, shard, row, cp, s):
        return self.inverse(shard, row.params, shaped(row.values(), s["dim"])[1],
                            cp_partition_mode=s["cp_partition_mode"])  # fmt: skip


def _known_params(checked: Checked, known: list[str]) -> None:
    params = list(inspect.signature(checked.inverse).parameters)
    if params != known:
        raise UpstreamUnavailable(
            f"{checked.label} reconstruct_tensor_cp takes {params}; the adapter knows {known}: "
            "teach recipe/checks/upstream/libraries/ms_swift/round_trip.py the rest"
        )
