"""An identified arm: how one user's SO-101 differs from the nominal servo model, per joint.

`soarm sysid` (robot/sysid.py) writes it from `soarm excite` logs; training reads it through
`ReachCfg.arm` and centres the domain randomization on it (`Centre`): the drawn gain,
friction and mass multipliers multiply the identified ones, the identified armature,
load-dependent friction and dead-band replace the servo model's, and the drawn backlash and
latency are moved so that their ranges' midpoints sit on the identified values.

    arm = load_arm("runs/sysid/arm.yaml", robot)       # ConfigError: one line naming the key
    draw_physics(gen, cfg, servo, n, J, device, centre=centre_of(arm, robot, device))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from soarm import CONFIG_DIR, config
from soarm.description import RobotDescription
from soarm.sim import Physics


OPTIONAL = ("viscous_scale", "friction_load_scale", "armature_scale", "deadband_ticks")


@dataclass
class IdentifiedArm:
    servo: str                            # the servo model these scale (relative to configs/)
    joints: list[str]                     # arm joints, in the order of every list below
    gain_scale: list[float]               # x the firmware's loop gain
    friction_scale: list[float]           # x the servo model's Coulomb friction (and viscous, where
                                          #   viscous_scale is absent: files from before the split)
    mass_scale: list[float]               # x the link's mass and inertia (the link each joint moves)
    backlash_deg: list[float]             # free play of each gearbox
    latency_ticks: int = 0                # control ticks a goal takes to act on the arm
    # Absent (None): the servo model's value (files written before sysid fitted them).
    viscous_scale: list[float] | None = None        # x the viscous friction
    friction_load_scale: list[float] | None = None  # x the load-dependent (gearbox) friction
    armature_scale: list[float] | None = None       # x the reflected rotor inertia
    deadband_ticks: list[float] | None = None       # encoder ticks of error the firmware ignores
    source: dict = field(default_factory=dict)   # what it was fitted on and how well (not read back)

    def validate(self) -> None:
        n = len(self.joints)
        for name in ("gain_scale", "friction_scale", "mass_scale", "backlash_deg", *OPTIONAL):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != n:
                raise ValueError(f"{name}: {len(values)} values for {n} joints")
            if not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"{name}: values must be finite and not negative, got {values}")
        for name in ("gain_scale", "mass_scale", "armature_scale"):
            if not all(v > 0 for v in getattr(self, name) or []):
                raise ValueError(f"{name}: values must be positive")
        if self.latency_ticks < 0:
            raise ValueError("latency_ticks: must not be negative")


def load_arm(path: str | Path, robot: RobotDescription, servo: str) -> IdentifiedArm:
    """The identified arm at `path` (relative to configs/ unless absolute), for this robot
    and the servo model `servo` (its multipliers scale that model, no other)."""
    path = CONFIG_DIR / path
    arm = config.load(IdentifiedArm, path)
    if list(arm.joints) != list(robot.arm_joints):
        raise config.ConfigError(f"{path}: joints {arm.joints} are not this robot's arm joints "
                                 f"{list(robot.arm_joints)}")
    if arm.servo != servo:
        raise config.ConfigError(f"{path}: identified on the servo model {arm.servo}, the task uses {servo}")
    return arm


def task_centre(arm_file: str | None, servo: str, robot: RobotDescription, device="cpu") -> Centre | None:
    """What a task's randomization centres on: its `arm` file's values, or None (nominal)."""
    return None if arm_file is None else centre_of(load_arm(arm_file, robot, servo), robot, device)


@dataclass
class Centre:
    """An identified arm as rows over every joint of the robot (the gripper: nominal), what
    the randomization draws are moved onto."""
    gain_scale: torch.Tensor          # [J]
    friction_scale: torch.Tensor      # [J] x Coulomb friction
    mass_scale: torch.Tensor          # [J]
    backlash: torch.Tensor            # [J] rad
    latency_ticks: int
    viscous_scale: torch.Tensor | None = None         # [J]; None: as friction_scale
    friction_load_scale: torch.Tensor | None = None   # [J]; None: 1
    armature_scale: torch.Tensor | None = None        # [J]; None: 1
    deadband_ticks: torch.Tensor | None = None        # [J]; None: the servo model's

    def physics(self, drawn: dict[str, torch.Tensor], backlash_range_deg: tuple[float, float]) -> dict[str, torch.Tensor]:
        """`draw_physics`'s draws moved onto this arm: multipliers multiplied, the backlash
        range's midpoint moved onto the identified play (never below 0). PD-driven arms keep
        their drive (it is not the servo that was identified) and take the rest."""
        mid = math.radians(sum(backlash_range_deg) / 2)
        return self._onto(drawn, torch.clamp(drawn["backlash"] + self.backlash - mid, min=0.0))

    def apply(self, ph: Physics) -> Physics:
        """A plant's nominal physics made this arm (its play replaces the plant's)."""
        values = self._onto(dataclasses.asdict(ph), self.backlash.expand_as(ph.backlash).clone())
        return dataclasses.replace(ph, **values)

    def _onto(self, v: dict[str, torch.Tensor], backlash: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = lambda x: 1.0 if x is None else x  # noqa: E731
        viscous = self.friction_scale if self.viscous_scale is None else self.viscous_scale
        deadband = v["deadband"] if self.deadband_ticks is None else \
            torch.where(self.deadband_ticks.isnan(), v["deadband"], self.deadband_ticks)
        return {**v, "gain_scale": v["gain_scale"] * self.gain_scale, "coulomb": v["coulomb"] * self.friction_scale,
                "viscous": v["viscous"] * viscous, "mass_scale": v["mass_scale"] * self.mass_scale,
                "friction_load": v["friction_load"] * scale(self.friction_load_scale),
                "armature": v["armature"] * scale(self.armature_scale), "deadband": deadband, "backlash": backlash}

    def latency(self, drawn: torch.Tensor, latency_range: tuple[int, int]) -> torch.Tensor:
        """Latency draws (control ticks) moved so that the range's midpoint is the identified value."""
        return torch.clamp(drawn + self.latency_ticks - round(sum(latency_range) / 2), min=0)

    def max_latency(self, latency_range: tuple[int, int]) -> int:
        """The most control ticks `latency` returns for draws within latency_range."""
        return max(0, latency_range[1] + self.latency_ticks - round(sum(latency_range) / 2))


def centre_of(arm: IdentifiedArm, robot: RobotDescription, device="cpu", dtype=torch.float32) -> Centre:
    def row(values: list[float], nominal: float) -> torch.Tensor:
        r = torch.full((len(robot.names),), nominal, dtype=dtype)
        r[robot.arm_index] = torch.tensor(values, dtype=dtype)
        return r.to(device)

    def optional(values: list[float] | None, nominal: float) -> torch.Tensor | None:
        return None if values is None else row(values, nominal)
    # The gripper's dead-band is not identified: it keeps the servo model's (nan: taken from the draw).
    deadband = optional(arm.deadband_ticks, math.nan)
    return Centre(row(arm.gain_scale, 1.0), row(arm.friction_scale, 1.0), row(arm.mass_scale, 1.0),
                  torch.deg2rad(row(arm.backlash_deg, 0.0)), arm.latency_ticks,
                  optional(arm.viscous_scale, 1.0), optional(arm.friction_load_scale, 1.0),
                  optional(arm.armature_scale, 1.0), deadband)
