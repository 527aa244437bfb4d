"""soarm: sim-to-real stack for the SO-ARM101.

The core package holds what every stage shares: the robot description, the batched
rigid-body dynamics, the STS3215 servo model, the plant interface, one arm's parameters,
motion logs and the reach task with its contract. The stage folders at the repository root
(training/, export/, robot/, calibration/) are installed as sub-packages of this one.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
