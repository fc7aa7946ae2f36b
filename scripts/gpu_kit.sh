#!/usr/bin/env bash
# The GPU kit: the wheels the recipe needs beyond a bare CUDA image (megatron-core, Hydra,
# omegaconf, datasets and what they need that such an image lacks; scripts/gpu_kit.txt), fetched
# where PyPI is reachable and installed where there is no network. docs/gpu.md says how, and how
# to run the check in one call on a machine lent with the checkout (gpu_kit/ carried along):
#     scripts/gpu_kit.sh run "$OUT"
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LIST=$ROOT/scripts/gpu_kit.txt
PY=${PYTHON:-python3}
LIMIT_MIB=50
LIMIT_S=${GPU_KIT_LIMIT_S:-480}  # gpu_check.py's hard limit: 8 minutes (shorter only for tests)

usage() {
    cat >&2 <<EOF
usage: scripts/gpu_kit.sh fetch [DIR]          download the kit into DIR (default gpu_kit/), where PyPI is reachable
       scripts/gpu_kit.sh install SITE [DIR]   check DIR/SHA256SUMS, install the kit into SITE (no network), import it
       scripts/gpu_kit.sh run OUT [DIR]        install into a temporary SITE, then scripts/gpu_check.py --out OUT (8 minutes at most)
Python: \$PYTHON if set, else python3 (now: $PY). The wheels are for CPython 3.12 on x86_64 Linux.
EOF
}

die_usage() {  # die_usage MESSAGE: a wrong command line, exit 2
    echo "error: $1" >&2
    usage
    exit 2
}

# The requirement lines of gpu_kit.txt: name==version, comments and blank lines dropped.
requirements() {
    sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$'
}

# A wheel file name's distribution part: lower case, runs of -_. as one _ (PEP 427/503).
normalized() {
    echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g'
}

# The kit's wheel for name==version, if DIR holds one.
wheel_for() {  # wheel_for DIR REQUIREMENT
    local dir=$1 name=${2%%==*} version=${2##*==} file base
    for file in "$dir"/*.whl; do
        [ -e "$file" ] || continue
        base=$(basename "$file")
        if [ "$(normalized "${base%%-*}")" = "$(normalized "$name")" ] &&
            [ "$(echo "$base" | cut -d- -f2)" = "$version" ]; then
            echo "$file"
            return 0
        fi
    done
    return 1
}

size_bytes() {
    du -sb "$1" | cut -f1
}

mib() {
    awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'
}

fetch() {
    local dir=$1 requirement wheel built base wanted=()
    mkdir -p "$dir"
    # The machine's pip constraint file (if any) is for the machine's own installs, not the kit.
    export PIP_CONSTRAINT=
    for requirement in $(requirements); do
        if wheel=$(wheel_for "$dir" "$requirement"); then
            echo "have  $(basename "$wheel")"
            wanted+=("$(basename "$wheel")")
            continue
        fi
        echo "fetch $requirement"
        if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" \
            --python-version 3.12 --implementation cp --abi cp312 \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "$requirement" 2>"$dir/.pip-download.log"; then
            # No wheel on PyPI (antlr4-python3-runtime is sdist-only): build one, which must be
            # pure Python to run on the image.
            echo "      no wheel for $requirement on the index: building one from the sdist"
            built=$(mktemp -d)
            if ! "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$built" "$requirement"; then
                rm -rf "$built"
                echo "error: could not download or build $requirement; pip said:" >&2
                cat "$dir/.pip-download.log" >&2
                echo "fetch needs PyPI: run it where the index is reachable" >&2
                exit 1
            fi
            for wheel in "$built"/*.whl; do
                base=$(basename "$wheel")
                case $base in
                *-none-any.whl) mv "$wheel" "$dir/" ;;
                *)
                    rm -rf "$built"
                    echo "error: $requirement built into $base, which is not pure Python" >&2
                    exit 1
                    ;;
                esac
            done
            rm -rf "$built"
        fi
        rm -f "$dir/.pip-download.log"
        wheel=$(wheel_for "$dir" "$requirement") || {
            echo "error: pip left no wheel of $requirement in $dir" >&2
            exit 1
        }
        wanted+=("$(basename "$wheel")")
    done
    # A wheel of another version (gpu_kit.txt changed since the last fetch) would be installed
    # beside the pinned one: drop it.
    for wheel in "$dir"/*.whl; do
        base=$(basename "$wheel")
        if [[ " ${wanted[*]} " != *" $base "* ]]; then
            echo "drop  $base (not in scripts/gpu_kit.txt)"
            rm -f "$wheel"
        fi
    done
    (cd "$dir" && sha256sum -- *.whl >SHA256SUMS)
    local size
    size=$(size_bytes "$dir")
    if [ "$size" -gt $((LIMIT_MIB * 1048576)) ]; then
        echo "error: the kit in $dir is $(mib "$size"), over the $LIMIT_MIB MiB limit" >&2
        exit 1
    fi
    echo "kit: $dir, ${#wanted[@]} wheels, $(mib "$size") in all"
}

# Exit 1 unless DIR holds exactly the wheels SHA256SUMS lists, unchanged, one per kit line.
verify() {
    local dir=$1 wheel requirement
    if [ ! -d "$dir" ] || [ ! -f "$dir/SHA256SUMS" ]; then
        echo "error: no kit at $dir (no $dir/SHA256SUMS): run scripts/gpu_kit.sh fetch $dir where" \
            "PyPI is reachable, then copy $dir to this machine" >&2
        exit 2
    fi
    if ! (cd "$dir" && sha256sum --check --quiet --strict SHA256SUMS >&2); then
        echo "error: the kit in $dir does not match its SHA256SUMS (a damaged or changed wheel):" \
            "fetch it again (rm -r $dir; scripts/gpu_kit.sh fetch $dir) and copy it over" >&2
        exit 1
    fi
    for wheel in "$dir"/*.whl; do
        if ! cut -d' ' -f3- "$dir/SHA256SUMS" | grep -qxF -- "$(basename "$wheel")"; then
            echo "error: $wheel is not in $dir/SHA256SUMS: fetch the kit again" >&2
            exit 1
        fi
    done
    for requirement in $(requirements); do
        if ! wheel_for "$dir" "$requirement" >/dev/null; then
            echo "error: the kit in $dir has no wheel of $requirement (scripts/gpu_kit.txt):" \
                "fetch it again" >&2
            exit 1
        fi
    done
}

install() {
    local site=$1 dir=$2
    verify "$dir"
    mkdir -p "$site"
    site=$(cd "$site" && pwd)
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$site" \
        "$dir"/*.whl
    # What gpu_check.py and training need must import, or the install fails; `datasets` is only
    # for data=hf and data.files (gpu_check trains on the Markov corpus): reported, not required,
    # so that an image whose pyarrow or fsspec does not suit it can still run the checks.
    PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -W ignore - <<'EOF'
import sys
from importlib.metadata import version

import hydra
import megatron.core
import omegaconf
import torch

import recipe.checks.gpu
import recipe.launch.compose
import recipe.launch.task

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda},"
      f" available: {torch.cuda.is_available()})")
for name in ("megatron-core", "hydra-core", "omegaconf", "numpy"):
    print(f"{name} {version(name)}")
try:
    import datasets  # noqa: F401
except Exception as err:  # any import-time failure of its own dependencies
    print(f"datasets {version('datasets')}: does not import ({type(err).__name__}: {err}); "
          "gpu_check does not use it, data=hf and data.files need it")
else:
    print(f"datasets {version('datasets')}")
print(f"recipe from {recipe.launch.compose.__file__.rsplit('/recipe/', 1)[0]}")
EOF
    echo "kit installed into $site"
}

run() {
    local out=$1 dir=$2 site status
    site=$(mktemp -d "${TMPDIR:-/tmp}/gpu_kit_site.XXXXXX")
    trap 'rm -rf "$site"' EXIT
    install "$site" "$dir"
    export PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    status=0
    timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PY" "$ROOT/scripts/gpu_check.py" \
        --out "$out" || status=$?
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "error: scripts/gpu_check.py ran past its ${LIMIT_S} s limit and was stopped;" \
            "what it wrote is in $out" >&2
        exit 124
    fi
    exit "$status"
}

[ $# -ge 1 ] || die_usage "no subcommand: use fetch, install or run"
command=$1
shift
case $command in
fetch)
    [ $# -le 1 ] || die_usage "fetch takes at most one argument, the kit folder"
    fetch "${1:-$ROOT/gpu_kit}"
    ;;
install)
    [ $# -ge 1 ] || die_usage "install needs SITE, the folder to install the kit into"
    [ $# -le 2 ] || die_usage "install takes SITE and at most a kit folder"
    install "$1" "${2:-$ROOT/gpu_kit}"
    ;;
run)
    [ $# -ge 1 ] || die_usage "run needs OUT, the folder scripts/gpu_check.py writes its report into"
    [ $# -le 2 ] || die_usage "run takes OUT and at most a kit folder"
    run "$1" "${2:-$ROOT/gpu_kit}"
    ;;
-h | --help | help)
    usage
    exit 0
    ;;
*) die_usage "unknown subcommand '$command': use fetch, install or run" ;;
esac
