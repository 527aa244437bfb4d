"""The control loop on the arm, plain Python (the ROS 2 node only wires ROS to this).

    loop = ControlLoop(bus, runtime, calibration, safety, target=lambda: xyz)
    loop.start()             # EEPROM check, Goal := Present, torque on
    loop.run(seconds=60)     # fixed rate; always ends with torque off

One tick: one SYNC_READ of positions -> observation (the export runtime, i.e. the
training code) -> inference -> safety -> one SYNC_WRITE of goals. Every few ticks one
servo's status is polled (SYNC_READ hides the error byte). Any exception, e-stop,
watchdog or servo fault ends in torque off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from soarm.calibration.calibration import MotorCalibration, check_servos, rad_to_ticks, ticks_to_rad
from soarm.export.runtime import PolicyError, PolicyRuntime
from soarm.robot.bus import BusError, FeetechBus
from soarm.robot.safety import COMMAND, TORQUE_OFF, SafetyLayer


@dataclass
class LoopStats:
    ticks: int = 0
    overruns: int = 0
    read_failures: int = 0
    write_failures: int = 0
    policy_errors: int = 0
    durations_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        d = np.asarray(self.durations_ms) if self.durations_ms else np.zeros(1)
        return {"ticks": self.ticks, "overruns": self.overruns, "read_failures": self.read_failures,
                "write_failures": self.write_failures, "policy_errors": self.policy_errors,
                "tick_ms_p50": float(np.percentile(d, 50)), "tick_ms_p99": float(np.percentile(d, 99)),
                "tick_ms_max": float(d.max())}


class ControlLoop:
    def __init__(self, bus: FeetechBus, runtime: PolicyRuntime, calibration: dict[str, MotorCalibration],
                 safety: SafetyLayer, target: Callable[[], np.ndarray], rate_hz: float | None = None,
                 status_every: int = 5):
        self.bus, self.rt, self.cal, self.safety, self.target = bus, runtime, calibration, safety, target
        self.rate = rate_hz or runtime.control_hz
        self.arm = list(runtime.contract["joint_names"])
        grip = runtime.contract["gripper"]
        self.gripper, self.gripper_hold = grip["joint"], grip["hold"]
        missing = [n for n in self.arm + [self.gripper] if n not in calibration]
        if missing:
            raise ValueError(f"calibration has no entry for {', '.join(missing)}")
        self.status_every = status_every
        self.stats = LoopStats()
        self.running = False

    # -------------------------------------------------------------- start
    def start(self) -> None:
        check_servos(self.bus, self.cal)
        held = self.bus.enable_torque()
        q = self._to_rad(held)
        self.safety.reset(q)
        self.goal, self.q_prev = q.copy(), q.copy()
        self.last_action = np.zeros(len(self.arm), dtype=np.float32)
        self.running = True

    # --------------------------------------------------------------- tick
    def tick(self) -> str:
        dt = 1.0 / self.rate
        try:
            q = self._to_rad(self.bus.sync_read("Present_Position"))
            fresh = True
        except BusError:
            self.stats.read_failures += 1
            q, fresh = self.q_prev, False
        goal, policy_ok, action = self.goal, False, np.zeros_like(self.last_action)
        if fresh:
            try:
                obs = self.rt.observe(q, self.q_prev, self.goal, self.target(), self.last_action)
                action = self.rt.act(obs)[0]
                goal = self.rt.next_goal(self.goal, action)[0]
                policy_ok = True
            except PolicyError:
                self.stats.policy_errors += 1
        decision = self.safety.filter(goal, q, fresh, policy_ok, dt, velocity=(q - self.q_prev) / dt)
        if decision.kind == TORQUE_OFF:
            self.shutdown()
            return TORQUE_OFF
        self._write(decision.goal)
        self.goal = decision.goal
        self.last_action = action if decision.kind == COMMAND else np.zeros_like(action)
        self.q_prev = q
        self.stats.ticks += 1
        if self.stats.ticks % self.status_every == 0:
            self._poll_status()
        return decision.kind

    def _write(self, arm_goal: np.ndarray) -> None:
        ticks = {self.cal[n].id: rad_to_ticks(self.cal[n], float(g)) for n, g in zip(self.arm, arm_goal)}
        ticks[self.cal[self.gripper].id] = rad_to_ticks(self.cal[self.gripper], self.gripper_hold)
        try:
            self.bus.sync_write("Goal_Position", ticks)
        except BusError:
            self.stats.write_failures += 1

    def _poll_status(self) -> None:
        names = self.arm + [self.gripper]
        name = names[(self.stats.ticks // self.status_every) % len(names)]
        try:
            st = self.bus.read_status(self.cal[name].id)
        except BusError:
            return                       # a missed poll; the watchdog covers a dead bus
        self.safety.status(self.cal[name].id, st.error_bits, st.temperature)

    def _to_rad(self, ticks: dict[int, int]) -> np.ndarray:
        return np.array([ticks_to_rad(self.cal[n], ticks[self.cal[n].id]) for n in self.arm], dtype=np.float32)

    # ---------------------------------------------------------------- run
    def run(self, seconds: float | None = None, should_stop: Callable[[], bool] = lambda: False) -> dict:
        """Tick at the rate until `seconds`, `should_stop()` or a torque-off; always ends
        with torque off, also on an exception."""
        period = 1.0 / self.rate
        t_end = None if seconds is None else time.perf_counter() + seconds
        next_t = time.perf_counter()
        try:
            while self.running and not should_stop() and (t_end is None or time.perf_counter() < t_end):
                t0 = time.perf_counter()
                if self.tick() == TORQUE_OFF:
                    break
                took = time.perf_counter() - t0
                self.stats.durations_ms.append(took * 1e3)
                next_t += period
                delay = next_t - time.perf_counter()
                if delay < 0:
                    self.stats.overruns += 1
                    next_t = time.perf_counter()
                else:
                    time.sleep(delay)
        finally:
            self.shutdown()
        return self.stats.summary()

    def estop(self) -> None:
        self.safety.estop()
        self.shutdown()

    def shutdown(self) -> None:
        self.running = False
        self.bus.torque_off()
