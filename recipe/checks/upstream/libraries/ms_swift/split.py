"""mcore-bridge's `split_cp_inputs` alone, on the contract's packed fields, the tensor's layout
and the partition mode drawn."""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    ContractChecked,
    Finding,
    function_line,
)
from recipe.checks.upstream.libraries.ms_swift.release import (
    Target,
    load_bridge,
    settings,
    token_sequences,
)
from recipe.checks.upstream.libraries.ms_swift.reproducers import split_body
from recipe.checks.upstream.libraries.ms_swift.truth import (
    case_text,
    contiguous_problem,
    layout_truth_outputs,
    shaped,
    stream_rows,
    unshaped,
)
from recipe.parallel.cp.contract import global_batch
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable

# mcore-bridge's split alone, the tensor's layout drawn (ms-swift passes [1, T] along -1)
SPLIT_DEFAULTS = {"cp_partition_mode": "zigzag", "dim": "bs:-1", "cu_seqlens": "packed"}
SPLIT_DRAWN = {
    "cp_partition_mode": ("zigzag", "contiguous"),
    "dim": ("bs:-1", "bs:1", "bsh:1", "sbh:0"),
    "cu_seqlens": ("packed", "rows"),
}
SPLIT_FIXED = {
    "cu_seqlens values": "the contract's padded boundaries (every sample padded to 2*cp*tp), as "
    "ms-swift's position ids give cu_seqlens_q; `rows` passes None with one sample per row",
}
LAYOUTS = ("bs:-1", "bs:1", "bsh:1", "sbh:0")


class SplitChecked(ContractChecked):
    """mcore-bridge's split_cp_inputs on the contract's packed fields (ms-swift gives it labels
    already rolled, so the labels here are the next tokens)."""

    module: types.ModuleType
    split: Callable

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: Target):
        module, version = load_bridge(version)
        checked = cls(library, version, target.name, distribution, target.file,
                      dict(SPLIT_DRAWN), dict(SPLIT_FIXED))  # fmt: skip
        checked.module, checked.split = module, module.split_cp_inputs
        params = list(inspect.signature(checked.split).parameters)
        if params != ["inputs", "cu_seqlens", "dim", "cp_partition_mode"]:
            raise UpstreamUnavailable(
                f"{checked.label} split_cp_inputs takes {params}; the adapter knows (inputs, "
                "cu_seqlens, dim, cp_partition_mode): teach "
                "recipe/checks/upstream/libraries/ms_swift/split.py the rest"
            )
        return checked

    @property
    def line(self) -> int:
        return function_line(self.module, "split_cp_inputs")

    def _split_rank(self, sequences, cu, cp: int, rank: int, tp: int, s: dict):
        """(this rank's fields as [b, s/cp] rows flattened, the boundaries, rows, width)."""
        rows = s["cu_seqlens"] == "rows"
        fields, layout, width = stream_rows(sequences, cu, rows)
        self.split.__globals__["mpu"] = ParallelStateStandIn(cp, rank, tp)
        kwargs = {} if s["cp_partition_mode"] == "zigzag" else {"cp_partition_mode": "contiguous"}
        out = {}
        for name, value in fields.items():
            tensor, dim = shaped(value, s["dim"])
            got = self.split(tensor, None if rows else cu.to(torch.int32), dim, **kwargs)
            out[name] = unshaped(got, s["dim"]).reshape(-1)
        return out, layout, (len(sequences) if rows else 1), width

    def contract_function(self, options: dict) -> Callable:
        s = settings(SPLIT_DEFAULTS, options)

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            tokens = [seq.tolist() for seq in sequences]
            out, layout, _, _ = self._split_rank(tokens, cu_seqlens_padded, cp_size, cp_rank,
                                                 tp_size, s)  # fmt: skip
            return {**out, "cu_seqlens_padded": layout}

        return per_rank

    def finding(self, case, options: dict) -> Finding | None:
        s = settings(SPLIT_DEFAULTS, options)
        if s["cp_partition_mode"] == "zigzag":
            return super().finding(case, options)
        lengths, cp, tp = case
        sequences = token_sequences(lengths)
        cu = global_batch(sequences, cp, tp).cu_seqlens_padded
        described = case_text(lengths, cp, tp)
        record = {"lengths": list(lengths), "cp": cp, "tp": tp}
        try:
            ranks = [self._split_rank(sequences, cu, cp, r, tp, s) for r in range(cp)]
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is the finding)
            return Finding(record, tuple(sorted(options.items())), Impact.RAISES,
                           f"{described}: raises {type(err).__name__}: {err}")  # fmt: skip
        _, layout, rows, width = ranks[0]
        found = contiguous_problem(sequences, [r[0] for r in ranks], layout, rows, width, cp)
        if found is None:
            return None
        return Finding(record, tuple(sorted(options.items())), found[0], f"{described}: {found[1]}")

    def broken_copy(self, part: str = "function") -> SplitChecked:
        """The mirror chunk one early: rank r takes chunks r and 2*cp-2-r."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = copy.copy(self)
        broken.split = layouts.mutated_function(self.split, "(2 * cp_size - cp_rank - 1)",
                                "(2 * cp_size - cp_rank - 2)", self.label)  # fmt: skip
        return broken

    def reproducer(self, finding: Finding) -> str | None:
        return self.reproducer_script(
            f"{self.label} ({self.file}:{self.line}): one CP rank's split of a packed micro-batch",
            finding,
            split_body(SPLIT_DEFAULTS),
        )

    def truth_outputs(self, finding: Finding):
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        s = settings(SPLIT_DEFAULTS, dict(finding.options))
        sequences = token_sequences(lengths)
        cu = global_batch(sequences, cp, tp).cu_seqlens_padded
        rows = s["cu_seqlens"] == "rows"
        _, layout, width = stream_rows(sequences, cu, rows)
        return layout_truth_outputs(sequences, layout, len(sequences) if rows else 1, width, cp,
                                    s["cp_partition_mode"], True)  # fmt: skip
