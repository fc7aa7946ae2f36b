"""verl's BSHD engine path: `preprocess_bshd_engine` and its inverse `postprocess_bshd_engine`
(`verl/models/mcore/util.py`), checked against the zigzag contract.

What the function does (0.9.1 `util.py:658`, 0.8.0 `util.py:564`): its input is a jagged nested
tensor [b, j] of real tokens (no mask; verl's engine batch), its output three [b, s/cp] tensors:
this rank's tokens, an attention mask marking the real ones, and positions. Every row is padded
to one length M (the longest sequence, or `forced_max_seqlen`, rounded up to 2*cp*tp, and to the
fp8 block when `use_fp8_padding`), and each row is split as one sequence: chunks r and 2*cp-1-r of
M / (2*cp) slots. Flattened, the rows are the zigzag contract's layout with cu_seqlens_padded =
[0, M, 2M, ...], which is how the checker reads them. `postprocess_bshd_engine` all-gathers every
rank's [b, s/cp] output and attention mask and returns the real tokens' outputs as a nested
[b, j] tensor. verl calls both in `models/mcore/model_forward.py` (0.9.1 `:409-476`) when
`data_format` is "bshd".

Each case checks, on every rank: (1) the contract fields: tokens and positions from one call,
labels from `need_roll=True` (as model_forward shards the label tensor), a per-token 0/1 loss
mask sharded like the tokens; (2) the returned attention mask: True on exactly the real tokens
(a real token masked out has its output dropped by the postprocess: lost; padding marked real
keeps a padding output among the sequence's: misplaced); (3) the round trip: a per-token float
tensor sharded on every rank and gathered back through `postprocess_bshd_engine` on every rank
must come back equal (a difference: misplaced; a raise: raises). The finding is the worst of the
three.

Options: `use_fp8_padding` is drawn (False, True). `forced_max_seqlen` is drawn as "longest" plus
0, 1, 7 or 64 (verl passes the mini-batch's longest sequence, which is at least the
micro-batch's; values below it are not a caller's input); `output_width` (not an option of the
function: the round trip's output gets a trailing dimension of that size, as the postprocess
allows) is drawn (none, 3). Fixed: `input_ids` (the drawn sequences), `need_roll` (both, as
above), `pre_process` (True; the 0.8.0 and 0.9.1 bodies never read it, which `load` verifies).
Any other option refuses the check. cp and tp come from megatron's parallel_state, which the
module reads as `mpu`: a stand-in answers with the drawn rank and sizes. The postprocess's
all_gather is played by a stand-in that hands back each rank's own preprocess output.

Stubbed: `verl.utils.device` (`is_npu_available` = False: the NPU branch builds a 4-D mask for
Ascend, not a CPU path) and `verl.utils.model` (a return type of functions not checked); verl's
package `__init__` imports ray.

0.7.1 has no `preprocess_bshd_engine`: its `preprocess_bshd_no_padding` (0.7.1 `util.py:502`)
asserts `cp_size == 1`, so there is no CP split to check and `load` refuses with that reason.

The reproducer's code is real, shipped by `inspect.getsource`: `reproducer.py`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    CheckTarget,
    ContractChecked,
    Finding,
    case_finding,
    function_line,
)
from recipe.checks.upstream.kit.released import released_library
from recipe.checks.upstream.libraries.verl.reproducer import reproducer_body
from recipe.parallel.cp.contract import LAYOUT_KEY, unique_sequences
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream import releases
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

RELEASES = ("0.8.0", "0.9.1")
FILE = "verl/models/mcore/util.py"
FUNCTION = "preprocess_bshd_engine"
INVERSE = "postprocess_bshd_engine"
OLDER = "preprocess_bshd_no_padding"  # up to 0.7.1, CP refused
PLUGIN = f"{__name__}.__init__"  # the module an unknown option's refusal names
STUBS = {
    "verl.utils.device": {"is_npu_available": False},
    "verl.utils.model": {},
}
FIXED = {
    "input_ids": "the drawn sequences, a jagged nested tensor (verl's engine batch)",
    "need_roll": "both: False for tokens, positions and the loss mask, True for the labels",
    "pre_process": "True: the function's body never reads it",
}
DRAWN = {
    "use_fp8_padding": (False, True),
    "forced_max_seqlen": (None, "longest", "longest+1", "longest+7", "longest+64"),
}
INPUT_OPTIONS = {"output_width": (None, 3)}


def forced_length(value, lengths) -> int | None:
    """`forced_max_seqlen` for these lengths: "longest+k" is the longest sequence plus k."""
    if value is None:
        return None
    base, _, extra = str(value).partition("+")
    if base != "longest":
        raise UpstreamUnavailable(f"forced_max_seqlen={value!r}: write longest or longest+K")
    return max(lengths) + int(extra or 0)


def _nested(rows, dtype) -> torch.Tensor:
    return torch.nested.as_nested_tensor(
        [torch.as_tensor(r, dtype=dtype) for r in rows], layout=torch.jagged
    )


class BshdEngineTarget(CheckTarget):
    releases = RELEASES  # 0.7.1's BSHD function refuses cp > 1 (util.py:511)
    name = FUNCTION
    file = FILE

    def load(self, library: str, distribution: str, version: str | None) -> BshdEngineChecked:
        path, version = source_file(distribution, version, FILE)
        tag = f"{library}_{version}_{FUNCTION}".replace(".", "_").replace("-", "_")
        module = load_module(path, f"recipe_upstream_{tag}", STUBS)
        function = getattr(module, FUNCTION, None)
        if not callable(function):
            older = getattr(module, OLDER, None)
            if callable(older) and "assert cp_size == 1" in inspect.getsource(older):
                raise UpstreamUnavailable(
                    f"{library}@{version} has no {FUNCTION}; its {OLDER} "
                    f"({FILE}:{function_line(module, OLDER)}) asserts cp_size == 1: no CP split "
                    "to check"
                )
            raise UpstreamUnavailable(f"{library}@{version} has no {FUNCTION} in {FILE}")
        if not callable(getattr(module, INVERSE, None)):
            raise UpstreamUnavailable(f"{library}@{version} has no {INVERSE} in {FILE}")
        label = f"{library}@{version} {FUNCTION}"
        drawn, skipped = releases.partition_options(function, label, PLUGIN, FIXED, DRAWN)
        body = inspect.getsource(function).split('"""')[-1]
        if "pre_process" in body:
            raise UpstreamUnavailable(
                f"{label} now reads pre_process; the checker fixes it at True on the ground that "
                "the body never reads it, and must learn what it does"
            )
        drawn.update(INPUT_OPTIONS)
        return BshdEngineChecked(
            library, version, FUNCTION, distribution, FILE, drawn, skipped,
            notes=(
                f"every case also checks the attention mask and round-trips a per-token tensor "
                f"through {INVERSE}",
            ),
            module=module,
        )  # fmt: skip


@dataclass
class BshdEngineChecked(ContractChecked):
    module: object = None

    @property
    def line(self) -> int:
        return function_line(self.module, FUNCTION)

    def _shard(self, rows, dtype, cp_size, cp_rank, tp_size, options, need_roll=False):
        self.module.mpu = ParallelStateStandIn(cp_size, cp_rank, tp_size)
        lengths = [len(r) for r in rows]
        kwargs = {k: v for k, v in options.items() if k in DRAWN and v is not None}
        if "forced_max_seqlen" in kwargs:
            kwargs["forced_max_seqlen"] = forced_length(kwargs["forced_max_seqlen"], lengths)
        return getattr(self.module, FUNCTION)(
            _nested(rows, dtype), pre_process=True, need_roll=need_roll, **kwargs
        )

    def contract_function(self, options: dict):
        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            rows = [s.tolist() for s in sequences]
            at = (cp_size, cp_rank, tp_size, options)
            tokens, _, positions = self._shard(rows, torch.int64, *at)
            labels = self._shard(rows, torch.int64, *at, need_roll=True)[0]
            masks = [[int(p + 1 < len(r)) for p in range(len(r))] for r in rows]
            loss_mask = self._shard(masks, torch.int64, *at)[0]
            width = tokens.shape[1] * cp_size  # M: every row padded to it
            return {
                "input_ids": tokens.reshape(-1),
                "position_ids": positions.reshape(-1),
                "labels": labels.reshape(-1),
                "loss_mask": loss_mask.reshape(-1),
                LAYOUT_KEY: torch.arange(len(rows) + 1) * width,
            }

        return per_rank

    def mask_finding(self, case, options: dict) -> Finding | None:
        """The returned attention mask against the real slots of the zigzag rows."""
        lengths, cp_size, tp_size = case
        head = f"lengths={list(lengths)} cp={cp_size} tp={tp_size}"
        rows = unique_sequences(list(lengths))
        try:
            outputs = [
                self._shard(rows, torch.int64, cp_size, r, tp_size, options) for r in range(cp_size)
            ]
        except Exception:  # noqa: BLE001 (the contract's own check reports the raise)
            return None
        for rank, (tokens, mask, _) in enumerate(outputs):
            width = tokens.shape[1] * cp_size
            cu = torch.arange(len(lengths) + 1) * width
            index = zigzag_index(cu, cp_size, rank).reshape(len(lengths), -1)
            real = (index % width) < torch.tensor(lengths)[:, None]
            wrong = (mask.bool() != real).nonzero()
            if wrong.numel():
                i, slot = (int(v) for v in wrong[0])
                position = int(index[i, slot] % width)
                if bool(real[i, slot]):
                    impact = Impact.LOST
                    what = (
                        "attention_mask expected True, got False: the real token is masked out "
                        f"and {INVERSE} drops its output"
                    )
                else:
                    impact = Impact.MISPLACED
                    what = (
                        f"attention_mask expected False, got True: {INVERSE} keeps this padding "
                        "slot's output among the sequence's"
                    )
                return case_finding(
                    case,
                    options,
                    impact,
                    f"{head}: rank {rank}, row {i}, local slot {slot} (sequence {i}, position "
                    f"{position}): {what}",
                )
        return None

    def round_trip_finding(self, case, options: dict) -> Finding | None:
        """Shard a per-token tensor on every rank, gather it back on every rank."""
        lengths, cp_size, tp_size = case
        head = f"lengths={list(lengths)} cp={cp_size} tp={tp_size}"
        values = layouts.round_trip_values(lengths, options.get("output_width"))
        rows = unique_sequences(list(lengths))
        try:
            shards = []
            for rank in range(cp_size):
                output = self._shard(values, torch.float64, cp_size, rank, tp_size, options)[0]
                mask = self._shard(rows, torch.int64, cp_size, rank, tp_size, options)[1]
                shards.append({"output": output, "mask": mask})
        except Exception:  # noqa: BLE001 (the contract's own check reports the raise)
            return None
        collectives = layouts.CollectivesStandIn(shards)
        inverse = getattr(self.module, INVERSE)
        try:
            self.module.torch = collectives
            for rank in range(cp_size):
                self.module.mpu = ParallelStateStandIn(cp_size, rank, tp_size)
                collectives.rank = rank
                try:
                    back = inverse(shards[rank]["output"], shards[rank]["mask"]).unbind()
                except Exception as err:  # noqa: BLE001 (a raise is the finding)
                    return case_finding(
                        case,
                        options,
                        Impact.RAISES,
                        f"{head}: rank {rank}: {INVERSE} raises {type(err).__name__}: {err}",
                    )
                for i, (want, got) in enumerate(zip(values, back, strict=True)):
                    if got.shape != want.shape or not torch.equal(got, want):
                        return case_finding(
                            case,
                            options,
                            Impact.MISPLACED,
                            f"{head}: rank {rank}: {INVERSE} gives sequence {i} back as "
                            f"{_head(got)}, sharded from {_head(want)}",
                        )
        finally:
            self.module.torch = torch
        return None

    def finding(self, case, options: dict) -> Finding | None:
        return layouts.worst(
            super().finding(case, options),
            self.mask_finding(case, options),
            self.round_trip_finding(case, options),
        )

    def broken_copy(self, part: str = "function") -> BshdEngineChecked:
        """part="function": the front chunk starts one row late (positions stay right);
        part="inverse": the gather takes the back half's mask from the front half."""
        changes = {
            "function": (
                FUNCTION,
                "first_start = cp_rank * chunk_len",
                "first_start = cp_rank * chunk_len + 1",
            ),
            "inverse": (
                INVERSE,
                "full_mask[back_start:back_end] = m1",
                "full_mask[back_start:back_end] = m0",
            ),
        }
        if part not in changes:
            raise UpstreamUnavailable(f"{self.label}: no part {part!r} (function, inverse)")
        broken = layouts.mutated_copy(
            self.module, (FUNCTION, INVERSE), *changes[part], label=self.label
        )
        return self.broken_as(part, module=broken)

    def reproducer(self, finding: Finding) -> str:
        return self.reproducer_script(
            f"{self.label}: {FUNCTION} / {INVERSE} on every rank of one micro-batch",
            finding,
            reproducer_body(FILE, STUBS),
        )

    def truth_outputs(self, finding: Finding) -> dict:
        case, options = finding.case, dict(finding.options)
        return layouts.truth_outputs(
            case["lengths"], case["cp"], case["tp"], attention_mask=True,
            width=options.get("output_width"), round_trip=True,
        )  # fmt: skip


def _head(values: torch.Tensor, shown: int = 6) -> str:
    listed = [v.tolist() for v in values[:shown]]
    return f"{listed}{' ...' if len(values) > shown else ''} ({len(values)} tokens)"


TARGETS = (BshdEngineTarget(),)

# The functions training can call (releases.LIBRARIES), then this module's own.
LIBRARY = released_library("verl", TARGETS)
