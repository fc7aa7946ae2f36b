"""AReaL's packed context-parallel split, label roll and reassembly (PyPI `areal`), read from
its wheel and run the way its Megatron engine runs them.

What is run, all of it the release's own code (line numbers: areal 1.0.4):
- the padding: `pad_mb_list` (areal/utils/data.py:981, which calls `pad_packed_tensor_dict`,
  :818) with the engine's alignment, i.e. the statements of `MegatronEngine._prepare_mb_list`
  (areal/engine/megatron_engine.py:2081-2092): `align_to_multiple_of = tp_size * cp_size * 2 if
  cp_size > 1 else tp_size`, `lcm(., DEFAULT_VECTORIZED_ALIGNMENT_BYTES = 16)` with fp8, then
  `pad_mb_list(mb_list, pad_value=0.0, pad_to_maximum=..., seq_align_to=align_to_multiple_of)`.
  Each sequence is padded to a multiple of the alignment, then one padding sequence is appended
  so the micro-batch is a multiple of lcm(alignment, 256) tokens (or of `max_tokens_per_mb`
  rounded up to it, with `pad_to_maximum`);
- the split (target `preprocess_packed_seqs_context_parallel`, packed_context_parallel.py:14):
  the tokens of each rank, and the labels as the engine makes them, `torch.roll` of the whole
  padded stream by -1 and then `split_packed_seqs_for_context_parallel` (:74) of it
  (megatron_engine.py:898-904). Checked with the zigzag contract (`ContractChecked`, `assess`):
  tokens on real slots, labels wherever the same sequence has a next token. AReaL shards no
  position ids and no loss mask: megatron derives RoPE positions from the padded cu_seqlens (the
  full-length position_ids the forward passes unsplit, :294/:381, are read only by mrope and
  learned absolute embeddings: not checked), and the loss mask is applied after the
  reassembly, on the unpadded stream;
- the reassembly (target `reassemble_cp_packed_logprobs`, :148, with `_build_cp_reassemble_indices`
  :110): every rank's shard of a per-token tensor (made by the release's split, the layout of the
  model's output) gathered back and unpadded as `_compute_logprobs_and_loss` does it
  (megatron_engine.py:2187-2206, `unpad_logits` at data.py:1046) must be the original per-token
  tensor, on every rank;
- `postprocess_packed_seqs_context_parallel` (:188): the same round trip through its gather.
  The engine's forward calls `packed_context_parallel_forward` (:286) with `gather_cp_output=not
  cp_local` (megatron_engine.py:875-881), which passes it on as `gather_output` (:411-413): with
  CP > 1, 1.0.4's engine never reaches the gather. The function is public and is checked with
  each option drawn.

The engine's statements are not retyped here: they are found in the wheel's
megatron_engine.py by their targets (`ast`), their names checked against what the check
provides (an unknown one refuses the check: it may change the layout) and executed.

Options. Drawn (every target): `enable_fp8` (the engine's alignment becomes lcm(2*cp*tp, 16)),
`pad_to_maximum` and `max_tokens_per_mb` (the micro-batch padded to that length, rounded up).
Drawn for the postprocess target: `post_process` (False: a pipeline stage that is not the last
returns its input), `gather_output`, `pass_cu_seqlens` (False: `cu_seqlens=None`) and
`output_width` (the last dim of [1, T/cp, V]: 1 a critic's value, 3 a small vocabulary).
Fixed, with the reason: `pad_value` 0.0 (what the engine passes; padding's content is never
compared), `batch_align_to` None (the engine does not pass it), the functions' tensor arguments
(the engine's padded micro-batch), `is_vision_model`/`use_padded_seq` False (the engine refuses
CP > 1 with either, megatron_engine.py:355-376) and tree training off (it asserts cp_size == 1,
:2030). cp (2, 4, 8) and tp (1, 2) are drawn with the micro-batch; cp = 1 splits nothing. An
option of a checked signature that is neither is
unknown and refuses the check (UpstreamUnavailable).

Stubs (imports the run code never calls): for packed_context_parallel.py, `areal.utils.data`
(only `is_multi_modal_key`, the real one from the loaded data.py); for data.py, `einops`,
`torchdata.stateful_dataloader`, `areal.api.cli_args` (config dataclasses used as annotations),
`areal.infra.platforms`, `areal.utils.seqpack` (the allocator that splits a batch into
micro-batches, not run: each case is one micro-batch, packed by the release's
`pack_tensor_dict`, data.py:492, as `_prepare_mb_list` packs each, megatron_engine.py:2075),
`areal.utils` (its `logging` is the standard one, what areal's `getLogger` wraps) and
`areal.utils.math` (`align`, the real one from the wheel's math.py). megatron-core and torch
are the real installed ones; the module's `mpu`, `dist` and `dist_F` are stand-ins while one
process plays every rank (the all-gathers hand back each rank's shard as that rank's split
made it).

Where it lives (recipe/checks/upstream/libraries/areal/): `shipped_run.py` and
`shipped_problems.py` are the code a reproducer ships verbatim (the release run as the engine
runs it; the ground truth and the comparisons with it), self-contained, since
`inspect.getsource` copies them into a standalone script; `release.py` loads a release, finds the
engine's statements and checks their names and the functions' signatures against what the check
knows (the drawn and fixed options); `targets.py` the three checked targets, their negative
controls and their reproducers.
"""

from __future__ import annotations

from recipe.checks.upstream.kit.checked import Library
from recipe.checks.upstream.libraries.areal.targets import ArealTarget

DISTRIBUTION = "areal"

LIBRARY = Library(
    DISTRIBUTION,
    (
        ArealTarget("preprocess_packed_seqs_context_parallel", kind="split"),
        ArealTarget("reassemble_cp_packed_logprobs", kind="reassembly"),
        ArealTarget("postprocess_packed_seqs_context_parallel", kind="postprocess"),
    ),
    releases=("1.0.4",),
)
