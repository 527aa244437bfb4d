"""The one plant interface: N arms stepped in time, goals in, encoder readings out.

Implemented by our training plant (`SimPlant`: ArmSim with the STS3215 model) and by the
published MJCF in MuJoCo (soarm/mujoco_arm.py `MujocoArm`); driven by the transfer suite, the
emulator's physics process and identification alike:

    plant.reset(q)                       # [N, J] rad, at rest, the servos holding there
    plant.latency_s = np.full(N, 1 / 30) # goals reach the servos this late (one goal line)
    plant.torque(on)                     # [N, J] bool: torque on or off per servo
    plant.step(goal, seconds)            # hold goals [N, J] (rad, encoder frame) for `seconds`
    plant.measured(); plant.q; plant.qd  # [N, J] encoder readings (whole ticks), true angles, speeds

Angles are in the robot description's joint order. A plant advances in whole physics steps
of `dt`; `step` takes the nearest whole number for `seconds`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from soarm.description import RobotDescription
from soarm.reach import delay_goals
from soarm.servo import ServoConfig, motor_current
from soarm.sim import ArmSim


class Plant:
    """What every plant shares: the goal line that delays goals by each arm's latency, and
    `step`'s split into physics steps. A plant implements `_advance(goal, steps)` and the
    state (`reset`, `torque`, `measured`, `q`, `qd`)."""

    dt: float                                    # s per physics step
    N: int
    _line: torch.Tensor | None = None            # [N, L + 1, J] goals on their way, newest first
    _delay: torch.Tensor | None = None           # [N] physics steps each arm's goals take

    @property
    def latency_s(self) -> np.ndarray:
        return np.zeros(self.N) if self._delay is None else self._delay.numpy() * self.dt

    @latency_s.setter
    def latency_s(self, seconds) -> None:
        """Each arm's goal latency [N] (s), in whole physics steps; all zero: none."""
        steps = np.round(np.broadcast_to(np.asarray(seconds, dtype=float), (self.N,)) / self.dt).astype(np.int64)
        if (steps < 0).any():
            raise ValueError(f"latency: must not be negative, got {seconds}")
        self._delay = torch.from_numpy(steps) if steps.any() else None
        self._line = None if self._delay is None else self._goals_held()[:, None].repeat(1, int(steps.max()) + 1, 1)

    def step(self, goal: np.ndarray, seconds: float) -> None:
        """Hold goals [N, J] (rad, encoder frame) for `seconds`, each arm's reaching it `latency_s` late."""
        steps = max(1, round(seconds / self.dt))
        if self._delay is None:
            self._advance(goal, steps)
            return
        goal = torch.as_tensor(goal, dtype=torch.float64)
        for _ in range(steps):
            applied, self._line = delay_goals(self._line, goal, self._delay)
            self._advance(applied.numpy(), 1)

    def _refill_line(self, goal: np.ndarray) -> None:
        """After a reset: every goal on its way is `goal` [N, J]."""
        if self._line is not None:
            self._line[:] = torch.as_tensor(goal, dtype=self._line.dtype)[:, None]

    def _goals_held(self) -> torch.Tensor:
        return torch.as_tensor(self.measured(), dtype=torch.float64)

    def supply(self, volts: float) -> None:
        raise NotImplementedError(f"{type(self).__name__}: no supply voltage to set")

    def _advance(self, goal: np.ndarray, steps: int) -> None:
        raise NotImplementedError


@dataclass
class Drive:
    """What a plant is driven with, interval by interval: hold `goal(k)` [N, J] for
    `seconds[k]`, with the torque switches [N, J] and the supply (V) of that interval where given."""
    goal: Callable[[int], np.ndarray | torch.Tensor]
    seconds: np.ndarray                                  # [T]
    torque: Callable[[int], np.ndarray] | None = None
    volts: np.ndarray | None = None                      # [T]
    # [T + 1] bool: keep the reading taken before interval k (T: after the last); None: every one
    read: np.ndarray | None = None


def play(plant: Plant, drive: Drive) -> np.ndarray:
    """Drive a plant through a recorded motion: the readings [R, N, J] (rad) it gives where
    `drive.read`, in order. The one replay of a log through a plant (identification fits it,
    `soarm arm-check` compares it with the arm)."""
    T = len(drive.seconds)
    keep = np.ones(T + 1, dtype=bool) if drive.read is None else drive.read
    out = []
    for k in range(T + 1):
        if keep[k]:
            out.append(plant.measured())
        if k == T:
            break
        if drive.torque is not None:
            plant.torque(drive.torque(k))
        if drive.volts is not None:
            plant.supply(float(drive.volts[k]))
        plant.step(drive.goal(k), float(drive.seconds[k]))
    return np.stack(out)


class SimPlant(Plant):
    """Our training plant: ArmSim (the STS3215 model on every joint) behind the plant interface."""

    def __init__(self, sim: ArmSim):
        self.sim, self.N, self.dt = sim, sim.N, sim.dt

    @classmethod
    def build(cls, robot: RobotDescription, servo: ServoConfig, n: int, dt: float, arm=None,
              backlash: float = 0.0, compile: bool = False, **switches) -> SimPlant:
        """n arms; `arm` (soarm.arm_params.ArmParams): every arm that one (its play included);
        `backlash`: the gear-play model on with at least this play (rad) in every joint;
        `switches`: ArmSim's (pd_drives, carries_payload, reports_drive)."""
        play = max(backlash, 0.0 if arm is None else arm.max_backlash(robot))
        sim = ArmSim(robot, servo.params, servo.registers, n, dt, backlash=play, **switches)
        if arm is not None:
            arm.apply(sim.physics, robot)
            sim.physics.backlash = sim.physics.backlash.clamp(min=backlash)
        if compile:
            sim.compile()
        return cls(sim)

    def reset(self, q: np.ndarray, goal: np.ndarray | None = None, qd: np.ndarray | None = None) -> None:
        """At q [N, J], the servos holding `goal` (default: where they are), moving at qd (default: rest)."""
        sim = self.sim
        with torch.no_grad():
            sim.reset(torch.ones(sim.N, dtype=torch.bool), self._tensor(q))
            if qd is not None:
                sim.qd = self._tensor(qd)
            if goal is not None:
                sim.goal = sim.firmware.target = self._tensor(goal)
        self._refill_line(sim.goal.double().numpy())

    def torque(self, on: np.ndarray) -> None:
        """Torque on or off per servo [N, J]; switched on, the firmware starts from where the joint is."""
        sim = self.sim
        on = torch.as_tensor(np.asarray(on, dtype=bool)).reshape(sim.N, -1)
        rising = on & ~sim.enabled
        if bool(rising.any()):
            sim.firmware.target = torch.where(rising, sim.q, sim.firmware.target)
            sim.firmware.target_vel = torch.where(rising, 0.0, sim.firmware.target_vel)
        sim.enabled = on

    def _advance(self, goal: np.ndarray, steps: int) -> None:
        with torch.no_grad():
            self.sim.step(self._tensor(goal), steps)

    def _tensor(self, x) -> torch.Tensor:
        # Contiguous [N, J]: a numpy row's new axis (x[None]) has stride 0, and the compiled step
        # would recompile for it (seconds each, the arm frozen meanwhile).
        return torch.as_tensor(x, dtype=torch.float32).reshape(self.sim.N, -1).contiguous()

    @property
    def q(self) -> np.ndarray:
        return self.sim.q.double().numpy()

    @property
    def qd(self) -> np.ndarray:
        return self.sim.qd.double().numpy()

    def measured(self) -> np.ndarray:
        return self.sim.measured().double().numpy()

    def supply(self, volts: float) -> None:
        """Every servo's supply from now on (V): the motor drives with it."""
        self.sim.servo = dataclasses.replace(self.sim.servo, voltage=volts)

    def load_and_current(self) -> tuple[np.ndarray, np.ndarray]:
        """Each servo's PWM duty last step (signed fraction of full; 0 with torque off) and its
        motor current (A), [N, J]: what the servo reports as Present_Load and Present_Current.
        Needs a sim built with `reports_drive`."""
        sim = self.sim
        if not sim.reports_drive:
            raise RuntimeError("load_and_current: build the plant with reports_drive=True")
        duty = torch.where(sim.enabled, sim.firmware.duty, 0.0)
        current = torch.where(sim.enabled, motor_current(sim.servo, duty, sim.qd), 0.0)
        return duty.double().numpy(), current.double().numpy()


def rest_pose(plant: Plant, home: np.ndarray, max_s: float = 30.0) -> np.ndarray:
    """Where an unpowered arm (one, [J]) comes to rest when let go at `home`: stepped in half
    seconds, torque off, until no joint moves faster than 1 mrad/s (or `max_s`)."""
    plant.reset(home[None])
    plant.torque(np.zeros((1, len(home)), dtype=bool))
    for _ in range(round(max_s / 0.5)):
        plant.step(plant.measured(), 0.5)
        if float(np.abs(plant.qd).max()) < 1e-3:
            break
    return plant.q[0]
