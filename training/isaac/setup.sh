#!/usr/bin/env bash
# Set up (or reuse) the Isaac Lab 3 venv and link it as .venv-isaaclab in the repository.
#
# The venv lives in ~/.cache/soarm/isaaclab-<hash of requirements.txt> (about 8 GB), so
# every clone on this machine shares it and it is rebuilt only when requirements.txt
# changes. Isaac Lab brings its own torch (2.11, CUDA build, which also runs on CPU); our
# package is installed into it editable, its torch range satisfied by Isaac Lab's.
# Prints the venv's python on the last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
req="$here/requirements.txt"
cache="${SOARM_CACHE:-$HOME/.cache/soarm}"
hash="$( (cat "$req"; echo "${PYTHON312:-}") | sha256sum | cut -c1-12)"
venv="$cache/isaaclab-$hash"

find_python312() {
    for p in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if [ -n "$p" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$p"; return 0
        fi
    done
    return 1
}

if [ ! -f "$venv/.complete" ]; then
    py="$(find_python312)" || { echo "Isaac Lab 3 needs Python 3.12: install it (e.g. apt install python3.12-venv, or pyenv install 3.12) or set PYTHON312=/path/to/python3.12" >&2; exit 2; }
    echo "isaaclab venv: building $venv with $py (about 8 GB, a few minutes) ..." >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    grep -v '^\s*#' "$req" | grep -v nodeps | sed 's/#.*//' | xargs "$venv/bin/pip" install -q
    grep nodeps "$req" | sed 's/#.*//' | xargs "$venv/bin/pip" install -q --no-deps
    touch "$venv/.complete"
fi
# Our package, editable from this clone (cheap; torch stays Isaac Lab's).
if ! "$venv/bin/pip" install -q -e "$repo" > "$venv/soarm-install.log" 2>&1; then
    tail -20 "$venv/soarm-install.log" >&2; echo "isaaclab venv: installing soarm into $venv failed" >&2; exit 2
fi
"$venv/bin/python" -c 'import isaaclab, soarm.training.isaac' || { echo "isaaclab venv: $venv is broken; delete it and rerun" >&2; exit 2; }
ln -sfn "$venv" "$repo/.venv-isaaclab"
echo "$venv/bin/python"
