"""The GPU kit (scripts/gpu_kit.sh, scripts/gpu_kit.txt): fetched once from PyPI, it is small,
complete and checksummed; it installs without the network; and the recipe runs from it alone on
top of torch and the image's packages (a Python without site-packages sees nothing else), with a
negative control: the same Python without the kit cannot import megatron."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers.config import TINY

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "scripts" / "gpu_kit.sh"
LIST = ROOT / "scripts" / "gpu_kit.txt"
LIMIT_BYTES = 50 * 1024 * 1024

pytestmark = [
    pytest.mark.launches,  # pip, bash and Python processes
    pytest.mark.skipif(
        sys.version_info[:2] != (3, 12), reason="the kit is for the GPU image's Python 3.12"
    ),
]

# What a bare GPU image has besides the kit, taken from this venv's site-packages: torch and the
# image's packages that importing torch, megatron-core, Hydra and the recipe needs. Found
# empirically: torch.utils.cpp_extension imports setuptools (and its _distutils_hack), and
# megatron-core 0.19.2 imports triton (torch's own dependency on Linux) unconditionally.
IMAGE_PACKAGES = [
    "torch",
    "torchgen",
    "functorch",
    "numpy",
    "yaml",
    "typing_extensions",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "packaging",
    "setuptools",
    "_distutils_hack",
    "triton",
]


# Runs under `python -I -S`: sys.path is exactly the folders given, then the standard library.
PROBE = """
import json, sys
sys.path[:] = json.loads(sys.argv[1]) + [p for p in sys.path if p and "-packages" not in p]
import megatron.core
import hydra, omegaconf, torch
import recipe.launch.compose
from recipe.launch.compose import compose_typed
from recipe.launch.local import lone_world
from recipe.model.gpt import build_gpt_model
cfg = compose_typed(json.loads(sys.argv[2]))
with lone_world():
    model = build_gpt_model(cfg.model, vocab_size=259, max_sequence_length=256, seed=0,
                            mtp_cfg=cfg.mtp)
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (megatron.core, hydra, omegaconf, torch)},
    "parameters": sum(p.numel() for p in model.parameters()),
}))
"""


def requirements() -> list[tuple[str, str]]:
    """(name, version) of each line of gpu_kit.txt."""
    pins = []
    for line in LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins.append((name, version))
    return pins


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def offline_env(**extra: str) -> dict[str, str]:
    """This environment with pip told to use no index and no proxy to reach one."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(PIP_NO_INDEX="1", PYTHON=sys.executable, **extra)
    return env


def gpu_kit(*args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        ["bash", str(KIT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or {**os.environ, "PYTHON": sys.executable},
    )


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """The kit, fetched from PyPI once for this module (a few MB)."""
    folder = tmp_path_factory.mktemp("kit") / "gpu_kit"
    fetched = gpu_kit("fetch", str(folder), timeout=600)
    if fetched.returncode != 0:
        # Is it the index that cannot be reached, or the script that is wrong?
        probe = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            + ["--dest", str(folder.parent / "probe"), "dill==0.4.1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if probe.returncode != 0:
            pytest.skip(f"pip cannot reach the package index: {probe.stderr.strip()[-300:]}")
        pytest.fail(f"fetch failed with the index reachable:\n{fetched.stdout}{fetched.stderr}")
    return folder


@pytest.fixture(scope="module")
def site(kit, tmp_path_factory) -> Path:
    """The kit installed into a clean folder, without the network."""
    folder = tmp_path_factory.mktemp("site")
    installed = gpu_kit("install", str(folder), str(kit), env=offline_env())
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "megatron-core 0.19.2" in installed.stdout and "hydra-core 1.3.8" in installed.stdout
    return folder


@pytest.fixture(scope="module")
def image_packages(tmp_path_factory) -> Path:
    """A folder of links to just torch and the image's packages in this venv's site-packages."""
    from importlib.metadata import packages_distributions

    folder = tmp_path_factory.mktemp("image_packages")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    distributions = packages_distributions()
    metadata = {normalized(p.name.split("-")[0]): p for p in site_packages.glob("*.dist-info")}
    for name in IMAGE_PACKAGES:
        found = [p for p in (site_packages / name, site_packages / f"{name}.py") if p.exists()]
        assert found, f"{name} is not in {site_packages}"
        (folder / found[0].name).symlink_to(found[0])
        # With its metadata, as installed on the image: torch 2.14 registers its gloo backend
        # through its own entry points (torch.distributed.backends).
        for distribution in distributions.get(name, []):
            info = metadata.get(normalized(distribution))
            if info and not (folder / info.name).exists():
                (folder / info.name).symlink_to(info)
    return folder


def probe(path: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", PROBE, json.dumps([str(p) for p in path])]
        + [json.dumps([*TINY, "mtp=on"])],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=offline_env(PYTHONWARNINGS="ignore"),
    )


def test_the_kit_is_small_complete_and_checksummed(kit):
    size = sum(f.stat().st_size for f in kit.iterdir())
    assert size < LIMIT_BYTES, f"the kit is {size / 2**20:.1f} MiB"
    wheels = sorted(f.name for f in kit.glob("*.whl"))
    assert len(wheels) == len(requirements())
    for name, version in requirements():
        mine = [w for w in wheels if normalized(w.split("-")[0]) == normalized(name)]
        assert len(mine) == 1, f"{name}: {mine}"
        assert mine[0].split("-")[1] == version
        # Wheels that run on the image: pure Python, or CPython 3.12 on x86_64 Linux.
        assert mine[0].endswith("-none-any.whl") or re.search(r"-cp312-.*x86_64", mine[0])
    sums = dict(
        reversed(line.split(maxsplit=1)) for line in (kit / "SHA256SUMS").read_text().splitlines()
    )
    assert sorted(sums) == wheels
    for wheel, digest in sums.items():
        assert hashlib.sha256((kit / wheel).read_bytes()).hexdigest() == digest, wheel


def test_a_second_fetch_reuses_the_kit(kit):
    before = {f.name: f.stat().st_mtime_ns for f in kit.iterdir()}
    again = gpu_kit("fetch", str(kit), env=offline_env())  # no index needed: nothing to fetch
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("have ") == len(requirements())
    assert "MiB in all" in again.stdout
    after = {f.name: f.stat().st_mtime_ns for f in kit.iterdir() if f.suffix == ".whl"}
    assert after == {name: t for name, t in before.items() if name.endswith(".whl")}


def test_the_recipe_runs_from_the_kit_and_torch_alone(site, image_packages, tmp_path):
    found = probe([site, ROOT, image_packages], tmp_path)
    assert found.returncode == 0, found.stderr[-3000:]
    result = json.loads(found.stdout.strip().splitlines()[-1])
    files = result["files"]
    for module in ("megatron.core", "hydra", "omegaconf"):
        assert files[module].startswith(str(site)), files
    assert files["torch"].startswith(str(image_packages)), files
    assert result["parameters"] > 0


def test_negative_control_without_the_kit_megatron_is_missing(image_packages, tmp_path):
    found = probe([ROOT, image_packages], tmp_path)
    assert found.returncode != 0
    assert "ModuleNotFoundError: No module named 'megatron'" in found.stderr, found.stderr[-2000:]


def test_install_refuses_a_kit_that_does_not_match_its_checksums(kit, tmp_path):
    tampered = tmp_path / "kit"
    shutil.copytree(kit, tampered)
    wheel = next(tampered.glob("dill-*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    refused = gpu_kit("install", str(tmp_path / "site"), str(tampered), env=offline_env())
    assert refused.returncode == 1
    assert "does not match its SHA256SUMS" in refused.stderr and wheel.name in refused.stderr
    assert not (tmp_path / "site" / "dill").exists()


def test_install_refuses_a_wheel_the_checksums_do_not_list(kit, tmp_path):
    extra = tmp_path / "kit"
    shutil.copytree(kit, extra)
    shutil.copy(next(extra.glob("dill-*.whl")), extra / "dill-0.4.2-py3-none-any.whl")
    refused = gpu_kit("install", str(tmp_path / "site"), str(extra), env=offline_env())
    assert refused.returncode == 1
    assert "dill-0.4.2-py3-none-any.whl is not in" in refused.stderr


def _wheel_with(wheel: Path, member: str, text: str) -> None:
    """Rewrite one file inside a wheel (pip does not check a wheel's RECORD hashes)."""
    with zipfile.ZipFile(wheel) as source:
        contents = {info: source.read(info) for info in source.infolist()}
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as target:
        for info, data in contents.items():
            target.writestr(info, text.encode() if info.filename == member else data)


def test_install_does_not_need_datasets_to_import(kit, tmp_path):
    """`datasets` is for data=hf and data.files only, never for gpu_check: a kit whose datasets
    does not import (an image whose pyarrow does not suit it) still installs, and says so."""
    broken = tmp_path / "kit"
    shutil.copytree(kit, broken)
    wheel = next(broken.glob("datasets-*.whl"))
    _wheel_with(wheel, "datasets/__init__.py", "raise ImportError('pyarrow does not suit it')\n")
    (broken / "SHA256SUMS").write_text(  # sha256sum's own format: digest, two spaces, name
        "".join(
            f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
            for p in sorted(broken.glob("*.whl"))
        )
    )
    site = tmp_path / "site"
    installed = gpu_kit("install", str(site), str(broken), env=offline_env())
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "does not import (ImportError: pyarrow does not suit it)" in installed.stdout
    assert "megatron-core 0.19.2" in installed.stdout
    # negative control: the wheel installed really is broken, so the install ran past it
    imported = subprocess.run(
        [sys.executable, "-c", "import datasets"],
        capture_output=True,
        text=True,
        env={**offline_env(), "PYTHONPATH": str(site)},
    )
    assert imported.returncode != 0 and "pyarrow does not suit it" in imported.stderr


def test_install_without_a_kit_names_the_fetch(tmp_path):
    missing = gpu_kit("install", str(tmp_path / "site"), str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert "scripts/gpu_kit.sh fetch" in missing.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no subcommand"),
        (["frobnicate"], "unknown subcommand 'frobnicate'"),
        (["run"], "run needs OUT"),
        (["install"], "install needs SITE"),
        (["fetch", "a", "b"], "fetch takes at most one argument"),
        (["run", "out", "kit", "extra"], "run takes OUT and at most a kit folder"),
    ],
)
def test_bad_arguments_exit_2_with_the_usage(args, message):
    bad = gpu_kit(*args)
    assert bad.returncode == 2
    assert message in bad.stderr
    assert "usage: scripts/gpu_kit.sh fetch [DIR]" in bad.stderr


def test_run_installs_the_kit_and_runs_gpu_check(kit, tmp_path):
    """Here without CUDA: gpu_check reports the versions, skips the rest and exits 0."""
    env = offline_env(TMPDIR=str(tmp_path))
    ran = gpu_kit("run", str(tmp_path / "out"), str(kit), env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "0.19.2" in json.dumps(report)
    assert not list(tmp_path.glob("gpu_kit_site.*")), "the temporary site is removed"


def test_run_stops_gpu_check_at_its_time_limit(kit, tmp_path):
    """The 8-minute limit, shortened: the check cannot finish in 1 s, so run exits 124."""
    stopped = gpu_kit("run", str(tmp_path / "out"), str(kit), env=offline_env(GPU_KIT_LIMIT_S="1"))
    assert stopped.returncode == 124, stopped.stdout + stopped.stderr
    assert "ran past its 1 s limit" in stopped.stderr
