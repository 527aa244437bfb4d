#!/usr/bin/env bash
# Set up (or reuse) the Isaac Lab 3 venv and link it as .venv-isaaclab in the repository.
#
# The venv lives in ~/.cache/soarm/isaaclab-<hash of requirements.txt> (about 8 GB), so
# every clone on this machine shares it and it is rebuilt only when requirements.txt
# changes (soarm/py312_venv.sh). Isaac Lab brings its own torch (2.11, CUDA build, which also
# runs on CPU); our package is installed into it editable, its torch range satisfied by Isaac
# Lab's. Prints the venv's python on the last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$("$repo/soarm/py312_venv.sh" isaaclab "$here/requirements.txt" "Isaac Lab 3" "import isaaclab" | tail -1)"
# Our package, editable from this clone (cheap; torch stays Isaac Lab's).
if ! "$venv/bin/pip" install -q -e "$repo" > "$venv/soarm-install.log" 2>&1; then
    tail -20 "$venv/soarm-install.log" >&2; echo "isaaclab venv: installing soarm into $venv failed" >&2; exit 2
fi
"$venv/bin/python" -c 'import isaaclab, soarm.training.isaac' || { echo "isaaclab venv: $venv is broken; delete it and rerun" >&2; exit 2; }
ln -sfn "$venv" "$repo/.venv-isaaclab"
echo "$venv/bin/python"
