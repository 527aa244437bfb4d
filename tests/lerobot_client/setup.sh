#!/usr/bin/env bash
# Set up (or reuse) LeRobot's venv for tests/test_lerobot_client.py; prints its python on the
# last line. It lives in ~/.cache/soarm/lerobot-<hash of requirements.txt> (about 5 GB, most of
# it torch), shared by every clone on this machine and rebuilt only when requirements.txt
# changes (soarm/py312_venv.sh). Exit 2 with one line when Python 3.12 is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$("$here/../../soarm/py312_venv.sh" lerobot "$here/requirements.txt" "LeRobot 0.6.1" \
    "from lerobot.robots.so_follower import SO101Follower; from lerobot.datasets.lerobot_dataset import LeRobotDataset" \
    | tail -1)"
echo "$venv/bin/python"
