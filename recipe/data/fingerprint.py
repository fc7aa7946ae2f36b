"""What the run reads from disk, fingerprinted: the local files of `data=files` and a local
tokenizer file, each with its size and SHA-256.

A checkpoint records this beside the config. The config alone cannot tell a file regenerated under
the same path: the saved data position would then point into another corpus, and the resumed run
would continue on it without a word. Generated sources (markov, shapes) and pydoc are fully
described by their config; a hub dataset has no local file to fingerprint (its name and
configuration are in the config).
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

from recipe.config import DataConfig


def _patterns(data_files) -> list[str]:
    if data_files is None:
        return []
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict) or hasattr(data_files, "values"):
        return [p for value in data_files.values() for p in _patterns(value)]
    return [p for value in data_files for p in _patterns(value)]


def input_files(cfg: DataConfig) -> list[Path]:
    """The local files a run reads: data.data_files (globs expanded) and data.tokenizer."""
    files = []
    if cfg.source == "files":
        for pattern in _patterns(cfg.data_files):
            files += [Path(p) for p in sorted(glob.glob(str(pattern))) if Path(p).is_file()]
    if cfg.tokenizer != "byte" and Path(cfg.tokenizer).is_file():
        files.append(Path(cfg.tokenizer))
    return files


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_fingerprint(cfg: DataConfig) -> dict[str, dict]:
    """{file as the config names it: {"size": bytes, "sha256": hex}} of every input file."""
    return {str(p): {"size": p.stat().st_size, "sha256": sha256(p)} for p in input_files(cfg)}


def fingerprint_changes(recorded: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """How the input files differ from the recorded ones, one line per file."""
    changes = []
    for name in sorted(set(recorded) | set(now)):
        before, after = recorded.get(name), now.get(name)
        if before == after:
            continue
        if after is None:
            changes.append(f"{name} is no longer there")
        elif before is None:
            changes.append(f"{name} is new")
        elif before["size"] != after["size"]:
            changes.append(f"{name} changed ({before['size']} -> {after['size']} bytes)")
        else:
            changes.append(f"{name} changed (same size, other content)")
    return changes
