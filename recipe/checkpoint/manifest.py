"""A checkpoint's manifest.json: what it holds, who wrote it, and whether this run may resume it.

The manifest records the step, the data position, the metrics so far, the writing layout, the
config values that decide what a resume must share (`config_fingerprint`), the input files and
every file of the checkpoint with its size and SHA-256 (`file_listing`). Resuming compares the
recorded config with the run's own, key by key (`resume_differences`): so the recorded keys and
values must stay the same from one recipe version to the next, or old checkpoints stop resuming.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from recipe.config import TrainConfig
from recipe.data.fingerprint import data_fingerprint, fingerprint_changes, sha256
from recipe.errors import ConfigError
from recipe.rundir.layout import MANIFEST_FILE

FORMAT_VERSION = 1

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

# The config values a checkpoint records, by dotted name: a section (every field of it, nested
# sections included) or one field. Of the trainer only the settings that change the numbers; of
# cp only the preprocessing, its size being part of the layout below. A name added here is a key
# that older checkpoints lack: `resume_differences` takes its default for them.
RECORDED = (
    "model",
    "mtp",
    "vision",
    "data",
    "batching",
    "optim",
    "trainer.max_steps",
    "trainer.seed",
    "trainer.precision",
    "trainer.deterministic",
    "trainer.engine",
    "trainer.megatron.calculate_per_token_loss",
    "trainer.megatron.sync_mtp_position_embeddings",
    "cp.preprocess",
)
# The writing run's layout, recorded as `parallel.<key>`: the grid's sizes, wherever the config
# keeps them.
LAYOUT = {"tp": "parallel.tp", "cp": "cp.size", "dp": "parallel.dp", "pp": "parallel.pp"}


def config_fingerprint(cfg) -> dict:
    """The config values a checkpoint records, flattened to dotted keys."""
    recorded = {}
    for name in RECORDED:
        recorded.update(_flatten(_value(cfg, name), f"{name}."))
    for key, name in LAYOUT.items():
        recorded.update(_flatten(_value(cfg, name), f"parallel.{key}."))
    return recorded


def _value(cfg, name: str):
    """The config's value at a dotted name; a section as a dict (`dataclasses.asdict`)."""
    value = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(node) if isinstance(node, tuple) else node}


def checkpoint_manifest(
    cfg, layout, *, run_id: str, step: int, data: dict, history: list[dict], inputs: dict
) -> dict:
    """The manifest of a checkpoint of step `step`, as every rank builds it (the writer adds
    the checkpoint's path, the time and the file listing): `layout` is the writing run's
    (tp, cp, dp, pp sizes), `data` its data stream's position, `history` its records so far,
    `inputs` its input files' fingerprint."""
    import megatron.core
    import torch

    return {
        "format": FORMAT_VERSION,
        "run_id": run_id,
        "step": step,
        "data": data,
        "history": history,
        "layout": {
            "tp": layout.tp_size,
            "cp": layout.cp_size,
            "dp": layout.dp_size,
            "pp": layout.pp_size,
        },
        "engine": cfg.trainer.engine,
        "config": config_fingerprint(cfg),
        "inputs": inputs,
        "versions": {"torch": torch.__version__, "megatron_core": megatron.core.__version__},
    }


def file_listing(checkpoint: str | Path) -> dict[str, dict]:
    """{file name: {"size": bytes, "sha256": hex}} of every file a checkpoint holds but its
    manifest (which lists them)."""
    listing = {}
    for path in sorted(Path(checkpoint).iterdir()):
        if path.is_file() and path.name != MANIFEST_FILE:
            listing[path.name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    return listing


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
