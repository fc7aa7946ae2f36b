"""Checkpoints that any parallel layout can resume: full tensors in torch.distributed.checkpoint.

A checkpoint holds the tensors of the tp=1 model, whatever layout wrote it: each rank joins its
tensor-parallel shards before saving and slices its own shard after loading (`tensors`); context-
and data-parallel ranks hold full copies, which DCP's planner writes once. So a run written at
cp=2, dp=2 or tp=2 resumes at cp=1 and back: the names and shapes on disk are the same for every
layout.

Why torch.distributed.checkpoint (DCP) and not megatron-core's dist_checkpointing: the recipe's
optimizer is torch's AdamW on the bare model, while dist_checkpointing resharding needs the
`sharded_state_dict()` of megatron's own optimizer wrappers; DCP is part of torch on every
supported stack, writes in parallel from every rank, and its metadata says each tensor's shape and
dtype, which is what loading into another layout needs.

On disk, `<run dir>/checkpoints/step_00000010/`: DCP's `.metadata` and `__<rank>_0.distcp`, and
`manifest.json` (step, data position, the metrics so far, the writing layout and config, and
every file of the checkpoint with its size and SHA-256: `manifest`). It is written as
`step_00000010.partial` and renamed only when complete (`store`). Before a checkpoint is loaded it
is verified against its manifest: `trainer.resume=auto` passes over a damaged one with a warning
naming it and takes the newest good one; a damaged checkpoint named explicitly is an error naming
the file (`resume`).
"""

from recipe.checkpoint.manifest import (
    FORMAT_VERSION,
    MUST_MATCH,
    REPORTED,
    checkpoint_manifest,
    config_fingerprint,
    file_listing,
    read_manifest,
    resume_differences,
)
from recipe.checkpoint.optimizer_state import load_torch_optimizer_state, torch_optimizer_state
from recipe.checkpoint.resume import (
    checkpoint_directories,
    checkpoint_name,
    checkpoint_problem,
    complete_checkpoints,
    prune_checkpoints,
    resolve_resume,
    set_aside_newer,
)
from recipe.checkpoint.store import CheckpointWriteError, read_tensors, save_checkpoint
from recipe.checkpoint.tensors import full_state, load_full_state, tp_shard

__all__ = [
    "FORMAT_VERSION",
    "MUST_MATCH",
    "REPORTED",
    "CheckpointWriteError",
    "checkpoint_directories",
    "checkpoint_manifest",
    "checkpoint_name",
    "checkpoint_problem",
    "complete_checkpoints",
    "config_fingerprint",
    "file_listing",
    "full_state",
    "load_full_state",
    "load_torch_optimizer_state",
    "prune_checkpoints",
    "read_manifest",
    "read_tensors",
    "resolve_resume",
    "resume_differences",
    "save_checkpoint",
    "set_aside_newer",
    "torch_optimizer_state",
    "tp_shard",
]
