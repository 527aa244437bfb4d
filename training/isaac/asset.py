"""The SO-101 articulation for Isaac Lab, from our own robot description.

The URDF (configs/robot/so101.urdf) is converted to USD kit-less by Isaac Sim's standalone
URDF importer, once per URDF content (cached under ~/.cache/soarm/usd/<hash>/), with no
remote assets. The joints get no drives: the servo actuator (actuator.py) computes every
torque.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from soarm import CONFIG_DIR, config
from soarm.description import RobotDescription
from soarm.servo import ServoConfig

URDF = CONFIG_DIR / "robot" / "so101.urdf"
CACHE = Path(os.environ.get("SOARM_CACHE", Path.home() / ".cache" / "soarm")) / "usd"


def usd_path(urdf: Path = URDF) -> Path:
    """The converted USD of `urdf`, converting it on first use."""
    digest = hashlib.sha256(urdf.read_bytes()).hexdigest()[:16]
    out = CACHE / digest
    usd = out / urdf.stem / f"{urdf.stem}.usda"
    if usd.is_file():
        return usd
    # The importer must be imported before any USD stage exists.
    import isaacsim.asset.importer.urdf  # noqa: F401
    from isaaclab.sim.converters import UrdfConverter, UrdfConverterCfg

    drive = UrdfConverterCfg.JointDriveCfg(target_type="none",
                                           gains=UrdfConverterCfg.JointDriveCfg.PDGainsCfg(stiffness=0.0, damping=0.0))
    cfg = UrdfConverterCfg(asset_path=str(urdf), usd_dir=str(out), fix_base=True, merge_fixed_joints=False,
                           make_instanceable=False, joint_drive=drive)
    path = Path(UrdfConverter(cfg).usd_path)
    if not path.is_file():
        raise RuntimeError(f"URDF conversion of {urdf} wrote no {path}")
    return path


def articulation_cfg(robot: RobotDescription, usd: Path, servo_file: str, physics_dt: float):
    """ArticulationCfg of the arm: joints in the robot description's order, one servo each."""
    import isaaclab.sim as sim_utils
    from isaaclab.assets import ArticulationCfg

    from soarm.training.isaac.actuator import ServoActuatorCfg

    servo = config.load(ServoConfig, CONFIG_DIR / servo_file).params
    return ArticulationCfg(
        prim_path="{ENV_REGEX_NS}/Robot",
        spawn=sim_utils.UsdFileCfg(usd_path=str(usd)),
        init_state=ArticulationCfg.InitialStateCfg(
            joint_pos=dict(zip(robot.names, robot.home_pose.tolist()))),
        joint_ordering=list(robot.names),
        actuators={"servos": ServoActuatorCfg(joint_names_expr=[".*"], servo=servo_file, dt=physics_dt,
                                              armature=servo.armature)},
    )
