"""Checkpoints that any parallel layout can resume: full tensors in torch.distributed.checkpoint.

A checkpoint holds the tensors of the tp=1 model, whatever layout wrote it: each rank joins its
tensor-parallel shards (megatron marks them `tensor_model_parallel` with a `partition_dim`) before
saving, and slices its own shard after loading. Context- and data-parallel ranks hold full copies,
which DCP's planner writes once. So a run written at cp=2, dp=2 or tp=2 resumes at cp=1 and back:
the names and shapes on disk are the same for every layout.

Why torch.distributed.checkpoint (DCP) and not megatron-core's dist_checkpointing: the recipe's
optimizer is torch's AdamW on the bare model, while dist_checkpointing resharding needs the
`sharded_state_dict()` of megatron's own optimizer wrappers; DCP is part of torch on every
supported stack, writes in parallel from every rank, and its metadata says each tensor's shape and
dtype, which is what loading into another layout needs. Joining the shards costs one full copy of
the model per rank, which suits the model sizes this recipe compares.

On disk, `<run dir>/checkpoints/step_00000010/`: DCP's `.metadata` and `__<rank>_0.distcp`, and
`manifest.json` (step, data position, the metrics so far, the writing layout and config, and
every file of the checkpoint with its size and SHA-256). It is written as `step_00000010.partial`
and renamed only when complete: a run killed mid-write leaves a `.partial` that resume never
reads. Before a checkpoint is loaded it is verified against its manifest (files, sizes, checksums,
the step in its name): `trainer.resume=auto` passes over a damaged one with a warning naming it
and takes the newest good one; a damaged checkpoint named explicitly is an error naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from recipe.config import TrainConfig
from recipe.data.fingerprint import data_fingerprint, fingerprint_changes, sha256
from recipe.environment import cuda_available
from recipe.errors import ConfigError, RecipeError
from recipe.log import get_logger
from recipe.parallel import collectives

CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step_(\d+)$")

# What a resumed run must share with the run that wrote the checkpoint: the model's shapes and
# the data stream. Layout (tp, cp, dp, micro-batching) may differ; optimizer and schedule
# settings, the precision, determinism and the CP preprocessing may be changed on purpose: they
# change the numbers, so each change is recorded in the resume marker and logged.
MUST_MATCH = ("model", "mtp", "vision", "data", "batching.tokens_per_step")
REPORTED = (
    "optim",
    "trainer.max_steps",
    "trainer.precision",
    "trainer.deterministic",
    # the engine may change: both keep torch AdamW's per-parameter state under the same names
    "trainer.engine",
    "trainer.megatron",
    "cp.preprocess",
)


class CheckpointWriteError(RecipeError, OSError):
    """A checkpoint could not be written (full disk, permissions); the message names the path."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and (entry / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def file_listing(checkpoint: str | Path) -> dict[str, dict]:
    """{file name: {"size": bytes, "sha256": hex}} of every file a checkpoint holds but its
    manifest (which lists them)."""
    listing = {}
    for path in sorted(Path(checkpoint).iterdir()):
        if path.is_file() and path.name != MANIFEST_FILE:
            listing[path.name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    return listing


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """What is wrong with a complete-looking checkpoint, or None: an unreadable manifest, a step
    that is not the one in the directory's name, a listed file missing, cut short or changed.
    (A checkpoint written before files were listed has nothing to verify them against.)"""
    checkpoint = Path(checkpoint)
    try:
        manifest = read_manifest(checkpoint)
    except ConfigError as err:
        return str(err)
    named = _NAME.match(checkpoint.name)
    if named and int(named.group(1)) != manifest.get("step"):
        return (
            f"{checkpoint / MANIFEST_FILE} says step {manifest.get('step')}, the directory's name "
            f"step {int(named.group(1))}"
        )
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
        return _newest_good(Path(run_dir) / CHECKPOINTS_DIR)
    path = Path(spec)
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
                raise ConfigError(
                    f"trainer.resume={spec}: every checkpoint in {directory} is damaged (each is "
                    "named above)"
                )
            return found
    if path.name.endswith(PARTIAL_SUFFIX):
        raise ConfigError(
            f"trainer.resume={spec}: that checkpoint was never completed (the run stopped while "
            "writing it); resume from the one before it"
        )
    what = "holds no complete checkpoint" if path.exists() else "does not exist"
    raise ConfigError(
        f"trainer.resume={spec} {what}; give a checkpoint directory (.../checkpoints/step_N), a "
        "run directory that has checkpoints/, or trainer.resume=auto"
    )


def read_manifest(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read checkpoint manifest {path}: {err}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"{path} is checkpoint format {manifest.get('format')}; this recipe reads format "
            f"{FORMAT_VERSION}"
        )
    return manifest


def config_fingerprint(cfg) -> dict:
    """The config values a checkpoint records, flattened to dotted keys."""
    return _flatten(
        {
            "model": asdict(cfg.model),
            "mtp": asdict(cfg.mtp),
            "vision": asdict(cfg.vision),
            "data": asdict(cfg.data),
            "batching": asdict(cfg.batching),
            "optim": asdict(cfg.optim),
            "trainer": {
                "max_steps": cfg.trainer.max_steps,
                "seed": cfg.trainer.seed,
                "precision": cfg.trainer.precision,
                "deterministic": cfg.trainer.deterministic,
                "engine": cfg.trainer.engine,
                "megatron": {
                    "calculate_per_token_loss": cfg.trainer.megatron.calculate_per_token_loss,
                    "sync_mtp_position_embeddings": (
                        cfg.trainer.megatron.sync_mtp_position_embeddings
                    ),
                },
            },
            "cp": {"preprocess": cfg.cp.preprocess},
            "parallel": {
                "tp": cfg.parallel.tp,
                "cp": cfg.cp.size,
                "dp": cfg.parallel.dp,
                "pp": cfg.parallel.pp,
            },
        }
    )


def resume_differences(manifest: dict, cfg) -> list[str]:
    """The settings changed since the checkpoint that are allowed to change (as `key: old ->
    new`); raises ConfigError when one that must match differs."""
    old, new = manifest["config"], config_fingerprint(cfg)
    # A key the checkpoint does not know was added by a later recipe; at its default it is the
    # behaviour the checkpoint was written with.
    defaults = config_fingerprint(TrainConfig())
    old = {**{k: v for k, v in defaults.items() if k not in old and k in new}, **old}

    def changed(prefixes):
        keys = sorted(k for k in set(old) | set(new) if k.startswith(prefixes))
        return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]

    fatal = changed(MUST_MATCH)
    inputs = fingerprint_changes(manifest.get("inputs", {}), data_fingerprint(cfg.data))
    if "inputs" in manifest and inputs and not cfg.trainer.allow_data_change:
        raise ConfigError(
            f"checkpoint {manifest['path']} was written on other input files: "
            + "; ".join(inputs)
            + ". Its data position points into the files as they were: restore them, or set "
            "trainer.allow_data_change=true to continue on the new ones on purpose"
        )
    if fatal:
        raise ConfigError(
            f"checkpoint {manifest['path']} was written by a different model or data stream: "
            + "; ".join(fatal)
            + ". Resume with the settings that wrote it (the layout may differ), or start fresh"
        )
    inputs = [f"input {line}" for line in inputs] if "inputs" in manifest else []
    return changed(REPORTED) + inputs


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(node) if isinstance(node, tuple) else node}


# --- tensors: full on disk, this rank's shard in memory ---------------------------------------


def tp_shard(full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's contiguous slice of a full tensor along `partition_dim`."""
    if full.shape[partition_dim] % tp_size:
        raise ValueError(
            f"dimension {partition_dim} of size {full.shape[partition_dim]} does not split into "
            f"{tp_size} tensor-parallel shards"
        )
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def _partition_dim(param) -> int | None:
    """The dimension megatron shards `param` along, or None for a full copy on every rank."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError(
            "a parameter with partition_stride > 1 (interleaved shards) cannot be joined by "
            "concatenation; the recipe's layer spec has none"
        )
    return param.partition_dim


def full_state(model, optimizer_state: dict, tp_group, names: dict[str, str] | None = None):
    """Weights, AdamW moments and RNG state as tp=1 tensors on the CPU, keyed by name (a
    pipeline stage's parameters by their `names` in the whole model). `optimizer_state` is
    {parameter: {"exp_avg": ..., ...}} with this rank's tp shard of every moment."""
    params = _named_parameters(model, names)
    state: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        state[f"model/{name}"] = _joined(param.detach(), param, tp_group)
    for name, buffer in _persistent_buffers(model).items():
        state[f"model/{name}"] = buffer.detach().cpu().clone()  # full on every rank
    for name, param in params.items():
        for key, value in optimizer_state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                value = _joined(value, param, tp_group)
            state[f"optim/{name}/{key}"] = (
                value.detach().cpu() if torch.is_tensor(value) else (torch.tensor(value))
            )
    state["rng/cpu"] = torch.get_rng_state()
    if cuda_available() and torch.cuda.is_initialized():
        state["rng/cuda"] = torch.cuda.get_rng_state()
    return state


def _named_parameters(model, names: dict[str, str] | None) -> dict[str, torch.nn.Parameter]:
    params = dict(model.named_parameters())
    return {names[n]: p for n, p in params.items()} if names else params


def _persistent_buffers(model) -> dict[str, torch.Tensor]:
    saved = model.state_dict().keys()
    return {name: b for name, b in model.named_buffers() if name in saved}


def _joined(tensor: torch.Tensor, param, tp_group) -> torch.Tensor:
    dim = _partition_dim(param)
    if dim is not None:
        tensor = collectives.all_gather_along(tensor, dim, tp_group)
    return tensor.detach().cpu().clone()


def torch_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """{parameter: its state} of a torch optimizer (what `full_state` takes)."""
    return dict(optimizer.state)


def load_torch_optimizer_state(optimizer: torch.optim.Optimizer, moments: dict) -> None:
    """Give a torch optimizer the {parameter: state} that `load_full_state` returns."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    optimizer.load_state_dict(
        {
            "state": {index[id(p)]: state for p, state in moments.items()},
            "param_groups": optimizer.state_dict()["param_groups"],
        }
    )


def load_full_state(
    checkpoint: Path,
    model,
    tp_rank: int,
    tp_size: int,
    names: dict[str, str] | None = None,
) -> dict:
    """Read a checkpoint written at any layout into this rank's model shard (or pipeline stage,
    whose parameters' whole-model `names` are given); returns the optimizer state for it,
    {parameter: {"exp_avg": ..., ...}} (this rank's tp shard of each moment), and restores the
    random number generators."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    target = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(target, checkpoint_id=str(checkpoint))
    params = _named_parameters(model, names)

    def local(key: str, param) -> torch.Tensor:
        if key not in target:
            raise ConfigError(f"checkpoint {checkpoint} has no {key}: written by another model")
        value = target[key]
        dim = _partition_dim(param)
        if dim is not None:
            value = tp_shard(value, dim, tp_rank, tp_size)
        if value.shape != param.shape:
            raise ConfigError(
                f"checkpoint {checkpoint}: {key} has shape {tuple(target[key].shape)}, this "
                f"model's (tp={tp_size}) shard needs {tuple(param.shape)}"
            )
        return value

    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local(f"model/{name}", param))
        for name, buffer in _persistent_buffers(model).items():
            buffer.copy_(local(f"model/{name}", buffer))

    moments = {}
    for name, param in params.items():
        prefix = f"optim/{name}/"
        keys = [k for k in target if k.startswith(prefix)]
        if not keys:
            continue  # a parameter that never had a gradient has no optimizer state yet
        moments[param] = {
            k[len(prefix) :]: (local(k, param) if target[k].dim() else target[k]).to(
                param.device if target[k].dim() else "cpu"
            )
            for k in keys
        }
    torch.set_rng_state(target["rng/cpu"])
    if "rng/cuda" in target and cuda_available():
        torch.cuda.set_rng_state(target["rng/cuda"])
    return moments


# --- writing -----------------------------------------------------------------------------------


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
        if is_main:
            manifest = {
                **manifest,
                "path": str(final),
                "written_at": time.time(),
                "files": file_listing(partial),
            }
            _write_atomically(partial / MANIFEST_FILE, json.dumps(manifest) + "\n")
            if final.exists():  # the same step written again (a resumed run that had finished)
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_directory(directory)
            prune_checkpoints(directory, keep)
    except (Exception, CheckpointException) as err:  # DCP wraps each rank's OSError
        raise CheckpointWriteError(
            f"could not write checkpoint {partial}: {_root_cause(err, directory)}. Free space or "
            "fix permissions there; the incomplete directory is never read by resume"
        ) from None
    collectives.barrier()
    return final


SET_ASIDE_DIR = "set_aside"


def set_aside_newer(directory: Path, step: int) -> list[Path]:
    """A resume from step N starts a new timeline: the checkpoints of the abandoned one past N
    (damaged ones included) move to `set_aside/from_step_N-<time>/`, kept for a look, never
    resumed by `auto` and not counted by `trainer.checkpoint_keep`. Returns where they went."""
    newer = [
        entry
        for entry in (directory.iterdir() if directory.is_dir() else [])
        if (match := _NAME.match(entry.name)) and int(match.group(1)) > step
    ]
    if not newer:
        return []
    target = directory / SET_ASIDE_DIR / f"from_step_{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.mkdir(parents=True, exist_ok=True)
    moved = []
    for entry in sorted(newer):
        os.replace(entry, target / entry.name)
        moved.append(target / entry.name)
    _fsync_directory(directory)
    return moved


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints, and any left-over .partial."""
    for _, path in complete_checkpoints(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for entry in directory.glob(f"step_*{PARTIAL_SUFFIX}"):
        shutil.rmtree(entry, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _root_cause(err: BaseException, directory: Path | None = None) -> str:
    """The first OSError inside DCP's per-rank failures, else the error itself. torch's file
    writer reports a short write (a full disk) as `unexpected pos N vs M`, without the errno:
    that is said as what it is, with the free space where the checkpoint was being written."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, BaseException):
                return _root_cause(cause, directory)
    seen = err
    while seen is not None:
        if isinstance(seen, OSError):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    short_write = re.search(r"unexpected pos \d+ vs \d+", str(err))
    if short_write and directory is not None:
        import errno

        free = shutil.disk_usage(_existing(directory)).free
        said = f"a short write: torch says '{short_write.group(0)}'; {free} bytes free there"
        if free < 64 << 20:
            return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({said})"
        return f"{said} (a quota, or a failing device?)"
    return f"{type(err).__name__}: {err}"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
