#!/usr/bin/env bash
# Print the path of a working Python X.Y interpreter, or explain and fail.
#   scripts/find_python.sh 3.12
# Tries pythonX.Y on PATH (it must actually run: a pyenv shim for a version that is installed
# but not selected is on PATH and fails), then pyenv's installed versions.
set -u
want=${1:?usage: find_python.sh X.Y}
if "python$want" -c "" 2>/dev/null; then
    command -v "python$want"
    exit 0
fi
if command -v pyenv >/dev/null 2>&1; then
    for dir in $(pyenv root)/versions/"$want".*; do
        if [ -x "$dir/bin/python$want" ] && "$dir/bin/python$want" -c "" 2>/dev/null; then
            echo "$dir/bin/python$want"
            exit 0
        fi
    done
fi
echo "error: no working python$want found; install Python $want or pass PYTHON=/path/to/python$want" >&2
exit 1
