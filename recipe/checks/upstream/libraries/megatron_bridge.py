"""Megatron-Bridge's other code that splits packed sequences across CP ranks (beyond the two
`preprocess_packed_seqs` copies in `adapters.py`), each loaded from the release's wheel and
checked against a ground truth of its layout.

Targets (0.6.2 file:line of the checked function):
- `gpt_step._partition_packed_batch_for_cp` (`training/gpt_step.py:174`): the generic training
  split of a packed (THD) batch, used by `gpt_step.get_batch` (`:333`, every GPT-style family) and
  by `deepseek_v4_step.get_batch` in zigzag mode. It picks the physical boundaries
  (`_cu_seqlens_for_cp_partition`, `:92`) and asks `packed_seq_utils.get_thd_cp_partition_indices`
  (`training/utils/packed_seq_utils.py:31`) for this rank's indices, which asks megatron-core's
  `get_batch_on_this_cp_rank`, which asks Transformer Engine's `thd_get_partitioned_indices`.
  Zigzag contract.
- `common_utils.slice_batch_for_context_parallel` (`utils/common_utils.py:251`): the VLM split
  after the vision merge (gemma3_vl, gemma4_vl, ministral3, minimax_m3_vl), on the
  `PackedSeqParams` that `vlm_step` builds with `packed_seq_utils.get_packed_seq_params`; its THD
  branch goes through `get_packed_seq_cp_partition_indices` (`packed_seq_utils.py:91`) to the same
  megatron-core/TE path. Zigzag contract.
- `deepseek_v4_step._partition_packed_batch_contiguous` (`models/deepseek/deepseek_v4_step.py:109`):
  DSv4's contiguous CP mode: rank r keeps the packed stream's slots [r*T/cp, (r+1)*T/cp). Its own
  ground truth (the contiguous layout), not the zigzag contract.
- `kimi_k25_vl._split_on_cp_rank` (`models/kimi_vl/modeling_kimi_k25_vl.py:34`), applied as
  `KimiK25VLModel.forward` applies it (`:471-481`): to the embeddings, labels, loss mask and
  positions of the whole row, whether or not the batch is packed (`packed_seq_params` is passed on
  to the language model unchanged, `:492`). Zigzag contract on a packed batch.

The input is the packed micro-batch as Bridge's data path hands it to the split, built from the
drawn sequences, each padded to 2*cp*tp (Bridge pads to lcm(2*cp, cp*tp), `training/config.py:
1215-1239`, of which 2*cp*tp is a multiple): tokens, labels (the next token; -100 on padding),
loss mask and positions of shape [1, T], and the metadata in the drawn format (`metadata`, an
input option): "in_batch" (`data/packing/in_batch.py:89`: `cu_seqlens_q` real offsets,
`cu_seqlens_q_padded` physical ones), "offline" and "offline+pad_cu_seqlens"
(`data/packing/gpt_sft.py:204-329`: [1, n] boundaries, the pack's trailing padding a last
zero-token sequence, `pack_padding_units` of 2*cp*tp slots, and with `pad_cu_seqlens` two more
zero-length entries), "legacy" and "legacy_no_argmin" (the `cu_seqlens` format with -1 sentinels,
trimmed with `cu_seqlens_argmin` or, without it, at the first negative entry, `gpt_step.py:60`).
Keys that `get_batch_from_iterator` (`gpt_step.py:220`) does not keep are None, as there. The
slots past the last real sequence (the pack's trailing padding) must carry loss mask 0. The two
step functions draw `metadata` and `pack_padding_units` (default: "in_batch", no trailing
padding); the VLM and Kimi paths get "in_batch" only, the one format `vlm_step` packs.

Every option of the checked functions is fixed, with the reason in `FIXED`: their arguments are
the batch, the group or the rank, and the dimension, which the caller determines. The process
group is a stand-in answering `size()`/`rank()` with the drawn cp and rank; the DSv4 step reads
the rank from `parallel_state`, a stand-in too.

Transformer Engine's kernel has no CPU build: `TransformerEngineStandIn` transcribes TE's
`thd_get_partitioned_indices` (its NVTE_CHECKs, and `thd_partition_indices_kernel` with its
device-side assert `seqlen % (world_size * 2) == 0` as a raise), and megatron-core's
`get_batch_on_this_cp_rank` is the installed release's own source re-executed with that stand-in
and the group's size and rank (`megatron_cp_split`). A finding in these two targets is therefore
Bridge's (which boundaries, which tensors, which dimension), given TE's kernel as transcribed.

Stubbed (imports the checked code never calls): gpt_step.py's `modelopt.torch.distill` and
Bridge's `training.config`, `losses`, `post_training.distillation`, `state`,
`utils.flop_utils`, `utils.pg_utils`; `packed_seq_utils` is the release's own file, loaded
first and handed to the others in place of their import. common_utils.py's
`utils.slurm_utils`; deepseek_v4_step.py's `training.config`, `training.gpt_step`,
`training.state`; modeling_kimi_k25_vl.py's `transformers` helpers (`is_flash_attn_2_available`
is False), `models.gpt_provider` and `utils.common_utils`.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    ContractChecked,
    Finding,
    function_line,
    reproducer_source,
)
from recipe.checks.upstream.kit.released import released_targets
from recipe.parallel.cp.contract import LAYOUT_KEY, Impact, unique_sequences
from recipe.upstream import releases
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

RELEASES = ("0.6.2",)
PACKED_SEQ_UTILS = "megatron/bridge/training/utils/packed_seq_utils.py"
GPT_STEP = "megatron/bridge/training/gpt_step.py"
COMMON_UTILS = "megatron/bridge/utils/common_utils.py"
DSV4_STEP = "megatron/bridge/models/deepseek/deepseek_v4_step.py"
KIMI = "megatron/bridge/models/kimi_vl/modeling_kimi_k25_vl.py"
MCORE_SPLIT = (
    "_get_batch_on_this_cp_rank_per_document_balancing",
    "_get_batch_on_this_cp_rank_per_sequence_balancing",
    "get_batch_on_this_cp_rank",
)
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


def _refuse_unknown(label: str, function) -> dict[str, str]:
    return releases.partition_options(function, label, __name__, FIXED)[1]


class TransformerEngineStandIn:
    """transformer_engine_torch as megatron-core's CP split calls it: TE's
    `thd_get_partitioned_indices` transcribed from its CUDA source (the NVTE_CHECKs of the host
    function, then `thd_partition_indices_kernel` per local token; the kernel's device-side
    `assert(seqlen % (world_size * 2) == 0)` on every cu_seqlens entry becomes a raise)."""

    @staticmethod
    def thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
        import torch

        checks = (
            (cu_seqlens.dtype == torch.int32, "cu_seqlens.scalar_type() == Int"),
            (cu_seqlens.dim() == 1, "cu_seqlens.dim() == 1"),
            (cu_seqlens.dim() == 1 and cu_seqlens.size(0) >= 2, "cu_seqlens.size(0) >= 2"),
            (0 <= rank < world_size, "rank >= 0 && rank < world_size"),
            (total_tokens > 0 and total_tokens % (world_size * 2) == 0,
             "total_tokens > 0 && total_tokens % (world_size * 2) == 0"),
        )  # fmt: skip
        for ok, what in checks:
            if not ok:
                raise RuntimeError(f"TransformerEngine: NVTE_CHECK({what}) failed")
        cu = cu_seqlens.to(torch.int64)
        if bool((cu % (2 * world_size)).any()):
            raise RuntimeError(
                "CUDA error: device-side assert triggered (TransformerEngine "
                "thd_partition_indices_kernel: seqlen % (world_size * 2) == 0 fails for "
                f"cu_seqlens {cu.tolist()}, world_size {world_size})"
            )
        batch = cu.numel() - 1
        cu_local = cu // world_size
        token = torch.arange(total_tokens // world_size)
        seq_id = torch.searchsorted(cu_local[1:batch], token, right=True)
        seq_len = cu_local[seq_id + 1] - cu_local[seq_id]
        index = token - cu_local[seq_id]
        offset = torch.where(index < seq_len // 2, rank, (world_size - 1) * 2 - rank)
        return (index + cu_local[seq_id] * world_size + seq_len // 2 * offset).to(torch.int32)


class TorchWithGroups:
    """torch as megatron-core's CP split sees it: the group's size and rank from the group."""

    def __init__(self):
        import torch

        self._torch = torch
        self.distributed = self

    def get_world_size(self, group=None):
        return group.size()

    def get_rank(self, group=None):
        return group.rank()

    def __getattr__(self, name):
        return getattr(self._torch, name)


def megatron_cp_split(tex, torch_module, names):
    """megatron-core's `get_batch_on_this_cp_rank`: the installed release's source, re-executed
    with `tex` and `torch_module` in place of Transformer Engine and torch.distributed."""
    import inspect

    import megatron.core.utils as mcore_utils

    namespace = dict(vars(mcore_utils))
    namespace.update(tex=tex, torch=torch_module)
    for name in names:
        exec(inspect.getsource(getattr(mcore_utils, name)), namespace)  # noqa: S102 (megatron's)
    return namespace["get_batch_on_this_cp_rank"]


def packed_batch(sequences, cp, tp, metadata=None, pack_padding_units=None):
    """(the packed batch as Bridge's data path hands it to the CP split, the physical
    boundaries of the real sequences): each sequence padded to 2*cp*tp, labels the next token
    (-100 on padding), positions running on into each sequence's padding (as the in-batch packer
    writes them), the metadata in the format `metadata` names (None = "in_batch")."""
    import torch

    metadata = metadata or "in_batch"
    unit = 2 * cp * tp
    lengths = [len(s) for s in sequences]
    padded = [-(-n // unit) * unit for n in lengths]
    cu, cu_padded = [0], [0]
    for n, m in zip(lengths, padded):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + m)
    extra = (pack_padding_units or 0) * unit if metadata.startswith("offline") else 0
    total = cu_padded[-1] + extra
    tokens = torch.zeros(1, total, dtype=torch.int64)
    labels = torch.full((1, total), -100, dtype=torch.int64)
    loss_mask = torch.zeros(1, total, dtype=torch.int64)
    position_ids = torch.zeros(1, total, dtype=torch.int64)
    for start, seq, m in zip(cu_padded, sequences, padded):
        n = len(seq)
        tokens[0, start : start + n] = torch.as_tensor(seq, dtype=torch.int64)
        labels[0, start : start + n - 1] = tokens[0, start + 1 : start + n]
        loss_mask[0, start : start + n - 1] = 1
        position_ids[0, start : start + m] = torch.arange(m)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "position_ids": position_ids, "attention_mask": None}  # fmt: skip

    def ints(values, rows=False):
        return torch.tensor([values] if rows else values, dtype=torch.int32)

    if metadata == "in_batch":
        batch.update(
            cu_seqlens_q=ints(cu), cu_seqlens_kv=ints(cu),
            cu_seqlens_q_padded=ints(cu_padded), cu_seqlens_kv_padded=ints(cu_padded),
            max_seqlen_q=ints(max(padded)), max_seqlen_kv=ints(max(padded)), total_tokens=None,
        )  # fmt: skip
    elif metadata.startswith("offline"):
        physical, logical = list(cu_padded), list(cu)
        if extra:
            physical.append(total)
            logical.append(logical[-1])
        if metadata.endswith("+pad_cu_seqlens"):
            physical += [total] * 2
            logical += [logical[-1]] * 2
        longest = max(b - a for a, b in zip(physical, physical[1:]))
        batch.update(
            cu_seqlens_q=ints(logical, True), cu_seqlens_kv=ints(logical, True),
            cu_seqlens_q_padded=ints(physical, True), cu_seqlens_kv_padded=ints(physical, True),
            max_seqlen_q=ints([longest], True), max_seqlen_kv=ints([longest], True),
            token_count=None,
        )  # fmt: skip
    elif metadata.startswith("legacy"):
        sentinels = [-1, -1]
        argmin = metadata == "legacy"
        batch.update(
            cu_seqlens=ints(cu_padded + sentinels, True),
            cu_seqlens_argmin=torch.tensor([len(cu_padded)]) if argmin else None,
            cu_seqlens_unpadded=ints(cu + sentinels, True),
            cu_seqlens_unpadded_argmin=torch.tensor([len(cu)]) if argmin else None,
            max_seqlen=ints([max(padded)], True),
        )  # fmt: skip
    else:
        raise ValueError(f"metadata {metadata!r}: one of in_batch, offline, legacy and variants")
    return batch, cu_padded


def _fields(tokens, labels, loss_mask, position_ids) -> dict[str, torch.Tensor]:
    return {
        "input_ids": tokens.reshape(-1),
        "labels": labels.reshape(-1),
        "loss_mask": loss_mask.reshape(-1),
        "position_ids": position_ids.reshape(-1),
    }


def _head(lengths, cp_size, tp_size) -> str:
    return f"lengths={list(lengths)} cp={cp_size} tp={tp_size}"


@dataclass
class PackedSplitChecked(ContractChecked):
    """A Bridge split of a packed batch, in the zigzag contract: `outputs` gives one rank's
    full-width fields; the contract reads the real sequences' slots, `tail_finding` the rest."""

    modules: dict = field(default_factory=dict)
    function_name: str = ""
    body: str = ""  # the reproducer's release_outputs

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
                return Finding(
                    {"lengths": list(lengths), "cp": cp_size, "tp": tp_size},
                    tuple(sorted(options.items())),
                    Impact.MISPLACED,
                    f"{_head(lengths, cp_size, tp_size)}: rank {rank}, local slot {slot} (past "
                    f"the last sequence): loss_mask expected 0, got "
                    f"{int(fields['loss_mask'][slot])}",
                )
        return None

    def finding(self, case, options: dict) -> Finding | None:
        return layouts.worst(super().finding(case, options), self.tail_finding(case, options))

    def copy_with(self, modules: dict, part: str) -> PackedSplitChecked:
        return type(self)(
            self.library, self.version, f"{self.name} [broken copy: {part}]", self.distribution,
            self.file, self.drawn, self.skipped, self.notes, modules=modules,
            function_name=self.function_name, body=self.body,
        )  # fmt: skip

    def reproducer(self, finding: Finding) -> str:
        return reproducer_source(
            f"{self.label}: the CP split of one packed micro-batch on every rank",
            finding,
            _reproducer_prelude(self.file) + self.body + layouts.REFERENCE,
            self.distribution,
            self.version,
        )

    def truth_outputs(self, finding: Finding) -> dict:
        case = finding.case
        return layouts.truth_outputs(case["lengths"], case["cp"], case["tp"])


def _packed_seq_utils(distribution: str, version: str, tag: str):
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


def _tag(library: str, version: str, name: str) -> str:
    return f"{library}_{version}_{name}".replace(".", "_").replace("-", "_")


def _modelopt_stubs() -> dict:
    distill = types.ModuleType("modelopt.torch.distill")
    modelopt_torch = types.ModuleType("modelopt.torch")
    modelopt_torch.distill = distill
    return {
        "modelopt": {"torch": modelopt_torch},
        "modelopt.torch": {"distill": distill},
        "modelopt.torch.distill": {},
    }


_BRIDGE_TRAINING_STUBS = (
    "megatron.bridge.training.config",
    "megatron.bridge.training.losses",
    "megatron.bridge.training.post_training.distillation",
    "megatron.bridge.training.state",
    "megatron.bridge.training.utils.flop_utils",
    "megatron.bridge.training.utils.pg_utils",
)


def gpt_step_stubs(packed_seq_utils) -> dict:
    return {
        **_modelopt_stubs(),
        **{name: {} for name in _BRIDGE_TRAINING_STUBS},
        "megatron.bridge.training.utils.packed_seq_utils": {
            "get_packed_seq_params": packed_seq_utils.get_packed_seq_params,
            "get_thd_cp_partition_indices": packed_seq_utils.get_thd_cp_partition_indices,
        },
    }


# --- gpt_step._partition_packed_batch_for_cp -------------------------------------------------


@dataclass
class GptStepChecked(PackedSplitChecked):
    def outputs(self, sequences, cp_size, cp_rank, tp_size, options):
        rows = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
        batch, cu = packed_batch(rows, cp_size, tp_size, **options)
        split = getattr(self.module, self.function_name)
        out = split(batch, layouts.GroupStandIn(cp_size, cp_rank))
        return _fields(out["tokens"], out["labels"], out["loss_mask"], out["position_ids"]), cu

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
        return self.copy_with({**self.modules, "main": broken}, part)


class GptStepTarget(CheckTarget):
    name = "gpt_step._partition_packed_batch_for_cp"
    file = GPT_STEP
    function = "_partition_packed_batch_for_cp"

    def load(self, library: str, distribution: str, version: str | None) -> GptStepChecked:
        version = _version(distribution, version)
        tag = _tag(library, version, "gpt_step")
        psu = _packed_seq_utils(distribution, version, tag)
        path, _ = source_file(distribution, version, GPT_STEP)
        module = load_module(path, f"recipe_upstream_{tag}", gpt_step_stubs(psu))
        label = f"{library}@{version} {self.name}"
        function = _function(module, self.function, label)
        return GptStepChecked(
            library, version, self.name, distribution, GPT_STEP, dict(PACKED_INPUT),
            _refuse_unknown(label, function), notes=_TE_NOTE,
            modules={"main": module, "packed_seq_utils": psu}, function_name=self.function,
            body=_GPT_STEP_BODY,
        )  # fmt: skip


_TE_NOTE = (
    "Transformer Engine's thd_get_partitioned_indices is transcribed (no CPU build); "
    "megatron-core's get_batch_on_this_cp_rank is the installed release's source",
)


def _version(distribution: str, version: str | None) -> str:
    """The version a None (installed) resolves to, reading the file the targets share."""
    return source_file(distribution, version, PACKED_SEQ_UTILS)[1]


def _function(module, name: str, label: str):
    function = getattr(module, name, None)
    if not callable(function):
        raise UpstreamUnavailable(f"{label}: the release has no {name}")
    return function


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
        return _fields(embeds[:, 0, 0], labels, loss_mask, positions), cu

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
        return self.copy_with({"main": main, "packed_seq_utils": psu}, part)


_VLM_METADATA = (
    "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
    "max_seqlen_q", "max_seqlen_kv",
)  # fmt: skip


class SliceBatchTarget(CheckTarget):
    name = "common_utils.slice_batch_for_context_parallel"
    file = COMMON_UTILS
    function = "slice_batch_for_context_parallel"

    def load(self, library: str, distribution: str, version: str | None) -> SliceBatchChecked:
        version = _version(distribution, version)
        tag = _tag(library, version, "common_utils")
        psu = _packed_seq_utils(distribution, version, tag)
        path, _ = source_file(distribution, version, COMMON_UTILS)
        stubs = {
            "megatron.bridge.training.utils.packed_seq_utils": {
                "get_packed_seq_cp_partition_indices": psu.get_packed_seq_cp_partition_indices
            },
            "megatron.bridge.utils.slurm_utils": {},
        }
        module = load_module(path, f"recipe_upstream_{tag}", stubs)
        label = f"{library}@{version} {self.name}"
        function = _function(module, self.function, label)
        return SliceBatchChecked(
            library, version, self.name, distribution, COMMON_UTILS, {},
            _refuse_unknown(label, function),
            notes=(*_TE_NOTE, "the batch: vlm_step's in-batch packing (its only packed format)"),
            modules={"main": module, "packed_seq_utils": psu}, function_name=self.function,
            body=_SLICE_BATCH_BODY,
        )  # fmt: skip


# --- kimi_k25_vl._split_on_cp_rank ---------------------------------------------------------------


@dataclass
class KimiChecked(PackedSplitChecked):
    def outputs(self, sequences, cp_size, cp_rank, tp_size, options):
        rows = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
        batch, cu = packed_batch(rows, cp_size, tp_size, "in_batch")
        split = getattr(self.module, self.function_name)
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]  # [T, 1, 1]
        return _fields(
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
        return self.copy_with({"main": broken}, part)


KIMI_STUBS = {
    "transformers.dynamic_module_utils": {},
    "transformers.utils": {"is_flash_attn_2_available": False},
    "megatron.bridge.models.gpt_provider": {},
    "megatron.bridge.utils.common_utils": {},
}


class KimiTarget(CheckTarget):
    name = "kimi_k25_vl._split_on_cp_rank"
    file = KIMI
    function = "_split_on_cp_rank"

    def load(self, library: str, distribution: str, version: str | None) -> KimiChecked:
        path, version = source_file(distribution, version, KIMI)
        module = load_module(path, f"recipe_upstream_{_tag(library, version, 'kimi')}", KIMI_STUBS)
        label = f"{library}@{version} {self.name}"
        function = _function(module, self.function, label)
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
            _refuse_unknown(label, function),
            notes=("applied as KimiK25VLModel.forward applies it, to a packed (THD) batch: the "
                   "embeddings on dim 0, labels, loss mask and positions on dim 1",),
            modules={"main": module}, function_name=self.function, body=_KIMI_BODY,
        )  # fmt: skip


# --- deepseek_v4_step._partition_packed_batch_contiguous -------------------------------------


class _RankStandIn:
    def __init__(self, rank: int):
        self.rank = rank

    def get_context_parallel_rank(self) -> int:
        return self.rank


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
        self.module.parallel_state = _RankStandIn(cp_rank)
        width = batch["tokens"].size(1)
        out = getattr(self.module, self.function_name)(batch, cp_size)
        return _fields(out["tokens"], out["labels"], out["loss_mask"], out["position_ids"]), (
            cu,
            width,
        )

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp_size, tp_size = case
        head = _head(lengths, cp_size, tp_size)
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
        return ContiguousChecked(
            self.library, self.version, f"{self.name} [broken copy: {part}]", self.distribution,
            self.file, self.drawn, self.skipped, self.notes, modules={"main": broken},
            function_name=self.function_name,
        )  # fmt: skip

    def reproducer(self, finding: Finding) -> str:
        return reproducer_source(
            f"{self.label}: the contiguous CP split of one packed micro-batch on every rank",
            finding,
            _reproducer_prelude(self.file) + _DSV4_BODY + layouts.REFERENCE,
            self.distribution,
            self.version,
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
        stubs = {name: {} for name in ("megatron.bridge.training.config",
                                       "megatron.bridge.training.gpt_step",
                                       "megatron.bridge.training.state")}  # fmt: skip
        module = load_module(path, f"recipe_upstream_{_tag(library, version, 'dsv4')}", stubs)
        label = f"{library}@{version} {self.name}"
        function = _function(module, self.function, label)
        return ContiguousChecked(
            library, version, self.name, distribution, DSV4_STEP, dict(PACKED_INPUT),
            _refuse_unknown(label, function),
            notes=("the contiguous layout: rank r holds the packed stream's slots "
                   "[r*T/cp, (r+1)*T/cp); the rank read from a parallel_state stand-in",),
            modules={"main": module}, function_name=self.function,
        )  # fmt: skip


# --- reproducers -------------------------------------------------------------------------------


def _reproducer_prelude(file: str) -> str:
    """What every Bridge reproducer shares: the batch builder and the group stand-in."""
    return "\n\n".join(
        [
            f"FILE = {file!r}",
            f"PACKED_SEQ_UTILS = {PACKED_SEQ_UTILS!r}",
            f"MCORE_SPLIT = {MCORE_SPLIT!r}",
            inspect.getsource(layouts.GroupStandIn),
            inspect.getsource(TransformerEngineStandIn),
            inspect.getsource(TorchWithGroups),
            inspect.getsource(megatron_cp_split),
            inspect.getsource(packed_batch),
            _OUTPUTS,
        ]
    )


_OUTPUTS = '''
def _outputs(per_rank, cu, layout="zigzag"):
    """The reproducer's structure: every rank's fields, the real sequences' boundaries."""
    return {"lengths": CASE["lengths"], "cp": CASE["cp"], "layout": layout, "width": None,
            "cu_seqlens_padded": cu, "round_trip": None, "error": None,
            "ranks": [{k: v.reshape(-1).tolist() for k, v in fields.items()}
                      for fields in per_rank]}


def _packed_seq_utils(wheel):
    module = load_from_wheel(wheel, PACKED_SEQ_UTILS, {})
    module.get_batch_on_this_cp_rank = megatron_cp_split(
        TransformerEngineStandIn(), TorchWithGroups(), MCORE_SPLIT)
    return module


def _run(split_rank):
    """split_rank(rank) -> (fields, cu) on every rank; a raise is the output."""
    per_rank, cu = [], None
    try:
        for rank in range(CASE["cp"]):
            fields, cu = split_rank(rank)
            per_rank.append(fields)
    except Exception as err:
        return {"error": f"rank {len(per_rank)}: {type(err).__name__}: {err}"}
    return per_rank, cu
'''

_GPT_STEP_BODY = """
def release_outputs(wheel):
    import types

    psu = _packed_seq_utils(wheel)
    distill = types.ModuleType("modelopt.torch.distill")
    modelopt_torch = types.ModuleType("modelopt.torch")
    modelopt_torch.distill = distill
    stubs = {"modelopt": {"torch": modelopt_torch}, "modelopt.torch": {"distill": distill},
             "modelopt.torch.distill": {}}
    for name in ("config", "losses", "post_training.distillation", "state", "utils.flop_utils",
                 "utils.pg_utils"):
        stubs["megatron.bridge.training." + name] = {}
    stubs["megatron.bridge.training.utils.packed_seq_utils"] = {
        "get_packed_seq_params": psu.get_packed_seq_params,
        "get_thd_cp_partition_indices": psu.get_thd_cp_partition_indices}
    module = load_from_wheel(wheel, FILE, stubs)
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]

    def split_rank(rank):
        batch, cu = packed_batch(_sequences(lengths), cp, tp, **OPTIONS)
        out = module._partition_packed_batch_for_cp(batch, GroupStandIn(cp, rank))
        return {"input_ids": out["tokens"], "position_ids": out["position_ids"],
                "labels": out["labels"], "loss_mask": out["loss_mask"]}, cu

    done = _run(split_rank)
    return done if isinstance(done, dict) else _outputs(*done)
"""

_SLICE_BATCH_BODY = """
def release_outputs(wheel):
    import types

    import torch

    psu = _packed_seq_utils(wheel)
    stubs = {"megatron.bridge.training.utils.packed_seq_utils": {
                 "get_packed_seq_cp_partition_indices": psu.get_packed_seq_cp_partition_indices},
             "megatron.bridge.utils.slurm_utils": {}}
    module = load_from_wheel(wheel, FILE, stubs)
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]

    def split_rank(rank):
        batch, cu = packed_batch(_sequences(lengths), cp, tp, "in_batch")
        keys = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                "max_seqlen_q", "max_seqlen_kv")
        params = psu.get_packed_seq_params({k: batch[k] for k in keys})
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]
        embeds, labels, loss_mask, positions, _ = module.slice_batch_for_context_parallel(
            inputs_embeds=embeds, labels=batch["labels"], loss_mask=batch["loss_mask"],
            position_ids=batch["position_ids"], attention_mask=None, packed_seq_params=params,
            pg_collection=types.SimpleNamespace(cp=GroupStandIn(cp, rank)))
        return {"input_ids": embeds[:, 0, 0], "position_ids": positions, "labels": labels,
                "loss_mask": loss_mask}, cu

    done = _run(split_rank)
    return done if isinstance(done, dict) else _outputs(*done)
"""

_KIMI_BODY = """
def release_outputs(wheel):
    import torch

    stubs = {"transformers.dynamic_module_utils": {},
             "transformers.utils": {"is_flash_attn_2_available": False},
             "megatron.bridge.models.gpt_provider": {}, "megatron.bridge.utils.common_utils": {}}
    module = load_from_wheel(wheel, FILE, stubs)
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]
    split = module._split_on_cp_rank

    def split_rank(rank):  # as KimiK25VLModel.forward splits a packed batch
        batch, cu = packed_batch(_sequences(lengths), cp, tp, "in_batch")
        embeds = batch["tokens"].to(torch.float64).transpose(0, 1)[:, :, None]
        return {"input_ids": split(embeds, cp, rank, seq_dim=0)[:, 0, 0],
                "labels": split(batch["labels"], cp, rank, seq_dim=1),
                "loss_mask": split(batch["loss_mask"], cp, rank, seq_dim=1),
                "position_ids": split(batch["position_ids"], cp, rank, seq_dim=1)}, cu

    done = _run(split_rank)
    return done if isinstance(done, dict) else _outputs(*done)
"""

_DSV4_BODY = """
class _Rank:
    def __init__(self, rank):
        self.rank = rank

    def get_context_parallel_rank(self):
        return self.rank


def release_outputs(wheel):
    stubs = {"megatron.bridge.training.config": {}, "megatron.bridge.training.gpt_step": {},
             "megatron.bridge.training.state": {}}
    module = load_from_wheel(wheel, FILE, stubs)
    lengths, cp, tp = CASE["lengths"], CASE["cp"], CASE["tp"]

    def split_rank(rank):
        batch, cu = packed_batch(_sequences(lengths), cp, tp, **OPTIONS)
        module.parallel_state = _Rank(rank)
        out = module._partition_packed_batch_contiguous(batch, cp)
        return {"input_ids": out["tokens"], "position_ids": out["position_ids"],
                "labels": out["labels"], "loss_mask": out["loss_mask"]}, cu

    done = _run(split_rank)
    return done if isinstance(done, dict) else _outputs(*done, layout="contiguous")
"""

TARGETS = (GptStepTarget(), SliceBatchTarget(), ContiguousTarget(), KimiTarget())

# The functions training can call (releases.LIBRARIES), then this module's own.
LIBRARY = releases.Library(
    releases.LIBRARIES["megatron-bridge"].distribution,
    (*released_targets("megatron-bridge"), *TARGETS),
    releases.LIBRARIES["megatron-bridge"].releases,
)
