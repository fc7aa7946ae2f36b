"""The start of every standalone reproducer of the upstream checker (`recipe/checks/upstream/`),
shipped verbatim (its source, less this docstring): load one file of a release from its wheel (or
sdist) without running the package's `__init__`, the imports named in `stubs` replaced by inert
placeholders, and the entry point. Plain Python and torch only: no recipe import, so the script
runs anywhere the release does. A reproducer's body (after this prelude) defines
`release_outputs` and `problems`, and sets CASE and OPTIONS. It sits here, below the checker,
so that training's loader (`source.load_module`) stubs a release's imports with this same code.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import traceback
import types
import zipfile
from pathlib import Path


class Placeholder(types.ModuleType):
    """A stubbed import: any attribute is an inert class of that name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def scratch_folder(prefix):
    """A temporary folder removed when the script exits: a reproducer run many times (by the
    checker's tests, or a user's loop) leaves nothing behind."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def fetch_wheel(distribution, version):
    """The release's wheel, or its sdist (.tar.gz, not built) where it publishes no wheel."""
    folder = scratch_folder("repro-wheel-")
    for binary, quiet in (("--only-binary=:all:", True), ("--no-binary=:all:", False)):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                binary,
                "--ignore-requires-python",
                "--quiet",
                "--dest",
                str(folder),
                f"{distribution}=={version}",
            ],
            capture_output=quiet,
        )
        found = [*folder.glob("*.whl"), *folder.glob("*.tar.gz")]
        if found:
            return found[0]
    sys.exit(f"pip cannot fetch {distribution}=={version}; pass --wheel PATH")


def installed_release(distribution, version):
    """The installed release's folder (its site-packages) when it is `version` (a local label,
    "+cpu", aside), else None: read in place of a download."""
    import importlib.metadata

    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if installed.split("+")[0] != version.split("+")[0]:
        return None
    found = importlib.metadata.distribution(distribution)
    origin = json.loads(found.read_text("direct_url.json") or "{}")
    if origin.get("dir_info", {}).get("editable"):
        return None  # a source checkout, not the release's files
    return Path(found.locate_file(""))


def extract(wheel, relative, folder):
    """`relative` from a wheel, from an sdist below its top folder (NAME-VERSION/), or from an
    installed release's folder."""
    if Path(wheel).is_dir():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(wheel) / relative, folder / relative)
    elif str(wheel).endswith(".tar.gz"):
        with tarfile.open(wheel, "r:gz") as archive:
            member = next(m for m in archive if m.name.partition("/")[2] == relative)
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(archive.extractfile(member).read())
    else:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(relative, folder)


def release_text(wheel, relative):
    """The text of `relative` in the release: a wheel, an sdist or an installed folder."""
    folder = scratch_folder("repro-text-")
    extract(wheel, relative, folder)
    return (folder / relative).read_text()


@contextlib.contextmanager
def swapped_modules(modules):
    """`modules` (name -> module, or None to make its import fail) in sys.modules while the
    block runs; after it, each name's own entry back, or none where it had none."""
    saved = {name: sys.modules[name] for name in modules if name in sys.modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                sys.modules.pop(name, None)


def load_stubbed(path, name, stubs):
    """Execute the file at `path` as module `name`, each module of `stubs` (name -> the
    attributes it must have) a placeholder while it runs: a package, so stubs below it import
    too. The module itself is in sys.modules while it runs, as an import puts it there (a
    dataclass under `from __future__ import annotations` looks its module up as it is made)."""
    placeholders = {}
    for key, attributes in stubs.items():
        module = Placeholder(key)
        module.__path__ = []
        for attribute, value in attributes.items():
            setattr(module, attribute, value)
        placeholders[key] = module
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    with swapped_modules({**placeholders, name: module}):
        loader.exec_module(module)
    return module


def load_from_wheel(wheel, relative, stubs, package=None):
    """Execute `relative` from the wheel (or sdist) as a private module, `stubs` (name ->
    attributes) standing in for the imports it makes that the checked code never calls; named
    inside `package` when given, so the file's relative imports find the stubs named there."""
    folder = scratch_folder("repro-src-")
    extract(wheel, relative, folder)
    name = (f"{package}." if package else "") + "released_" + Path(relative).stem
    return load_stubbed(folder / relative, name, stubs)


def release_outputs(wheel):
    """What the release returns on CASE; each reproducer's body defines it after this prelude."""
    raise NotImplementedError


def problems(outputs):
    """What differs from the ground truth in `outputs`; each reproducer's body defines it."""
    raise NotImplementedError


def main(distribution, version):
    """Run the release on the case: exit 1 with what is wrong (reproduced), 0 when it passes."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--wheel",
        help="the release's wheel, sdist, or installed site-packages folder (default: the "
        "installed release when it is this version, else pip downloads it)",
    )
    wheel = (
        parser.parse_args().wheel
        or installed_release(distribution, version)
        or fetch_wheel(distribution, version)
    )
    try:
        found = problems(release_outputs(wheel))
    except Exception as err:
        # the release raising on this valid input is the finding; a raise anywhere else is the
        # reproducer's own failure and must not read as one
        if not any(
            "repro-src-" in frame.filename for frame in traceback.extract_tb(err.__traceback__)
        ):
            raise
        traceback.print_exc()
        found = [f"the release raises {type(err).__name__}: {err}"]
    for line in found:
        print(line)
    print(f"{distribution} {version}: " + ("REPRODUCED" if found else "not reproduced: passes"))
    return 1 if found else 0
