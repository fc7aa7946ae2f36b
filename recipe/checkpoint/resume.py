"""Which checkpoint a run resumes: discovery, verification, and the timeline a resume starts.

`trainer.resume=auto` takes the newest checkpoint of the run directory that verifies against its
manifest (files, sizes, checksums, the step in its name), passing over a damaged one with a
warning naming it; a damaged checkpoint named explicitly is an error naming the file. Every
`step_N` directory is a checkpoint: one without its manifest (lost, or an empty directory) is
damaged, never mistaken for "no checkpoint yet", since starting over would write over it; so is
one whose manifest lists no files (the older format) beside no DCP `.metadata` naming any: there
is nothing to load. A `step_N.partial` holding its manifest is a finished write whose rename was
cut short: kept, named, never pruned. A resume from step N sets aside the abandoned timeline's
later checkpoints, and only the newest `trainer.checkpoint_keep` complete ones stay.
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

# torch.distributed.checkpoint's index of the stored tensors and the files that hold them
DCP_METADATA = ".metadata"


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


def checkpoint_directories(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_N` directory in `directory`, damaged ones included, oldest
    first: what `auto` must account for before it may start over."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step_of(entry.name), entry) for entry in directory.iterdir() if entry.is_dir()]
    return sorted((step, entry) for step, entry in found if step is not None)


def finished_partials(directory: str | Path) -> list[Path]:
    """The `step_N.partial` directories in `directory` that hold their manifest: writes that
    finished but were never renamed (the run died between the two). Kept for the user to check
    and rename; a `.partial` without one is an abandoned write and is pruned."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        entry
        for entry in directory.glob(f"{STEP_PREFIX}*{PARTIAL_SUFFIX}")
        if (entry / MANIFEST_FILE).is_file()
    )


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """What is wrong with a checkpoint directory, or None: no manifest, an unreadable one, a step
    that is not the one in the directory's name, a listed file missing, cut short or changed, or
    nothing to load: a manifest that lists no files (written before files were listed, it has no
    sizes or checksums to verify) is taken only with DCP's `.metadata` naming files that are all
    there."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / MANIFEST_FILE).is_file():
        return (
            f"{checkpoint / MANIFEST_FILE} is missing ({_contents(checkpoint)}): without it "
            "nothing can verify the files or say which step and config they are"
        )
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
    listed = manifest.get("files") or {}
    needed = _files_the_tensors_need(checkpoint)
    if not listed and not needed:
        # An older manifest over a directory whose shards are gone (or never came: a copy of the
        # manifest alone) verified vacuously, and `auto` took it: the load would then fail, or
        # a fresh start after it would write over the directory.
        index = checkpoint / DCP_METADATA
        why = "is unreadable or names no files" if index.is_file() else "is missing"
        return (
            f"{checkpoint / MANIFEST_FILE} lists no files and {index}, DCP's index of the "
            f"tensors' files, {why} ({_contents(checkpoint)}): there is nothing to load"
        )
    for name in sorted(needed - set(listed)):
        # A checkpoint written before every rank's part was checked at write time: a rank that
        # wrote elsewhere left a manifest that verifies without the file the tensors are in.
        if not (checkpoint / name).is_file():
            return f"{checkpoint / name} is missing (the checkpoint's tensors are stored in it)"
    for name, expected in listed.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path} has {size} bytes, the manifest lists {expected['size']}"
        if sha256(path) != expected["sha256"]:
            return f"{path} does not match its checksum in the manifest (the file changed)"
    return None


def _contents(checkpoint: Path) -> str:
    """What a checkpoint directory holds, for a message that says it is damaged."""
    held = sorted(entry.name for entry in checkpoint.iterdir()) if checkpoint.is_dir() else []
    if not held:
        return "the directory is empty"
    return f"it holds {', '.join(held[:4])}{' ...' if len(held) > 4 else ''}"


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
    does not (it stays on disk, for a look), and about each finished `.partial` newer than it."""
    log = get_logger(__name__)
    found = None
    for _, path in reversed(checkpoint_directories(directory)):
        problem = checkpoint_problem(path)
        if problem is None:
            found = path
            break
        log.warning(f"skipping damaged checkpoint {path}: {problem}")
    for partial in finished_partials(directory):
        step = _partial_step(partial)
        if found is None or (step is not None and step > (step_of(found.name) or 0)):
            log.warning(_unrenamed(partial))
    return found


def _partial_step(partial: Path) -> int | None:
    """The step a `step_N.partial` name stands for."""
    return step_of(partial.name.removesuffix(PARTIAL_SUFFIX))


def _unrenamed(partial: Path) -> str:
    final = partial.with_name(partial.name[: -len(PARTIAL_SUFFIX)])
    return (
        f"skipping {partial}: its write finished (it holds its manifest) but the rename to "
        f"{final.name} never happened; it is kept: to resume from it, rename it to {final} "
        "(resume verifies it first)"
    )


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
        if found is None and (checkpoint_directories(directory) or finished_partials(directory)):
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
    if (path / MANIFEST_FILE).is_file() or (path.is_dir() and step_of(path.name) is not None):
        problem = checkpoint_problem(path)
        if problem is not None:
            older = (p for _, p in reversed(checkpoint_directories(path.parent)) if p != path)
            good = next((p for p in older if checkpoint_problem(p) is None), None)
            hint = f"; the newest before it is {good}" if good else ""
            raise ConfigError(f"trainer.resume={spec} is damaged: {problem}{hint}")
        return path
    for directory in (path / CHECKPOINTS_DIR, path):
        if checkpoint_directories(directory) or finished_partials(directory):
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
        "above; nothing was changed); restore one and name it in trainer.resume, or start over "
        "in a new hydra.run.dir"
    )


def set_aside_newer(directory: Path, step: int) -> list[Path]:
    """A resume from step N starts a new timeline: the checkpoints of the abandoned one past N
    (damaged ones included) move to `set_aside/from_step_N-<time>/`, kept for a look, never
    resumed by `auto` and not counted by `trainer.checkpoint_keep`. Returns where they went."""
    newer = [path for found, path in checkpoint_directories(directory) if found > step]
    newer += [path for path in finished_partials(directory) if (_partial_step(path) or 0) > step]
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
    """Remove all but the newest `keep` complete checkpoints, and any abandoned .partial (one
    without its manifest: a finished one that was never renamed stays)."""
    for _, path in complete_checkpoints(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    kept = set(finished_partials(directory))
    for entry in directory.glob(f"{STEP_PREFIX}*{PARTIAL_SUFFIX}"):
        if entry not in kept:
            shutil.rmtree(entry, ignore_errors=True)
