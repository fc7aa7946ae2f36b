"""What the four Megatron-Bridge targets share on the checker's side: the options (the drawn
metadata formats, and every fixed option with its reason: a parameter named nowhere here
refuses the check), the zigzag-contract check of a packed split (`PackedSplitChecked`, the base of
`targets.py`'s three), and the loading of a release's files (`packed_seq_utils` with
megatron-core's split on Transformer Engine's kernel as transcribed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    ContractChecked,
    Finding,
    case_finding,
    function_line,
)
from recipe.checks.upstream.libraries.megatron_bridge.reproducer import reproducer_body
from recipe.checks.upstream.libraries.megatron_bridge.shipped import (
    MCORE_SPLIT,
    PACKED_SEQ_UTILS,
    TorchWithGroups,
    TransformerEngineStandIn,
    megatron_cp_split,
)
from recipe.parallel.cp.contract import LAYOUT_KEY, unique_sequences
from recipe.upstream import releases
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

METADATA = ("in_batch", "offline", "offline+pad_cu_seqlens", "legacy", "legacy_no_argmin")
PACKED_INPUT = {"metadata": (None, *METADATA[1:]), "pack_padding_units": (None, 1, 3)}

FIXED = {
    "batch": "the packed micro-batch in the drawn metadata format",
    "cp_group": "a stand-in group of the drawn cp size and rank",
    "cp_size": "the drawn cp size",
    "cp_rank": "the drawn rank",
    "val": "each per-token tensor of the packed batch, as the model's forward passes them",
    "seq_dim": "0 for the [T, B, H] embeddings, 1 for the [B, T] labels, loss mask, positions",
    "inputs_embeds": "[T, 1, 1] holding the token ids: the split never reads the hidden values",
    "labels": "the packed labels",
    "loss_mask": "the packed loss mask",
    "position_ids": "the packed positions",
    "attention_mask": "None, as vlm_step's packed batches have (the THD branch returns it as is)",
    "packed_seq_params": "get_packed_seq_params of the batch's metadata, as vlm_step builds it",
    "pg_collection": "a stand-in whose .cp is the drawn group",
}

TE_NOTE = (
    "Transformer Engine's thd_get_partitioned_indices is transcribed (no CPU build); "
    "megatron-core's get_batch_on_this_cp_rank is the installed release's source",
)


def refuse_unknown(label: str, function) -> dict[str, str]:
    """The fixed options of `function`, with their reasons; any option not in FIXED refuses."""
    return releases.partition_options(function, label, __name__, FIXED)[1]


def case_head(lengths, cp_size, tp_size) -> str:
    return f"lengths={list(lengths)} cp={cp_size} tp={tp_size}"


@dataclass
class PackedSplitChecked(ContractChecked):
    """A Bridge split of a packed batch, in the zigzag contract: `outputs` gives one rank's
    full-width fields; the contract reads the real sequences' slots, `tail_finding` the rest."""

    modules: dict = field(default_factory=dict)
    function_name: str = ""
    shipped: tuple = ()  # the reproducer's release_outputs, then the parts it needs besides

    @property
    def module(self):
        return self.modules["main"]

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    def outputs(self, sequences, cp_size, cp_rank, tp_size, options) -> tuple[dict, list]:
        raise NotImplementedError

    def contract_function(self, options: dict):
        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            fields, cu = self.outputs(sequences, cp_size, cp_rank, tp_size, options)
            keep = cu[-1] // cp_size
            return {**{k: v[:keep] for k, v in fields.items()}, LAYOUT_KEY: torch.tensor(cu)}

        return per_rank

    def tail_finding(self, case, options: dict) -> Finding | None:
        """The slots past the last real sequence (the pack's trailing padding) train nothing."""
        lengths, cp_size, tp_size = case
        sequences = unique_sequences(list(lengths))
        for rank in range(cp_size):
            try:
                fields, cu = self.outputs(sequences, cp_size, rank, tp_size, options)
            except Exception:  # noqa: BLE001 (the contract's own check reports the raise)
                return None
            keep = cu[-1] // cp_size
            weighted = fields["loss_mask"][keep:].nonzero()
            if weighted.numel():
                slot = keep + int(weighted[0])
                return case_finding(
                    case,
                    options,
                    Impact.MISPLACED,
                    f"{case_head(lengths, cp_size, tp_size)}: rank {rank}, local slot {slot} "
                    f"(past the last sequence): loss_mask expected 0, got "
                    f"{int(fields['loss_mask'][slot])}",
                )
        return None

    def finding(self, case, options: dict) -> Finding | None:
        return layouts.worst(super().finding(case, options), self.tail_finding(case, options))

    def reproducer(self, finding: Finding) -> str:
        return self.reproducer_script(
            f"{self.label}: the CP split of one packed micro-batch on every rank",
            finding,
            reproducer_body(*self.shipped),
        )

    def truth_outputs(self, finding: Finding) -> dict:
        case = finding.case
        return layouts.truth_outputs(case["lengths"], case["cp"], case["tp"])


def load_packed_seq_utils(distribution: str, version: str, tag: str):
    """The release's packed_seq_utils, its megatron-core split given TE's kernel on CPU."""
    path, _ = source_file(distribution, version, PACKED_SEQ_UTILS)
    module = load_module(path, f"recipe_upstream_{tag}_packed_seq_utils", {})
    import megatron.core.utils as mcore_utils

    missing = [n for n in MCORE_SPLIT if not callable(getattr(mcore_utils, n, None))]
    if missing:
        raise UpstreamUnavailable(
            f"the installed megatron-core has no {', '.join(missing)}: the checker re-executes "
            "its CP split with TE's kernel transcribed, and must learn the new one"
        )
    module.get_batch_on_this_cp_rank = megatron_cp_split(
        TransformerEngineStandIn(), TorchWithGroups(), MCORE_SPLIT
    )
    return module


def module_tag(library: str, version: str, name: str) -> str:
    return f"{library}_{version}_{name}".replace(".", "_").replace("-", "_")


def release_version(distribution: str, version: str | None) -> str:
    """The version a None (installed) resolves to, reading the file the targets share."""
    return source_file(distribution, version, PACKED_SEQ_UTILS)[1]


def checked_function(module, name: str, label: str):
    function = getattr(module, name, None)
    if not callable(function):
        raise UpstreamUnavailable(f"{label}: the release has no {name}")
    return function
