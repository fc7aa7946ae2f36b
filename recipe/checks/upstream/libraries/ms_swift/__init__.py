"""ms-swift and mcore-bridge: the CP split of a packed micro-batch and its inverse, from the wheels.

Where the functions live (read in the wheels, file:line there):
- mcore-bridge 1.6.5 `mcore_bridge/utils/megatron_utils.py`: `split_cp_inputs` (:56), the split
  of one tensor along `dim`, zigzag per sequence of `cu_seqlens` (or the whole dim when it is
  None), or contiguous; `reconstruct_tensor_cp` (:118), all_gather, then megatron-core's
  `_undo_attention_load_balancing`.
- ms-swift 4.6.0 `swift/megatron/utils/megatron_lm_utils.py:858` `get_batch_on_this_cp_rank`:
  mcore-bridge's split on labels, position_ids, loss_scale and (text models) input_ids with
  `packed_seq_params.cu_seqlens_q` (:887). ms-swift keeps two inverses of its own:
  `swift/megatron/utils/utils.py:284` `reconstruct_tensor_cp` (mcore-bridge's code; the last
  tokens of a sequence, trainers/base.py:1138) and `swift/megatron/trainers/utils.py:472`
  `reconstruct_tensor_cp` (its own index arithmetic: per-token logps and entropies for GRPO and
  reference models, trainers/utils.py:467, grpo_trainer.py:906, rlhf_mixin.py:81).
So there are two libraries: "ms-swift" (its batch path and its two inverses, which run on the
mcore-bridge release ms-swift installs) and "mcore-bridge" (its split and inverse alone).
ms-swift 4.6.0 requires `mcore-bridge>=1.6.3` (METADATA, extra "megatron"); 1.6.3 and 1.6.4
move the split's index to CUDA (`.cuda()`, their megatron_utils.py:77-78), 1.6.5 keeps it on the
tensor's device, so the ms-swift targets run on 1.6.5, the newest release the requirement
allows (`BRIDGE_FOR_SWIFT`); an ms-swift release whose requirement excludes it is refused.

What a CP rank trains on in ms-swift, every step the release's own code:
1. the collator `Template._data_collator` (swift/template/base.py:2062, what `data_collator` calls
   for causal_lm in train mode, :1802-1804): `_handle_megatron_cp` (:1665-1682) pads every
   sample to a multiple of 2*cp inside the sample (pad_token_id, labels -100, loss_scale 0,
   length += pad, so its position ids run on through the padding); `packing_row` (:750-771)
   packs the micro-batch into one row, position ids 0..length-1 per sample (:768); the row is
   padded to a multiple of `padding_to` (:2138-2149, :2164-2169): tokens, labels and loss_scale
   on `padding_side`, the position ids always appended on the right as arange(2*cp) repeated,
   so the tail is cut into padding segments of 2*cp. Without padding_free each sample is a row
   of [b, s], padded on the right (:2077-2082 refuses left padding).
   `padding_to` is `get_padding_to(args)` (swift/megatron/utils/utils.py:229-249): cp, times tp
   under sequence parallelism, times 16 for fp8/fp4, 128 for the blockwise recipe, 32 for mxfp8,
   at least 64 times that cp (or cp*tp) for the fused attention backend.
2. `prepare_batch` (swift/megatron/trainers/utils.py:379): `get_batch_on_this_pp_rank` rolls
   labels and loss_scale by -1 along the row (:22-24), so each slot's label is the next token
   and a sample's last token gets the -100 of what follows it; the packed_seq_params come from
   the position ids (utils.py:252 -> swift/utils/transformers_utils.py:354: a sequence starts at
   every position id 0, so cu_seqlens_q holds each sample's padded boundaries and then the tail's
   segments); then `get_batch_on_this_cp_rank`.
3. the loss weight of a slot is `labels != -100` times loss_scale (trainers/trainer.py:59-63).

Ground truth: zigzag -> the contract (`recipe/checks/assess.py` `assess`) on the
sequences' slots (each sample's padded boundaries, as the function returns them), plus a check
that the tail segments hold no real token and no loss weight; contiguous -> rank r holds global
slots [r*T/cp, (r+1)*T/cp) of the row (`contiguous_problem`). The inverses: a round trip (every
rank shards a tensor of unique values with the split, every rank gathers it back through the
function, with all_gather played by a stand-in that hands each rank's shard back) must give the
original; a real token's value elsewhere is misplaced, nowhere is lost, padding alone is padding.

Options, drawn or fixed (every attribute the released code reads from `args` and the template is
one of these: any other refuses the check, see `Strict`):
- drawn (batch path and ms-swift inverses): padding_free, padding_side, sequence_parallel,
  fp8_format, fp8_recipe, fp4_format, attention_backend (the last five set padding_to), and for
  the batch path is_multimodal (input_ids stay whole: the model splits embeddings; positions,
  labels and weights are checked), cp_partition_mode (zigzag, contiguous), loss_scale (absent,
  or the template's per-token weights); tp comes from the case.
- fixed: task_type causal_lm (seq_cls, embedding and reranker carry one label per sample, which
  the split leaves whole, :884-885); the NPU branches off (`is_torch_npu_available` answers
  False: an Ascend path, utils.py:277, megatron_lm_utils.py:889, trainers/utils.py:359); one
  pipeline stage (earlier stages drop the labels, trainers/utils.py:26-32); train mode (other
  modes pad on the left for generation); 1-D position ids (text models; mrope's 3-D ones go
  through the same lines along the last dim); pad_token_id 0 (never a real token here).
- the inverses: dim with the tensor's layout (`bsh:1` [b, s, h] along 1, as trainers/base.py
  passes the model output; `bs:1`, `bs:-1`, `sbh:0`), cp_partition_mode and packed or row
  batches drawn; ms-swift's trainer inverse takes [b, s] logps along 1 (fixed by its callers)
  and num_samples = the real sample count its callers pass (seq_lens, trainers/utils.py:461).
  mcore-bridge's inverse leaves cu_seqlens_q_padded None (ms-swift sets it only on NPU, to the
  same boundaries).

Stubs (imports the checked code never calls, or stand-ins named here): logging, transformers,
peft, PIL, modelscope, accelerate and swift's own helpers; `to_device` is the identity and
`get_current_device` 'cpu' (the batch stays where it is); megatron's parallel_state is
`ParallelStateStandIn` (one process plays every rank); megatron-core's
`_undo_attention_load_balancing` runs as installed, with TransformerEngine's
`thd_get_partitioned_indices` (a CUDA kernel) played by `TEPartitionStandIn`, transcribed from
TE's `thd_partition_indices_kernel`.

Reproducers (torch and the wheels; megatron imports answered by placeholders, except for the
inverses that call megatron-core's undo, which need megatron-core): the batch path's fetches
the mcore-bridge wheel too ($MCORE_BRIDGE_WHEEL, else pip download).

Where the code is: `release.py` (loading the files, the stand-ins and stubs), `truth.py` (the
ground truth of a row), `batch.py` (ms-swift's batch path), `split.py` (mcore-bridge's split),
`round_trip.py` (the three inverses), and the reproducers' code, shipped by `inspect.getsource`:
`reproducers.py` (the shared parts and the split's), `batch_reproducer.py`, `inverse_reproducer.py`.
"""

from __future__ import annotations

from recipe.checks.upstream.kit.checked import Library
from recipe.checks.upstream.libraries.ms_swift.batch import BatchChecked
from recipe.checks.upstream.libraries.ms_swift.release import (
    BRIDGE,
    BRIDGE_FILE,
    SPLIT_FILE,
    SWIFT,
    TRAINER_FILE,
    UTILS_FILE,
    Target,
)
from recipe.checks.upstream.libraries.ms_swift.round_trip import (
    BridgeReconstructChecked,
    SwiftReconstructChecked,
    TrainerReconstructChecked,
)
from recipe.checks.upstream.libraries.ms_swift.split import SplitChecked

LIBRARY = Library(
    SWIFT,
    (
        Target("get_batch_on_this_cp_rank", SPLIT_FILE, BatchChecked),
        Target("utils.reconstruct_tensor_cp", UTILS_FILE, SwiftReconstructChecked),
        Target("trainers.reconstruct_tensor_cp", TRAINER_FILE, TrainerReconstructChecked),
    ),
    releases=("4.6.0",),
)
MCORE_BRIDGE = Library(
    BRIDGE,
    (
        Target("split_cp_inputs", BRIDGE_FILE, SplitChecked),
        Target("reconstruct_tensor_cp", BRIDGE_FILE, BridgeReconstructChecked),
    ),
    releases=("1.6.5",),
)
LIBRARIES = {SWIFT: LIBRARY, BRIDGE: MCORE_BRIDGE}
