"""What the Megatron-Bridge checker and its reproducers both run, shipped into every reproducer by
its source (`reproducer.py`, `inspect.getsource`): the files the checked functions live in,
Transformer Engine's kernel on CPU, megatron-core's split re-executed with it, the packed batch as
Bridge's data path hands it to the split, a rank's fields and the stubs each file loads with.
Each function and class is self-contained (its imports inside it), so its source runs in the
script as it does here.
"""

from __future__ import annotations

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


def split_fields(tokens, labels, loss_mask, position_ids):
    """One rank's fields from what a split returns, flat."""
    return {
        "input_ids": tokens.reshape(-1),
        "labels": labels.reshape(-1),
        "loss_mask": loss_mask.reshape(-1),
        "position_ids": position_ids.reshape(-1),
    }


def gpt_step_stubs(packed_seq_utils):
    """gpt_step.py's imports the split never calls (modelopt's distill, Bridge's training
    config, losses, distillation, state, flop and pg utils), and the two functions of the
    release's `packed_seq_utils` it does call."""
    import types

    distill = types.ModuleType("modelopt.torch.distill")
    modelopt_torch = types.ModuleType("modelopt.torch")
    modelopt_torch.distill = distill
    stubs = {"modelopt": {"torch": modelopt_torch}, "modelopt.torch": {"distill": distill},
             "modelopt.torch.distill": {}}  # fmt: skip
    for name in ("config", "losses", "post_training.distillation", "state", "utils.flop_utils",
                 "utils.pg_utils"):  # fmt: skip
        stubs["megatron.bridge.training." + name] = {}
    stubs["megatron.bridge.training.utils.packed_seq_utils"] = {
        "get_packed_seq_params": packed_seq_utils.get_packed_seq_params,
        "get_thd_cp_partition_indices": packed_seq_utils.get_thd_cp_partition_indices,
    }
    return stubs


def slice_batch_stubs(packed_seq_utils):
    """common_utils.py's imports: the release's `packed_seq_utils` split, slurm_utils stubbed."""
    return {
        "megatron.bridge.training.utils.packed_seq_utils": {
            "get_packed_seq_cp_partition_indices": (
                packed_seq_utils.get_packed_seq_cp_partition_indices
            )
        },
        "megatron.bridge.utils.slurm_utils": {},
    }


def kimi_stubs():
    """modeling_kimi_k25_vl.py's imports: transformers' helpers (no flash-attn 2), Bridge's
    gpt_provider and common_utils."""
    return {
        "transformers.dynamic_module_utils": {},
        "transformers.utils": {"is_flash_attn_2_available": False},
        "megatron.bridge.models.gpt_provider": {},
        "megatron.bridge.utils.common_utils": {},
    }


def contiguous_stubs():
    """deepseek_v4_step.py's imports the contiguous split never calls."""
    return {
        "megatron.bridge.training.config": {},
        "megatron.bridge.training.gpt_step": {},
        "megatron.bridge.training.state": {},
    }
