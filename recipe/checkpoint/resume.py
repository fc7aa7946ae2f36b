"""Which checkpoint a run resumes: discovery, verification, and the timeline a resume starts.

`trainer.resume=auto` takes the newest checkpoint of the run directory that verifies against its
manifest (files, sizes, checksums, the step in its name), passing over a damaged one with a
warning naming it; a damaged checkpoint named explicitly is an error naming the file. A resume
from step N sets aside the abandoned timeline's later checkpoints, and only the newest
`trainer.checkpoint_keep` complete ones stay.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from recipe.checkpoint.fs import fsync_directory
from recipe.checkpoint.manifest import read_manifest
from recipe.data.fingerprint import sha256
from recipe.errors import ConfigError
from recipe.log import get_logger
from recipe.rundir.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    PARTIAL_SUFFIX,
    SET_ASIDE_DIR,
    STEP_PREFIX,
    step_name,
    step_of,
)


def checkpoint_name(step: int) -> str:
    """The directory name of step `step`'s checkpoint."""
    return step_name(step)


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        step = step_of(entry.name)
        if step is not None and (entry / MANIFEST_FILE).is_file():
            found.append((step, entry))
    return sorted(found)


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """What is wrong with a complete-looking checkpoint, or None: an unreadable manifest, a step
    that is not the one in the directory's name, a listed file missing, cut short or changed.
    (A checkpoint written before files were listed has nothing to verify them against.)"""
    checkpoint = Path(checkpoint)
    try:
        manifest = read_manifest(checkpoint)
    except ConfigError as err:
        return str(err)
    named = step_of(checkpoint.name)
    if named is not None and named != manifest.get("step"):
        return (
            f"{checkpoint / MANIFEST_FILE} says step {manifest.get('step')}, the directory's name "
            f"step {named}"
        )
    for name in sorted(_files_the_tensors_need(checkpoint) - set(manifest.get("files") or {})):
        # A checkpoint written before every rank's part was checked at write time: a rank that
        # wrote elsewhere left a manifest that verifies without the file the tensors are in.
        if not (checkpoint / name).is_file():
            return f"{checkpoint / name} is missing (the checkpoint's tensors are stored in it)"
    for name, expected in (manifest.get("files") or {}).items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path} has {size} bytes, the manifest lists {expected['size']}"
        if sha256(path) != expected["sha256"]:
            return f"{path} does not match its checksum in the manifest (the file changed)"
    return None


def _files_the_tensors_need(checkpoint: Path) -> set[str]:
    """The files DCP's metadata stores tensors in (empty when there is no readable metadata:
    the manifest's listing then decides)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        stored = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    except Exception:  # no .metadata, or another format: the listed files are all we know
        return set()
    return {info.relative_path for info in (stored or {}).values()}


def _newest_good(directory: Path) -> Path | None:
    """The newest checkpoint in `directory` that verifies, warning about each newer one that
    does not (it stays on disk, for a look)."""
    for _, path in reversed(complete_checkpoints(directory)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        get_logger(__name__).warning(f"skipping damaged checkpoint {path}: {problem}")
    return None


def resolve_resume(spec: str | None, run_dir: str | Path | None) -> Path | None:
    """The checkpoint that `trainer.resume` names: None (start fresh), `auto` (the newest good
    one in this run directory, or none yet), or a path to a checkpoint (which must verify), a
    checkpoints directory or a run directory (its newest good one)."""
    if spec is None:
        return None
    if spec == "auto":
        if run_dir is None:
            return None
        directory = Path(run_dir) / CHECKPOINTS_DIR
        found = _newest_good(directory)
        if found is None and complete_checkpoints(directory):
            # Starting over here would prune its own new checkpoints (the damaged ones count as
            # newer) and a requeued job would never get past them: refused, as when named.
            raise ConfigError(_every_one_damaged(spec, directory))
        return found
    path = Path(spec)
    if path.name.endswith(PARTIAL_SUFFIX):  # even one that already holds its manifest
        raise ConfigError(
            f"trainer.resume={spec}: that checkpoint was never completed (the run stopped while "
            "writing it); resume from the one before it"
        )
    if (path / MANIFEST_FILE).is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            older = [p for _, p in complete_checkpoints(path.parent) if p != path]
            hint = f"; the newest before it is {older[-1]}" if older else ""
            raise ConfigError(f"trainer.resume={spec} is damaged: {problem}{hint}")
        return path
    for directory in (path / CHECKPOINTS_DIR, path):
        if complete_checkpoints(directory):
            found = _newest_good(directory)
            if found is None:
                raise ConfigError(_every_one_damaged(spec, directory))
            return found
    what = "holds no complete checkpoint" if path.exists() else "does not exist"
    raise ConfigError(
        f"trainer.resume={spec} {what}; give a checkpoint directory (.../checkpoints/step_N), a "
        "run directory that has checkpoints/, or trainer.resume=auto"
    )


def _every_one_damaged(spec: str, directory: Path) -> str:
    return (
        f"trainer.resume={spec}: every checkpoint in {directory} is damaged (each is named "
        "above); restore one and name it in trainer.resume, or start over in a new hydra.run.dir"
    )


def set_aside_newer(directory: Path, step: int) -> list[Path]:
    """A resume from step N starts a new timeline: the checkpoints of the abandoned one past N
    (damaged ones included) move to `set_aside/from_step_N-<time>/`, kept for a look, never
    resumed by `auto` and not counted by `trainer.checkpoint_keep`. Returns where they went."""
    newer = [
        entry
        for entry in (directory.iterdir() if directory.is_dir() else [])
        if (found := step_of(entry.name)) is not None and found > step
    ]
    if not newer:
        return []
    target = directory / SET_ASIDE_DIR / f"from_step_{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True, exist_ok=True)
    moved = []
    for entry in sorted(newer):
        os.replace(entry, target / entry.name)
        moved.append(target / entry.name)
    fsync_directory(directory)
    return moved


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints, and any left-over .partial."""
    for _, path in complete_checkpoints(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for entry in directory.glob(f"{STEP_PREFIX}*{PARTIAL_SUFFIX}"):
        shutil.rmtree(entry, ignore_errors=True)
