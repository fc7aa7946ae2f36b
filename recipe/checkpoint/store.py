"""A checkpoint's files: torch.distributed.checkpoint (DCP) from every rank, complete or absent.

DCP writes in parallel from every rank (full copies once, by its planner), and its metadata says
each tensor's shape and dtype, which is what loading into another layout needs. Files and the
manifest go to `step_N.partial`, renamed to `step_N` only once complete: a run killed mid-write
leaves a `.partial` that resume never reads. A write that fails says why, naming the path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from recipe.checkpoint.fs import fsync_directory, root_cause, write_atomically
from recipe.checkpoint.manifest import file_listing
from recipe.checkpoint.resume import checkpoint_name, prune_checkpoints
from recipe.errors import RecipeError
from recipe.parallel import collectives
from recipe.rundir.layout import MANIFEST_FILE, PARTIAL_SUFFIX


class CheckpointWriteError(RecipeError, OSError):
    """A checkpoint could not be written (full disk, permissions); the message names the path."""


def save_checkpoint(
    directory: Path, step: int, tensors: dict, manifest: dict, is_main: bool, keep: int
) -> Path:
    """Write a checkpoint with every rank (collective), atomically: DCP files and the manifest
    go to `step_N.partial`, renamed to `step_N` once complete; then only the newest `keep`
    complete checkpoints stay. Returns the checkpoint's path on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    final = directory / checkpoint_name(step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    try:
        if is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        collectives.barrier()
        dcp.save(tensors, checkpoint_id=str(partial))
        rank = collectives.global_rank()
        written = collectives.gather_to_main(sorted(p.name for p in partial.glob(f"__{rank}_*")))
        if is_main:
            files = file_listing(partial)
            check_every_rank_wrote_here(partial, written, files)
            manifest = {**manifest, "path": str(final), "written_at": time.time(), "files": files}
            write_atomically(partial / MANIFEST_FILE, json.dumps(manifest) + "\n")
            if final.exists():  # the same step written again (a resumed run that had finished)
                shutil.rmtree(final)
            os.replace(partial, final)
            fsync_directory(directory)
            prune_checkpoints(directory, keep)
    except (Exception, CheckpointException) as err:  # DCP wraps each rank's OSError
        raise CheckpointWriteError(
            f"could not write checkpoint {partial}: {root_cause(err, directory)}. Free space or "
            "fix permissions there; the incomplete directory is never read by resume"
        ) from None
    collectives.barrier()
    return final


def check_every_rank_wrote_here(partial: Path, written: list[list[str]], listed) -> None:
    """Each rank's files, as that rank sees them, are in the directory rank 0 lists: otherwise
    the ranks wrote to different places (other run directories, or a path that is not one
    shared filesystem) and the checkpoint would be incomplete."""
    for rank, names in enumerate(written):
        lost = [name for name in names if name not in listed]
        if lost:
            raise CheckpointWriteError(
                f"checkpoint {partial} lacks rank {rank}'s {', '.join(lost)}, which rank {rank} "
                "wrote where it sees that path: every rank must write into one run directory on "
                "a filesystem all of them see (the same hydra.run.dir on every rank)"
            )


def read_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, full (tp=1) and on the CPU, by name: what
    `load_full_state` puts into a model of any layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    target = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(target, checkpoint_id=str(checkpoint))
    return target
