#!/usr/bin/env bash
# A Python 3.12 venv built once per machine from a requirements file and reused while that file
# is unchanged: ~/.cache/soarm/NAME-<hash of the file> ($SOARM_CACHE overrides the folder), so
# every clone shares it. Lines marked `# nodeps` are installed without their dependencies; then
# CHECK (a Python statement) must run in it. Prints the venv's path; exit 2 with one line when
# Python 3.12 is missing ($PYTHON312 names one) or CHECK fails. Used by the Isaac Lab backend
# (training/isaac/setup.sh) and by LeRobot's test client (tests/lerobot_client/setup.sh).
#   soarm/py312_venv.sh NAME REQUIREMENTS "WHAT NEEDS IT" CHECK
set -euo pipefail
name="$1" req="$2" who="$3" check="$4"
cache="${SOARM_CACHE:-$HOME/.cache/soarm}"
hash="$( (cat "$req"; echo "${PYTHON312:-}") | sha256sum | cut -c1-12)"
venv="$cache/$name-$hash"

find_python312() {
    for p in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if [ -n "$p" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$p"; return 0
        fi
    done
    return 1
}

if [ ! -f "$venv/.complete" ]; then
    py="$(find_python312)" || { echo "$who needs Python 3.12: install it (e.g. apt install python3.12-venv, or pyenv install 3.12) or set PYTHON312=/path/to/python3.12" >&2; exit 2; }
    echo "$name venv: building $venv with $py (GBs, a few minutes) ..." >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    grep -v '^\s*#' "$req" | grep -v nodeps | sed 's/#.*//' | xargs "$venv/bin/pip" install -q
    grep nodeps "$req" | sed 's/#.*//' | xargs "$venv/bin/pip" install -q --no-deps
    "$venv/bin/python" -c "$check" || { echo "$name venv: $venv fails '$check'" >&2; exit 2; }
    touch "$venv/.complete"
fi
echo "$venv"
