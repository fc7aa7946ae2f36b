"""File-system steps a checkpoint relies on: atomic replacement, durable renames, honest errors.

A checkpoint is complete once renamed into place, so the rename and the manifest must reach the
disk; and when writing fails, the message must say why (a full disk, a quota), which DCP's and
torch's own errors bury or do not say.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def root_cause(err: BaseException, directory: Path | None = None) -> str:
    """The first OSError inside DCP's per-rank failures, else the error itself. torch's file
    writer reports a short write (a full disk) as `unexpected pos N vs M`, without the errno:
    that is said as what it is, with the free space where the checkpoint was being written."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, BaseException):
                return root_cause(cause, directory)
    seen = err
    while seen is not None:
        if isinstance(seen, OSError):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    short_write = re.search(r"unexpected pos \d+ vs \d+", str(err))
    if short_write and directory is not None:
        import errno

        free = shutil.disk_usage(existing(directory)).free
        said = f"a short write: torch says '{short_write.group(0)}'; {free} bytes free there"
        if free < 64 << 20:
            return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({said})"
        return f"{said} (a quota, or a failing device?)"
    return f"{type(err).__name__}: {err}"


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
