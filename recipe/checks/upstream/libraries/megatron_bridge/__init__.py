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

Transformer Engine's kernel has no CPU build: `TransformerEngineStandIn` (`shipped.py`)
transcribes TE's `thd_get_partitioned_indices` (its NVTE_CHECKs, and `thd_partition_indices_kernel`
with its device-side assert `seqlen % (world_size * 2) == 0` as a raise), and megatron-core's
`get_batch_on_this_cp_rank` is the installed release's own source re-executed with that stand-in
and the group's size and rank (`megatron_cp_split`, `shipped.py`). A finding in these two
targets is therefore Bridge's (which boundaries, which tensors, which dimension), given TE's
kernel as transcribed.

Stubbed (imports the checked code never calls): gpt_step.py's `modelopt.torch.distill` and
Bridge's `training.config`, `losses`, `post_training.distillation`, `state`,
`utils.flop_utils`, `utils.pg_utils`; `packed_seq_utils` is the release's own file, loaded
first and handed to the others in place of their import. common_utils.py's
`utils.slurm_utils`; deepseek_v4_step.py's `training.config`, `training.gpt_step`,
`training.state`; modeling_kimi_k25_vl.py's `transformers` helpers (`is_flash_attn_2_available`
is False), `models.gpt_provider` and `utils.common_utils`.

Where things live in this package: `shipped.py` holds what the checker and the reproducers both
run (the files' paths, TE's stand-in and megatron-core's split, the packed batch, the stubs),
shipped into every reproducer by its source; `common.py` the options (FIXED: a new option of a
checked function is taught there), the zigzag-contract base class and the release loading the
targets share; `targets.py` the three zigzag targets (gpt_step, slice_batch, Kimi),
`contiguous.py` DSv4's contiguous one; `reproducer.py` each target's `release_outputs` and the
reproducer's other functions, real code that `inspect.getsource` copies into the script. The
rank DSv4's split reads comes from the kit's `ParallelStateStandIn`, which every reproducer's
prelude ships.
"""

from __future__ import annotations

from recipe.checks.upstream.kit.released import released_library
from recipe.checks.upstream.libraries.megatron_bridge.common import (
    FIXED,
    METADATA,
    PACKED_INPUT,
    PackedSplitChecked,
)
from recipe.checks.upstream.libraries.megatron_bridge.contiguous import (
    ContiguousChecked,
    ContiguousTarget,
)
from recipe.checks.upstream.libraries.megatron_bridge.shipped import (
    COMMON_UTILS,
    DSV4_STEP,
    GPT_STEP,
    KIMI,
    MCORE_SPLIT,
    PACKED_SEQ_UTILS,
    TorchWithGroups,
    TransformerEngineStandIn,
    megatron_cp_split,
    packed_batch,
)
from recipe.checks.upstream.libraries.megatron_bridge.targets import (
    GptStepChecked,
    GptStepTarget,
    KimiChecked,
    KimiTarget,
    SliceBatchChecked,
    SliceBatchTarget,
)

__all__ = [
    "COMMON_UTILS", "DSV4_STEP", "FIXED", "GPT_STEP", "KIMI", "LIBRARY", "MCORE_SPLIT",
    "METADATA", "PACKED_INPUT", "PACKED_SEQ_UTILS", "RELEASES", "TARGETS", "ContiguousChecked",
    "ContiguousTarget", "GptStepChecked", "GptStepTarget", "KimiChecked", "KimiTarget",
    "PackedSplitChecked", "SliceBatchChecked", "SliceBatchTarget", "TorchWithGroups",
    "TransformerEngineStandIn", "megatron_cp_split", "packed_batch",
]  # fmt: skip

RELEASES = ("0.6.2",)

TARGETS = (GptStepTarget(), SliceBatchTarget(), ContiguousTarget(), KimiTarget())

# The functions training can call (releases.LIBRARIES), then this package's own.
LIBRARY = released_library("megatron-bridge", TARGETS)
