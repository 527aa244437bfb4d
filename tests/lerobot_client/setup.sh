#!/usr/bin/env bash
# Set up (or reuse) LeRobot's venv for tests/test_lerobot_client.py; prints its python on the
# last line. It lives in ~/.cache/soarm/lerobot-<hash of requirements.txt> (about 5 GB, most of
# it torch), shared by every clone on this machine and rebuilt only when requirements.txt
# changes. Exit 2 with one line when Python 3.12 is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
req="$here/requirements.txt"
cache="${SOARM_CACHE:-$HOME/.cache/soarm}"
hash="$( (cat "$req"; echo "${PYTHON312:-}") | sha256sum | cut -c1-12)"
venv="$cache/lerobot-$hash"

find_python312() {
    for p in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if [ -n "$p" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$p"; return 0
        fi
    done
    return 1
}

if [ ! -f "$venv/.complete" ]; then
    py="$(find_python312)" || { echo "LeRobot 0.6.1 needs Python 3.12: install it (e.g. apt install python3.12-venv, or pyenv install 3.12) or set PYTHON312=/path/to/python3.12" >&2; exit 2; }
    echo "lerobot venv: building $venv with $py (about 5 GB, a few minutes) ..." >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    grep -v '^\s*#' "$req" | grep -v nodeps | sed 's/#.*//' | xargs "$venv/bin/pip" install -q
    grep nodeps "$req" | sed 's/#.*//' | xargs "$venv/bin/pip" install -q --no-deps
    "$venv/bin/python" -c 'from lerobot.robots.so_follower import SO101Follower' \
        || { echo "lerobot venv: $venv cannot import LeRobot's SO-101 follower" >&2; exit 2; }
    touch "$venv/.complete"
fi
echo "$venv/bin/python"
