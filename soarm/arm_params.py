"""One SO-101's physical parameters, per joint, in SI units: how an arm differs from another.

The emulator's hidden arm (`soarm emulate --perturb SEED`), the arm `soarm sysid` identifies,
the centre training randomizes around (`task.arm`) and the plant the transfer suite runs an
identified arm on are each an `ArmParams`; `apply` writes one onto a simulator's physics.

    arm = load_arm("arm/so101_sage.yaml", robot)     # ConfigError: one line naming the key
    arm.apply(sim.physics, robot)                    # every env this arm

In YAML, a joint left out, or a field left out of a joint, is the servo model's value (the
loop-gain and link-mass multipliers 1, no backlash):

    servo: servo/<model>.yaml         # the servo model (the task's) the values are relative to
    latency_ticks: 1                  # control ticks a goal takes to act on the arm
    joints:
      shoulder_lift: {gain_scale: 1.4, coulomb: 0.08, backlash: 0.01}
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from soarm import CONFIG_DIR, config
from soarm.description import RobotDescription
from soarm.servo import ServoConfig, ServoParams


@dataclass(frozen=True)
class JointField:
    """One per-joint parameter: its unit, its value on the servo model, and whether it acts as
    a multiplier (searched in log space by `soarm sysid`) or as an amount (searched linearly)."""
    unit: str
    nominal: Callable[[ServoParams], float]
    multiplier: bool


# The per-joint parameters, named as soarm.sim.Physics names them.
JOINT_FIELDS: dict[str, JointField] = {
    "gain_scale": JointField("x the firmware's loop gain", lambda s: 1.0, True),
    "coulomb": JointField("N m", lambda s: s.friction_coulomb, True),
    "viscous": JointField("N m s/rad", lambda s: s.friction_viscous, True),
    "friction_load": JointField("N m of friction per N m of motor torque", lambda s: s.friction_load, True),
    "armature": JointField("kg m^2, reflected rotor inertia", lambda s: s.armature, True),
    "deadband": JointField("encoder ticks of error the firmware ignores", lambda s: s.deadband_ticks, False),
    "mass_scale": JointField("x the link's mass and inertia", lambda s: 1.0, True),
    "backlash": JointField("rad of gearbox play", lambda s: 0.0, False),
    "stiction": JointField("N m of friction a joint at rest holds beyond the moving one's", lambda s: 0.0, False),
}
POSITIVE = ("gain_scale", "armature", "mass_scale")


@dataclass
class JointParams:
    """One joint; None: the servo model's value."""
    gain_scale: float | None = None
    coulomb: float | None = None
    viscous: float | None = None
    friction_load: float | None = None
    armature: float | None = None
    deadband: float | None = None
    mass_scale: float | None = None
    backlash: float | None = None
    stiction: float | None = None

    def validate(self) -> None:
        for name in JOINT_FIELDS:
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0 and (v > 0 or name not in POSITIVE)):
                raise ValueError(f"{name}: {v} must be finite and " + ("positive" if name in POSITIVE else "not negative"))


@dataclass
class ArmParams:
    servo: str                                # the servo model the values are relative to (under configs/)
    latency_ticks: int = 0                    # control ticks a goal takes to act on the arm
    joints: dict[str, JointParams] = field(default_factory=dict)
    source: dict = field(default_factory=dict)   # what it was fitted on and how well (not read back)

    def validate(self) -> None:
        if self.latency_ticks < 0:
            raise ValueError("latency_ticks: must not be negative")

    def resolved(self, robot: RobotDescription) -> ArmParams:
        """Every joint of the robot with every field, the servo model's where not given."""
        unknown = sorted(set(self.joints) - set(robot.names))
        if unknown:
            raise ValueError(f"joints: '{unknown[0]}' is not a joint of this robot ({', '.join(robot.names)})")
        servo = config.load(ServoConfig, CONFIG_DIR / self.servo).params
        joints = {}
        for name in robot.names:
            given = self.joints.get(name, JointParams())
            joints[name] = JointParams(**{f: spec.nominal(servo) if getattr(given, f) is None else getattr(given, f)
                                          for f, spec in JOINT_FIELDS.items()})
        return dataclasses.replace(self, joints=joints)

    def rows(self, robot: RobotDescription, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Each field over every joint of the robot [J], in the robot's joint order."""
        arm = self.resolved(robot)
        return {f: torch.tensor([getattr(arm.joints[n], f) for n in robot.names], dtype=dtype, device=device)
                for f in JOINT_FIELDS}

    def apply(self, physics, robot: RobotDescription) -> None:
        """Make every env of a simulator's physics (soarm.sim.Physics, [N, J] fields) this arm."""
        for name, row in self.rows(robot, physics.gain_scale.device, physics.gain_scale.dtype).items():
            setattr(physics, name, row.expand_as(getattr(physics, name)).clone())

    def max_backlash(self, robot: RobotDescription) -> float:
        return float(self.rows(robot)["backlash"].max())

    def latency_s(self, control_hz: float) -> float:
        return self.latency_ticks / control_hz

    @classmethod
    def random(cls, seed: int, robot: RobotDescription, servo: str) -> ArmParams:
        """An arm drawn from `seed` within the spread users report of real SO-101s, on every
        joint: unit-to-unit loop gain (x0.7-1.3), worn or greased gearboxes (friction
        x0.5-2, each term apart), motor spread (armature x0.8-1.25), printed links and
        payloads (mass x0.8-1.2), up to 1.5 deg of backlash, a firmware dead-band of 0-2
        ticks and a slow USB adapter (0-2 control ticks). The emulator's hidden arm."""
        g = np.random.default_rng(seed)
        J = len(robot.names)
        uniform = lambda lo, hi: g.uniform(lo, hi, J)                                  # noqa: E731
        log_uniform = lambda lo, hi: np.exp(uniform(math.log(lo), math.log(hi)))      # noqa: E731
        # The order of the draws is the seeds' record: a seed draws the arm it always drew.
        friction, gain, mass = log_uniform(0.5, 2.0), uniform(0.7, 1.3), uniform(0.8, 1.2)
        backlash, latency = uniform(0.0, math.radians(1.5)), int(g.integers(0, 3))
        viscous, load, armature = log_uniform(0.5, 2.0), log_uniform(0.5, 2.0), log_uniform(0.8, 1.25)
        deadband = g.integers(0, 3, J)
        s = config.load(ServoConfig, CONFIG_DIR / servo).params
        joints = {n: JointParams(gain_scale=float(gain[j]), coulomb=float(s.friction_coulomb * friction[j]),
                                 viscous=float(s.friction_viscous * viscous[j]),
                                 friction_load=float(s.friction_load * load[j]),
                                 armature=float(s.armature * armature[j]), deadband=float(deadband[j]),
                                 mass_scale=float(mass[j]), backlash=float(backlash[j]))
                  for j, n in enumerate(robot.names)}
        return cls(servo=servo, latency_ticks=latency, joints=joints, source={"drawn": {"seed": seed}})


# Keys of the arm files `soarm sysid` wrote before ArmParams (2026-12-06).
EARLIER_FORMAT = ("backlash_deg", "friction_scale", "gain_scale", "mass_scale")


def load_arm(path: str | Path, robot: RobotDescription, servo: str | None = None) -> ArmParams:
    """The arm at `path` (as given where that file exists, otherwise under configs/: a task's
    `arm: arm/so101_sage.yaml`), resolved for this robot; with `servo`, it must be relative to
    that servo model (a task's)."""
    path = Path(path) if Path(path).exists() else CONFIG_DIR / path
    try:
        arm = config.load(ArmParams, path)
    except config.ConfigError as e:
        if any(f"unknown key '{key}'" in str(e) for key in EARLIER_FORMAT):
            raise config.ConfigError(f"{path}: an arm file of an earlier format (per-joint lists of multipliers); "
                                     "identify the arm again with `soarm sysid`") from None
        raise
    if servo is not None and arm.servo != servo:
        raise config.ConfigError(f"{path}: identified on the servo model {arm.servo}, the task uses {servo}")
    try:
        return arm.resolved(robot)
    except ValueError as e:                             # a joint not of this robot, or its servo file
        raise config.ConfigError(f"{path}: {e}") from None

