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
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from soarm.calibration.calibration import MotorCalibration, check_servos, rad_to_ticks, ticks_to_rad
from soarm.export.runtime import PolicyError, PolicyRuntime
from soarm.robot.bus import BusError, FeetechBus
from soarm.robot.safety import COMMAND, TORQUE_OFF, Decision, SafetyLayer


@dataclass
class LoopStats:
    ticks: int = 0
    overruns: int = 0
    read_failures: int = 0
    write_failures: int = 0
    policy_errors: int = 0
    durations_ms: deque = field(default_factory=lambda: deque(maxlen=100_000))   # the latest ~1 h at 30 Hz

    def summary(self) -> dict:
        d = np.asarray(self.durations_ms) if self.durations_ms else np.zeros(1)
        return {"ticks": self.ticks, "overruns": self.overruns, "read_failures": self.read_failures,
                "write_failures": self.write_failures, "policy_errors": self.policy_errors,
                "tick_ms_p50": float(np.percentile(d, 50)), "tick_ms_p99": float(np.percentile(d, 99)),
                "tick_ms_max": float(d.max())}


@dataclass
class StepResult:
    decision: Decision
    action: np.ndarray | None          # policy output, None when the policy gave none
    goal_policy: np.ndarray | None     # the goal the policy asked for, before safety
    fault: str | None = None


class PolicyStep:
    """One tick's decision, bus-free: reading -> observation -> policy -> safety. The control
    loop and the replay of an encoder log both run exactly this."""

    def __init__(self, runtime: PolicyRuntime, safety: SafetyLayer, rate_hz: float, q0: np.ndarray):
        self.rt, self.safety, self.dt = runtime, safety, 1.0 / rate_hz
        self.safety.reset(q0)
        self.goal = np.asarray(q0, dtype=np.float32).copy()
        self.q_prev = self.goal.copy()
        self.last_action = np.zeros(len(self.goal), dtype=np.float32)

    def __call__(self, q: np.ndarray | None, target, fault: str | None = None) -> StepResult:
        """q: arm joint angles (rad) read this tick, or None when the read failed. target
        None: nothing to reach for yet, so the current goal is held (through the clamps)."""
        fresh = q is not None
        q = self.q_prev if q is None else np.asarray(q, dtype=np.float32)
        goal, action = self.goal, None
        if fresh and target is not None:
            try:
                obs = self.rt.observe(q, self.q_prev, self.goal, target, self.last_action)
                action = self.rt.act(obs)[0]
                goal = self.rt.next_goal(self.goal, action)[0]
            except PolicyError as e:
                action, fault = None, str(e)
        # Holding (no target yet) is a valid command: the current goal, through the clamps.
        decision = self.safety.filter(goal, q, fresh, target is None or action is not None, self.dt,
                                      velocity=(q - self.q_prev) / self.dt)
        if decision.goal is not None:
            self.goal = decision.goal.astype(np.float32)
            self.last_action = (action if action is not None and decision.kind == COMMAND
                                else np.zeros_like(self.last_action))
            self.q_prev = q
        return StepResult(decision, action, goal if action is not None else None, fault)


class Ticker:
    """A fixed-rate schedule. After an overrun it restarts from now rather than firing a
    burst of late ticks to catch up (a late goal is worse than a skipped one)."""

    def __init__(self, rate_hz: float):
        self.period = 1.0 / rate_hz
        self.next = time.perf_counter()
        self.due = True

    def wait(self, wake=None) -> bool:
        """Sleep until the next tick is due; True when this tick overran its period. With
        `wake` (a threading.Event) it returns as soon as that is set, the schedule left as
        it was; `self.due` tells the two apart."""
        delay = self.next + self.period - time.perf_counter()
        if delay < 0:
            self.next, self.due = time.perf_counter(), True
            return True
        self.due = not wake.wait(delay) if wake is not None else (time.sleep(delay) or True)
        if self.due:
            self.next += self.period
        return False


class ControlLoop:
    def __init__(self, bus: FeetechBus, runtime: PolicyRuntime, calibration: dict[str, MotorCalibration],
                 safety: SafetyLayer, target: Callable[[], np.ndarray], rate_hz: float | None = None,
                 status_every: int = 5, recorder=None):
        """`recorder`: an EncoderLogWriter (robot/enclog.py) that receives every tick."""
        self.bus, self.rt, self.cal, self.safety, self.target = bus, runtime, calibration, safety, target
        self.recorder = recorder
        self.rate = rate_hz or runtime.control_hz
        self.arm = list(runtime.contract["joint_names"])
        self.gripper = runtime.contract["gripper"]["joint"]
        missing = [n for n in self.arm + [self.gripper] if n not in calibration]
        if missing:
            raise ValueError(f"calibration has no entry for {', '.join(missing)}")
        self.status_every = status_every
        self.stats = LoopStats()
        self.running = False
        self.reading: dict[int, int] | None = None      # the latest raw encoder ticks per servo id
        self.servo_status: dict = {}                     # servo id -> latest polled ServoStatus

    # -------------------------------------------------------------- start
    def start(self) -> None:
        check_servos(self.bus, self.cal)
        held = self.bus.enable_torque()
        # The gripper stays where it was: nothing the user did not ask for moves.
        self.gripper_ticks = held[self.cal[self.gripper].id]
        self.step = PolicyStep(self.rt, self.safety, self.rate, self._to_rad(held))
        self.t0 = time.perf_counter()
        self.running = True

    def log_header(self) -> dict:
        """What a replay needs besides the ticks: joints, calibration, rate, policy."""
        from dataclasses import asdict

        from soarm.contract import config_hash

        return {"source": "soarm", "arm_joints": self.arm, "gripper": self.gripper, "rate_hz": self.rate,
                "calibration": {n: asdict(c) for n, c in self.cal.items()}, "policy": str(self.rt.path),
                "contract_hash": config_hash(self.rt.contract), "safety": asdict(self.safety.cfg),
                "start_q": self.step.goal.tolist()}

    # --------------------------------------------------------------- tick
    def tick(self) -> str:
        t0 = time.perf_counter()
        q, fault, target = None, None, self.target()
        try:
            raw = self.bus.sync_read("Present_Position")
            q = self._to_rad(raw)
        except BusError as e:
            raw, fault = None, str(e)
            self.stats.read_failures += 1
        self.reading = raw
        r = self.step(q, target, fault)
        if q is not None and target is not None and r.action is None:
            self.stats.policy_errors += 1
        d = r.decision
        if self.recorder is not None:
            self.recorder.write({
                "t": t0 - self.t0, "raw": raw, "q": None if q is None else q.tolist(),
                "target": None if target is None else np.asarray(target, dtype=float).tolist(),
                "action": None if r.action is None else r.action.tolist(),
                "goal_policy": None if r.goal_policy is None else r.goal_policy.tolist(),
                "goal_sent": None if d.goal is None else d.goal.tolist(),
                "decision": d.kind, "events": d.events, "fault": r.fault})
        if d.kind == TORQUE_OFF:
            self.shutdown()
            return TORQUE_OFF
        self._write(d.goal)
        self.stats.ticks += 1
        if self.stats.ticks % self.status_every == 0:
            self.poll_status(self.stats.ticks // self.status_every)
        self.stats.durations_ms.append((time.perf_counter() - t0) * 1e3)
        return d.kind

    def _write(self, arm_goal: np.ndarray) -> None:
        ticks = {self.cal[n].id: rad_to_ticks(self.cal[n], float(g)) for n, g in zip(self.arm, arm_goal)}
        ticks[self.cal[self.gripper].id] = self.gripper_ticks
        try:
            self.bus.sync_write("Goal_Position", ticks)
        except BusError:
            self.stats.write_failures += 1

    def poll_status(self, k: int) -> None:
        """Read the k-th servo's (round robin) status; a fault trips the safety layer."""
        names = self.arm + [self.gripper]
        sid = self.cal[names[k % len(names)]].id
        try:
            st = self.bus.read_status(sid)
        except BusError:
            return                       # a missed poll; the watchdog covers a dead bus
        self.servo_status[sid] = st
        self.safety.status(sid, st.error_bits, st.temperature)

    def _to_rad(self, ticks: dict[int, int]) -> np.ndarray:
        return np.array([ticks_to_rad(self.cal[n], ticks[self.cal[n].id]) for n in self.arm], dtype=np.float32)

    # ---------------------------------------------------------------- run
    def run(self, seconds: float | None = None, should_stop: Callable[[], bool] = lambda: False) -> dict:
        """Tick at the rate until `seconds`, `should_stop()` or a torque-off; always ends
        with torque off, also on an exception."""
        t_end = None if seconds is None else time.perf_counter() + seconds
        ticker = Ticker(self.rate)
        try:
            while self.running and not should_stop() and (t_end is None or time.perf_counter() < t_end):
                if self.tick() == TORQUE_OFF:
                    break
                self.stats.overruns += ticker.wait()
        finally:
            self.shutdown()
        return self.stats.summary()

    def estop(self) -> None:
        self.safety.estop()
        self.shutdown()

    def shutdown(self) -> None:
        self.running = False
        self.bus.torque_off()
