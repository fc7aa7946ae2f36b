"""The values a setting can take, and the fp32 tolerances, spelled once.

A leaf module (it imports nothing of the recipe): the schema (`config/`) validates against these
tuples, and the code that acts on a value imports the same names, so a new option is added in one
place and an unknown one is refused everywhere alike.
"""

from __future__ import annotations

POSITION_EMBEDDINGS = ("rope", "learned_absolute")
ATTENTION_BACKENDS = ("auto", "torch", "te")
DATA_SOURCES = ("markov", "pydoc", "files", "shapes")
WANDB_MODES = ("disabled", "offline", "online")
VERL_VARIANTS = ("verl_fixed", "verl_legacy")
"""verl's per-rank formulas after and before PR #6267 (recipe/parallel/cp/verl.py)."""
CP_PREPROCESS = ("index", *VERL_VARIANTS)
"""The built-in CP preprocessing names (beside package.module:function and LIBRARY@VERSION)."""
PRECISIONS = ("auto", "fp32", "bf16")
CP_COMM_TYPES = ("p2p", "a2a", "all_gather")
PASS_POSITION_IDS = ("auto", "mtp_only", "not_vision", "always", "never")
CU_SEQLENS_Q = ("padded", "real")
"""What megatron's PackedSeqParams.cu_seqlens_q holds (convention.cu_seqlens_q)."""
MTP_LOSS_MASKS = ("passed", "all_ones")
"""Whether the model call hands the loss mask to megatron's MTP block (convention.mtp_loss_mask)."""
VISION_POSITIONS = ("full_stream", "rank_local", "stock_sharded", "text_1d")
MTP_SCALINGS = ("exact", "upstream")
ENGINES = ("megatron", "reference")
"""trainer.engine: megatron-core's DDP, optimizer and schedules, or the recipe's own loop (the
reference megatron's is checked against)."""
NONFINITE_ACTIONS = ("stop", "skip_step")
"""trainer.on_nonfinite: what the step guard does with a NaN/inf loss or gradient norm."""
SPIKE_ACTIONS = ("warn", "skip_step", "stop")
SEQUENCE_ORDERS = ("data", "reversed")
"""batching.sequence_order: sequences inside a micro-batch in data order, or reversed (the noise
twin: the same math, summed in another order)."""
"""trainer.loss_spike.action: what the step guard does with a spike."""

MUTANTS = (
    "none",
    "prefix_positions",
    "local_arange_positions",
    "chunk_local_positions",
    "position_ids_contiguous",
    "labels_rolled_after_split",
    "back_chunk_label_off_by_one",
    "labels_contiguous",
    "loss_mask_contiguous",
    "mtp_mask_contiguous",
    "swapped_zigzag_chunks_last_rank",
    "padding_in_loss",
    "rank_local_loss",
    "loss_scaled_by_cp",
    "one_rank_loss_scale_3e-5",
    "one_token_weight_5e-2",
    "mtp_no_loss_mask",
    "mtp_roll_real_offsets",
    "mtp_local_counts",
    "norm_grads_not_reduced_over_cp",
    "position_embedding_grad_not_reduced",
    "mtp_grads_not_reduced",
    "weights_rounded_to_16_bits",
)
"""mutant.name: a broken copy of the CP/MTP/loss path, for the training mutation score
(recipe/training/mutants.py, where each is described; `none` trains correctly)."""

FP32_RTOL = 1e-5
"""Largest relative difference per step between two fp32 runs on CPU that passes parity."""
NOISE_FLOORS = ("auto", "twin", "fixed")
"""compare.noise_floor: where each step's tolerance comes from (recipe/compare/judge.py)."""
NOISE_MARGIN = 10.0
"""How far beyond its baseline's own fp32 drift (its noise twin's) a correct run may go. Measured
on the default config (docs/comparing-runs.md, "The noise floor")."""
ANCHOR_EVERY = 100
"""compare.anchor_every's default: a long run's baseline keeps its state every this many steps."""
ANCHOR_STEPS = 2
"""compare.anchor_steps's default: steps each layout takes from an anchor's state."""
FP32_TOKEN_ATOL = 1e-5
"""Largest absolute per-token loss difference between two fp32 runs on CPU that passes."""
CUDA_FP32_TOKEN_ATOL = 5e-5
"""Per-token loss bound of cp=2 against cp=1 in fp32 on CUDA (gpu_check's cp2_one_gpu): 5x the
largest difference measured on an H200."""
