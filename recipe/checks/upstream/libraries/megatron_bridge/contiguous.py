"""`deepseek_v4_step._partition_packed_batch_contiguous`, DSv4's contiguous CP mode, checked
against its own ground truth (the contiguous layout: rank r keeps the packed stream's slots
[r*T/cp, (r+1)*T/cp)) rather than the zigzag contract, with its negative control.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    Finding,
    function_line,
)
from recipe.checks.upstream.libraries.megatron_bridge.common import (
    PACKED_INPUT,
    case_head,
    checked_function,
    module_tag,
    refuse_unknown,
)
from recipe.checks.upstream.libraries.megatron_bridge.reproducer import (
    contiguous_release_outputs,
    reproducer_body,
)
from recipe.checks.upstream.libraries.megatron_bridge.shipped import (
    DSV4_STEP,
    contiguous_stubs,
    packed_batch,
    split_fields,
)
from recipe.parallel.cp.contract import unique_sequences
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file


@dataclass
class ContiguousChecked(Checked):
    """DSv4's contiguous split, against the contiguous layout: rank r holds slots
    [r*T/cp, (r+1)*T/cp) of the packed stream, T its full width."""

    modules: dict = field(default_factory=dict)
    function_name: str = ""

    @property
    def module(self):
        return self.modules["main"]

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    def outputs(self, lengths, cp_size, cp_rank, tp_size, options):
        batch, cu = packed_batch(unique_sequences(list(lengths)), cp_size, tp_size, **options)
        self.module.parallel_state = ParallelStateStandIn(cp_size, cp_rank, tp_size)
        width = batch["tokens"].size(1)
        out = getattr(self.module, self.function_name)(batch, cp_size)
        fields = split_fields(out["tokens"], out["labels"], out["loss_mask"], out["position_ids"])
        return fields, (cu, width)

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp_size, tp_size = case
        head = case_head(lengths, cp_size, tp_size)
        found = {"lengths": list(lengths), "cp": cp_size, "tp": tp_size}
        chosen = tuple(sorted(options.items()))
        got = []
        try:
            for rank in range(cp_size):
                got.append(self.outputs(lengths, cp_size, rank, tp_size, options))
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is the finding)
            what = f"{head}: rank {len(got)} raises {type(err).__name__}: {err}"
            return Finding(found, chosen, Impact.RAISES, what)
        cu, width = got[0][1]
        truth = _truth_stream(lengths, cu, width)
        seen = torch.zeros(width, dtype=torch.int64)
        for rank, (fields, _) in enumerate(got):
            local = fields["input_ids"].numel()
            if local * cp_size != width:
                return Finding(found, chosen, Impact.LOST if local * cp_size < width
                               else Impact.MISPLACED,
                               f"{head}: rank {rank} holds {local} slots of a {width}-slot "
                               f"stream at cp={cp_size}")  # fmt: skip
            slots = torch.arange(rank * local, (rank + 1) * local)
            seen[slots] += 1
            checked = {
                "input_ids": truth["real"][slots],
                "position_ids": truth["real"][slots],
                "labels": truth["loss_mask"][slots] > 0,
                "loss_mask": torch.ones(local, dtype=torch.bool),
            }
            for name, where in checked.items():
                wrong = where & (fields[name] != truth[name][slots])
                if bool(wrong.any()):
                    slot = int(wrong.nonzero()[0])
                    g = int(slots[slot])
                    return Finding(found, chosen, Impact.MISPLACED,
                                   f"{head}: rank {rank}, local slot {slot} (global slot {g}): "
                                   f"{name} expected {int(truth[name][g])}, got "
                                   f"{int(fields[name][slot])}")  # fmt: skip
        return None

    def broken_copy(self, part: str = "function") -> ContiguousChecked:
        """Every rank's window starts one slot late."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = layouts.mutated_copy(
            self.module, (self.function_name,), self.function_name,
            "start = cp_rank * local_len", "start = cp_rank * local_len + 1", label=self.label,
        )  # fmt: skip
        return self.broken_as(part, modules={"main": broken})

    def reproducer(self, finding: Finding) -> str:
        return self.reproducer_script(
            f"{self.label}: the contiguous CP split of one packed micro-batch on every rank",
            finding,
            reproducer_body(contiguous_release_outputs, contiguous_stubs),
        )

    def truth_outputs(self, finding: Finding) -> dict:
        case = finding.case
        return layouts.truth_outputs(case["lengths"], case["cp"], case["tp"], layout="contiguous")


def _truth_stream(lengths, cu, width: int) -> dict[str, torch.Tensor]:
    """Token, position, next-token label, loss mask and realness on every slot of a packed
    stream `width` slots wide whose sequences start at `cu`."""
    truth = {name: torch.zeros(width, dtype=torch.int64) for name in layouts.FIELDS}
    truth["real"] = torch.zeros(width, dtype=torch.bool)
    for start, seq in zip(cu, unique_sequences(list(lengths))):
        n = len(seq)
        truth["input_ids"][start : start + n] = torch.tensor(seq)
        truth["position_ids"][start : start + n] = torch.arange(n)
        truth["labels"][start : start + n - 1] = torch.tensor(seq[1:], dtype=torch.int64)
        truth["loss_mask"][start : start + n - 1] = 1
        truth["real"][start : start + n] = True
    return truth


class ContiguousTarget(CheckTarget):
    name = "deepseek_v4_step._partition_packed_batch_contiguous"
    file = DSV4_STEP
    function = "_partition_packed_batch_contiguous"

    def load(self, library: str, distribution: str, version: str | None) -> ContiguousChecked:
        path, version = source_file(distribution, version, DSV4_STEP)
        tag = module_tag(library, version, "dsv4")
        module = load_module(path, f"recipe_upstream_{tag}", contiguous_stubs())
        label = f"{library}@{version} {self.name}"
        function = checked_function(module, self.function, label)
        return ContiguousChecked(
            library, version, self.name, distribution, DSV4_STEP, dict(PACKED_INPUT),
            refuse_unknown(label, function),
            notes=("the contiguous layout: rank r holds the packed stream's slots "
                   "[r*T/cp, (r+1)*T/cp); the rank read from a parallel_state stand-in",),
            modules={"main": module}, function_name=self.function,
        )  # fmt: skip
