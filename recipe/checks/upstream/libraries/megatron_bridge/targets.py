"""The three Megatron-Bridge splits checked against the zigzag contract, each loaded from the
release and called as Bridge calls it: `gpt_step._partition_packed_batch_for_cp` (the training
split, every packed-metadata format drawn), `common_utils.slice_batch_for_context_parallel` (the
VLM split, on vlm_step's PackedSeqParams) and `kimi_k25_vl._split_on_cp_rank` (as
`KimiK25VLModel.forward` applies it), with each one's negative control.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import CheckTarget
from recipe.checks.upstream.libraries.megatron_bridge.common import (
    PACKED_INPUT,
    TE_NOTE,
    PackedSplitChecked,
    checked_function,
    load_packed_seq_utils,
    module_tag,
    refuse_unknown,
    release_version,
)
from recipe.checks.upstream.libraries.megatron_bridge.reproducer import (
    gpt_step_release_outputs,
    kimi_release_outputs,
    slice_batch_release_outputs,
)
from recipe.checks.upstream.libraries.megatron_bridge.shipped import (
    COMMON_UTILS,
    GPT_STEP,
    KIMI,
    gpt_step_stubs,
    kimi_stubs,
    packed_batch,
    slice_batch_stubs,
    split_fields,
)
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

# --- gpt_step._partition_packed_batch_for_cp -------------------------------------------------


@dataclass
class GptStepChecked(PackedSplitChecked):
    def outputs(self, sequences, cp_size, cp_rank, tp_size, options):
        rows = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
        batch, cu = packed_batch(rows, cp_size, tp_size, **options)
        split = getattr(self.module, self.function_name)
        out = split(batch, layouts.GroupStandIn(cp_size, cp_rank))
        return split_fields(out["tokens"], out["labels"], out["loss_mask"],
                            out["position_ids"]), cu  # fmt: skip

    def broken_copy(self, part: str = "function") -> GptStepChecked:
        """Physical boundaries swapped for the real ones (`cu_seqlens_q` for
        `cu_seqlens_q_padded`), the confusion megatron-core's MTP roll shows."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = layouts.mutated_copy(
            self.module, ("_cu_seqlens_for_cp_partition", self.function_name),
            "_cu_seqlens_for_cp_partition",
            'cu_seqlens = batch.get("cu_seqlens_q_padded")',
            'cu_seqlens = batch.get("cu_seqlens_q")',
            label=self.label,
        )  # fmt: skip
        return self.broken_as(part, modules={**self.modules, "main": broken})


class GptStepTarget(CheckTarget):
    name = "gpt_step._partition_packed_batch_for_cp"
    file = GPT_STEP
    function = "_partition_packed_batch_for_cp"

    def load(self, library: str, distribution: str, version: str | None) -> GptStepChecked:
        version = release_version(distribution, version)
        tag = module_tag(library, version, "gpt_step")
        psu = load_packed_seq_utils(distribution, version, tag)
        path, _ = source_file(distribution, version, GPT_STEP)
        module = load_module(path, f"recipe_upstream_{tag}", gpt_step_stubs(psu))
        label = f"{library}@{version} {self.name}"
        function = checked_function(module, self.function, label)
        return GptStepChecked(
            library, version, self.name, distribution, GPT_STEP, dict(PACKED_INPUT),
            refuse_unknown(label, function), notes=TE_NOTE,
            modules={"main": module, "packed_seq_utils": psu}, function_name=self.function,
            shipped=(gpt_step_release_outputs, gpt_step_stubs),
        )  # fmt: skip


# --- common_utils.slice_batch_for_context_parallel ---------------------------------------------


@dataclass
class SliceBatchChecked(PackedSplitChecked):
    def outputs(self, sequences, cp_size, cp_rank, tp_size, options):
        rows = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
        batch, cu = packed_batch(rows, cp_size, tp_size, "in_batch")
        psu = self.modules["packed_seq_utils"]
        metadata = {k: batch[k] for k in _VLM_METADATA if batch.get(k) is not None}
        params = psu.get_packed_seq_params(metadata)
        group = layouts.GroupStandIn(cp_size, cp_rank)
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]  # [T, 1, 1]
        embeds, labels, loss_mask, positions, _ = getattr(self.module, self.function_name)(
            inputs_embeds=embeds,
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            position_ids=batch["position_ids"],
            attention_mask=None,
            packed_seq_params=params,
            pg_collection=types.SimpleNamespace(cp=group),
        )
        return split_fields(embeds[:, 0, 0], labels, loss_mask, positions), cu

    def broken_copy(self, part: str = "function") -> SliceBatchChecked:
        """packed_seq_utils reads the real boundaries where it means the physical ones (the
        tuple from get_packed_seq_q_cu_seqlens unpacked in the wrong order)."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        psu = layouts.mutated_copy(
            self.modules["packed_seq_utils"], ("get_packed_seq_cp_partition_indices",),
            "get_packed_seq_cp_partition_indices",
            "_, cu_seqlens = get_packed_seq_q_cu_seqlens(packed_seq_params)",
            "cu_seqlens, _ = get_packed_seq_q_cu_seqlens(packed_seq_params)",
            label=self.label,
        )  # fmt: skip
        main = layouts.mutated_copy(
            self.module, (self.function_name,), None, "", "", label=self.label,
            overrides={"get_packed_seq_cp_partition_indices":
                       psu.get_packed_seq_cp_partition_indices},
        )  # fmt: skip
        return self.broken_as(part, modules={"main": main, "packed_seq_utils": psu})


_VLM_METADATA = (
    "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
    "max_seqlen_q", "max_seqlen_kv",
)  # fmt: skip


class SliceBatchTarget(CheckTarget):
    name = "common_utils.slice_batch_for_context_parallel"
    file = COMMON_UTILS
    function = "slice_batch_for_context_parallel"

    def load(self, library: str, distribution: str, version: str | None) -> SliceBatchChecked:
        version = release_version(distribution, version)
        tag = module_tag(library, version, "common_utils")
        psu = load_packed_seq_utils(distribution, version, tag)
        path, _ = source_file(distribution, version, COMMON_UTILS)
        module = load_module(path, f"recipe_upstream_{tag}", slice_batch_stubs(psu))
        label = f"{library}@{version} {self.name}"
        function = checked_function(module, self.function, label)
        return SliceBatchChecked(
            library, version, self.name, distribution, COMMON_UTILS, {},
            refuse_unknown(label, function),
            notes=(*TE_NOTE, "the batch: vlm_step's in-batch packing (its only packed format)"),
            modules={"main": module, "packed_seq_utils": psu}, function_name=self.function,
            shipped=(slice_batch_release_outputs, slice_batch_stubs),
        )  # fmt: skip


# --- kimi_k25_vl._split_on_cp_rank ---------------------------------------------------------------


@dataclass
class KimiChecked(PackedSplitChecked):
    def outputs(self, sequences, cp_size, cp_rank, tp_size, options):
        rows = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
        batch, cu = packed_batch(rows, cp_size, tp_size, "in_batch")
        split = getattr(self.module, self.function_name)
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]  # [T, 1, 1]
        return split_fields(
            split(embeds, cp_size, cp_rank, seq_dim=0)[:, 0, 0],
            split(batch["labels"], cp_size, cp_rank, seq_dim=1),
            split(batch["loss_mask"], cp_size, cp_rank, seq_dim=1),
            split(batch["position_ids"], cp_size, cp_rank, seq_dim=1),
        ), cu

    def broken_copy(self, part: str = "function") -> KimiChecked:
        """The back chunk one chunk early."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = layouts.mutated_copy(
            self.module, (self.function_name,), self.function_name,
            "index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=val.device)",
            "index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 2], device=val.device)",
            label=self.label,
        )  # fmt: skip
        return self.broken_as(part, modules={"main": broken})


class KimiTarget(CheckTarget):
    name = "kimi_k25_vl._split_on_cp_rank"
    file = KIMI
    function = "_split_on_cp_rank"

    def load(self, library: str, distribution: str, version: str | None) -> KimiChecked:
        path, version = source_file(distribution, version, KIMI)
        tag = module_tag(library, version, "kimi")
        module = load_module(path, f"recipe_upstream_{tag}", kimi_stubs())
        label = f"{library}@{version} {self.name}"
        function = checked_function(module, self.function, label)
        forward = inspect.getsource(module.KimiK25VLModel.forward)
        calls = ("_split_on_cp_rank(inputs_embeds, cp_size, cp_rank, seq_dim=0)",
                 "_split_on_cp_rank(labels, cp_size, cp_rank, seq_dim=1)")  # fmt: skip
        if not all(call in forward for call in calls):
            raise UpstreamUnavailable(
                f"{label}: KimiK25VLModel.forward no longer splits the embeddings and labels with "
                "_split_on_cp_rank as the checker calls it; it must learn the new way"
            )
        return KimiChecked(
            library, version, self.name, distribution, KIMI, {},
            refuse_unknown(label, function),
            notes=("applied as KimiK25VLModel.forward applies it, to a packed (THD) batch: the "
                   "embeddings on dim 0, labels, loss mask and positions on dim 1",),
            modules={"main": module}, function_name=self.function,
            shipped=(kimi_release_outputs, kimi_stubs),
        )  # fmt: skip
