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
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from soarm.calibration.calibration import MotorCalibration, check_in_range, check_servos, rad_to_ticks, ticks_to_rad
from soarm.export.runtime import PolicyError, PolicyRuntime
from soarm.logs import TickRecord
from soarm.robot.bus import BusError, FeetechBus, ImplausibleStatus
from soarm.robot.safety import COMMAND, TORQUE_OFF, Decision, SafetyLayer
from soarm.servo import TICK, TICKS_PER_REV as TICKS

# No SO-101 joint turns faster, or speeds up faster, than this: the STS3215's no-load speed
# is about 5 rad/s at 7.4 V and 7 at 12 V; its stall torque on its own rotor alone gives
# ~115 rad/s^2 at 7.4 V and ~185 at 12 V. A reading further from where the last ones put
# the joint than these allow is garbage.
MAX_JOINT_SPEED = 10.0             # rad/s
MAX_JOINT_ACCEL = 300.0            # rad/s^2
PLAUSIBLE_SLACK_TICKS = 16         # encoder noise and the reads' own timing jitter
PARKED_WITHIN = 0.1                # rad: goal at a move's last pose and every joint this close (gravity sags it)


def _wrapped(ticks: float) -> float:
    """A difference of encoder readings, the short way round the turn."""
    return (ticks + TICKS // 2) % TICKS - TICKS // 2


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
        self.t_last: float | None = None   # s, monotonic: the previous decision (the watchdog's clock)
        self.t_read: float | None = None   # s, monotonic: when q_prev was read (the speed check's)
        self.last_action = np.zeros(len(self.goal), dtype=np.float32)
        # The last readings and goals observed, newest first, for a policy with a history
        # (soarm.reach.obs_terms); the start pose fills it, as a new episode's does in training.
        self.past_q = np.repeat(self.goal[None], runtime.history, axis=0)
        self.past_goal = self.past_q.copy()

    def __call__(self, q: np.ndarray | None, target, fault: str | None = None, now: float | None = None) -> StepResult:
        """q: arm joint angles (rad) read this tick, or None when the read failed. target
        None: nothing to reach for yet, so the current goal is held (through the clamps).
        now: when this tick's read was made (s, monotonic), so the watchdog and the speed
        check go by the clock; None: exactly one period after the previous tick."""
        fresh = q is not None
        q = self.q_prev if q is None else np.asarray(q, dtype=np.float32)
        goal, action = self.goal, None
        if fresh and target is not None:
            try:
                obs = self.rt.observe(q, self.q_prev, self.goal, target, self.last_action, self.past_q[None],
                                      self.past_goal[None])
                action = self.rt.act(obs)[0]
                goal = self.rt.next_goal(self.goal, action, q)[0]
            except PolicyError as e:
                action, fault = None, str(e)
        # Holding (no target yet) is a valid command: the current goal, kept where it is.
        decision = self._clamped(goal, q, fresh, target is None or action is not None, action, now,
                                 hold=target is None)
        return StepResult(decision, action, goal if action is not None else None, fault)

    def toward(self, q: np.ndarray | None, pose: np.ndarray, max_step: float, now: float | None = None) -> StepResult:
        """Instead of the policy: the goal moves toward `pose` (rad) by at most `max_step`
        this tick, through the same clamps (a JointMove: parking, home, a trajectory)."""
        fresh = q is not None
        q = self.q_prev if q is None else np.asarray(q, dtype=np.float32)
        goal = self.goal + np.clip(pose - self.goal, -max_step, max_step)
        return StepResult(self._clamped(goal, q, fresh, True, None, now), None, None, None)

    def _clamped(self, goal, q: np.ndarray, fresh: bool, fresh_policy: bool, action, now: float | None,
                 hold: bool = False) -> Decision:
        """The safety layer's decision on `goal`, and the step's state advanced by it."""
        if now is None:                         # a simulated tick: exactly one period
            elapsed = span = self.dt
        else:                                   # by the clock: since the last decision, since the last reading
            elapsed = self.dt if self.t_last is None else max(now - self.t_last, 1e-6)
            span = self.dt if self.t_read is None else max(now - self.t_read, 1e-6)
            self.t_last = now
        decision = self.safety.filter(goal, q, fresh, fresh_policy, self.dt, elapsed=elapsed,
                                      velocity=(q - self.q_prev) / span, hold=hold)
        if decision.goal is not None:
            self.past_q = np.concatenate((q[None], self.past_q))[:len(self.past_q)]
            self.past_goal = np.concatenate((self.goal[None], self.past_goal))[:len(self.past_goal)]
            self.goal = decision.goal.astype(np.float32)
            self.last_action = (action if action is not None and decision.kind == COMMAND
                                else np.zeros_like(self.last_action))
            self.q_prev = q
            if fresh and now is not None:
                self.t_read = now
        return decision


@dataclass
class JointMove:
    """The arm moved through joint poses instead of the policy (ControlLoop.move): parking
    before torque off, the home and park poses, a joint trajectory. The setpoint follows the
    waypoints in time (linear between them, the last one held); the goal chases it at most
    `speed` rad/s per joint, and the safety layer's clamps and rate cap apply on top."""
    poses: np.ndarray                  # [K, J] rad, arm joints
    times: np.ndarray                  # [K] s after the move's first tick, non-decreasing
    speed: float                       # rad/s per joint, at most
    then: str = "hold"                 # at the end: "hold" the last pose, or "torque_off" (parking)
    name: str = "move"
    done: bool = False                 # the goal is at the last pose and every joint within PARKED_WITHIN
    t0: float | None = None            # s: the move's first tick

    @classmethod
    def to(cls, pose: np.ndarray, speed: float, then: str = "hold", name: str = "move") -> "JointMove":
        """Straight to one pose at `speed`."""
        return cls(np.asarray(pose, dtype=np.float32)[None], np.zeros(1), speed, then, name)

    def setpoint(self, t: float) -> np.ndarray:
        if self.t0 is None:
            self.t0 = t
        s = t - self.t0
        return np.array([np.interp(s, self.times, self.poses[:, j]) for j in range(self.poses.shape[1])],
                        dtype=np.float32)

    def finished(self, t: float) -> bool:
        return self.t0 is not None and t - self.t0 >= self.times[-1]


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
        """`recorder`: an EncoderLogWriter (soarm/logs.py) that receives every tick."""
        self.bus, self.rt, self.cal, self.safety, self.target = bus, runtime, calibration, safety, target
        self.recorder = recorder
        self.rate = rate_hz or runtime.control_hz
        self.arm = list(runtime.contract.joint_names)
        self.gripper = runtime.contract.gripper_joint
        missing = [n for n in self.arm + [self.gripper] if n not in calibration]
        if missing:
            raise ValueError(f"calibration has no entry for {', '.join(missing)}")
        self.status_every = status_every
        self.stats = LoopStats()
        self.running = False
        self.reading: dict[int, int] | None = None      # the latest raw encoder ticks per servo id
        self._accepted: tuple[float, dict[int, int], dict[int, float]] | None = None   # the last plausible
        # reading: (time, ticks, ticks/s since the one before)
        self.move: JointMove | None = None              # set: ticks move the arm through poses, no policy
        self.servo_status: dict = {}                     # servo id -> latest polled ServoStatus
        self._polled: dict | None = None                 # polled since the last tick record: for the log
        self._implausible: set[int] = set()              # servos whose last poll was implausible

    # -------------------------------------------------------------- start
    def start(self) -> None:
        check_servos(self.bus, self.cal)
        self._check_status()
        check_in_range(self.cal, self.bus.sync_read("Present_Position", tries=3))
        held = self.bus.enable_torque()
        self._accepted = (time.perf_counter(), dict(held), {})
        # The gripper stays where it was: nothing the user did not ask for moves.
        self.gripper_ticks = held[self.cal[self.gripper].id]
        self.step = PolicyStep(self.rt, self.safety, self.rate, self._to_rad(held))
        self.t0 = time.perf_counter()
        self.running, self.move = True, None

    def log_header(self) -> dict:
        """What a replay needs besides the ticks: joints, calibration, rate, policy."""
        return {"source": "soarm", "arm_joints": self.arm, "gripper": self.gripper, "rate_hz": self.rate,
                "calibration": {n: asdict(c) for n, c in self.cal.items()}, "policy": str(self.rt.path),
                "contract_hash": self.rt.contract.hash(), "safety": asdict(self.safety.cfg),
                "start_q": self.step.goal.tolist()}

    # --------------------------------------------------------------- tick
    def tick(self) -> str:
        t0 = time.perf_counter()
        q, fault, target = None, None, self.target()
        try:
            raw = self.bus.sync_read("Present_Position")
            t_read = time.perf_counter()
            self._check_plausible(raw, t0)
            q = self._to_rad(raw)
        except BusError as e:
            raw, fault, t_read = None, str(e), None
            self.stats.read_failures += 1
        self.reading = raw
        move = self.move
        if move is not None:
            now = t0 - self.t0
            pose, max_step = move.setpoint(now), move.speed / self.rate
            r = self.step.toward(q, pose, max_step, now=now)
            last = np.clip(move.poses[-1], self.safety.lower, self.safety.upper)     # as the clamps allow
            move.done = (move.finished(now) and q is not None
                         and bool(np.abs(self.step.goal - last).max() < 1e-6)
                         and bool(np.abs(q - self.step.goal).max() < PARKED_WITHIN))
        else:
            r = self.step(q, target, fault, now=t0 - self.t0)
        if q is not None and target is not None and r.action is None:
            self.stats.policy_errors += 1
        d = r.decision
        sent = d.kind != TORQUE_OFF and self._write(d.goal)
        if self.recorder is not None:
            t_sent = time.perf_counter()
            listed = lambda x: None if x is None else np.asarray(x, dtype=float).tolist()  # noqa: E731
            self.recorder.write(TickRecord(
                t=t0 - self.t0, t_read=None if t_read is None else t_read - self.t0,
                t_sent=t_sent - self.t0 if sent else None, raw=raw, q=listed(q), target=listed(target),
                action=listed(r.action), goal_policy=listed(r.goal_policy), goal_sent=listed(d.goal),
                decision=d.kind, events=d.events, fault=r.fault,
                move=None if move is None else {"name": move.name, "pose": pose.tolist(), "max_step": max_step},
                status=self._polled))
        self._polled = None
        if d.kind == TORQUE_OFF:
            self.shutdown()
            return TORQUE_OFF
        self.stats.ticks += 1
        if self.stats.ticks % self.status_every == 0:
            self.poll_status(self.stats.ticks // self.status_every)
        self.stats.durations_ms.append((time.perf_counter() - t0) * 1e3)
        return d.kind

    def _check_plausible(self, raw: dict[int, int], now: float) -> None:
        """A reading with a valid checksum can still be garbage: one further from where the
        last accepted readings put the joint (its position moved on at its speed, capped at
        MAX_JOINT_SPEED) than MAX_JOINT_ACCEL allows is a failed read (BusError). A one-tick
        spike of 150-200 ticks passed the speed bound alone."""
        if self._accepted is not None:
            then, last, vel = self._accepted
            dt = now - then
            for sid, t in raw.items():
                v = float(np.clip(vel.get(sid, 0.0), -MAX_JOINT_SPEED / TICK, MAX_JOINT_SPEED / TICK))
                off = abs(_wrapped(t - last[sid] - v * dt))
                allowed = min(0.5 * MAX_JOINT_ACCEL * dt * dt, 2 * MAX_JOINT_SPEED * dt) / TICK + PLAUSIBLE_SLACK_TICKS
                if off > allowed:
                    raise BusError(f"{self.bus.port_name}: implausible reading from servo {sid} "
                                   f"({self.bus.names[sid]}): {off:.0f} ticks from where it was heading, "
                                   f"{dt * 1e3:.0f} ms after the last good one")
            vel = {sid: _wrapped(t - last[sid]) / dt if dt > 0 else 0.0 for sid, t in raw.items()}
        else:
            vel = {}
        self._accepted = (now, dict(raw), vel)

    def _write(self, arm_goal: np.ndarray) -> bool:
        """Send the goal; False when the write failed (counted, the next tick tries again)."""
        ticks = {self.cal[n].id: rad_to_ticks(self.cal[n], float(g)) for n, g in zip(self.arm, arm_goal)}
        ticks[self.cal[self.gripper].id] = self.gripper_ticks
        try:
            self.bus.sync_write("Goal_Position", ticks)
            return True
        except BusError:
            self.stats.write_failures += 1
            return False

    def _check_status(self) -> None:
        """Before torque on: no servo may report a fatal fault or run hot (ValueError naming it)."""
        for name in self.arm + [self.gripper]:
            sid = self.cal[name].id
            for attempt in range(3):                  # a missed reply is not a verdict
                try:
                    st = self.bus.read_status(sid)
                    break
                except ImplausibleStatus as e:
                    if attempt == 2:
                        raise ValueError(f"enable refused: {e}: a failing supply or sensor; check the "
                                         "power supply and the servo") from None
                except BusError:
                    if attempt == 2:
                        raise
            self.servo_status[sid] = st
            faults = self.safety.servo_faults(st.error_bits, st.temperature)
            if faults:
                raise ValueError(f"enable refused: servo {sid} ({name}) reports {' and '.join(faults)} "
                                 f"(status 0x{st.error_bits:02x}); clear the cause (an error bit needs a power "
                                 f"cycle of the servo)")

    def poll_status(self, k: int) -> None:
        """Read the k-th servo's (round robin) status; a fault trips the safety layer."""
        names = self.arm + [self.gripper]
        sid = self.cal[names[k % len(names)]].id
        try:
            st, plausible = self.bus.read_status(sid), True
        except ImplausibleStatus as e:    # shown as read; a fault when the next poll says it again
            st, plausible = e.status, False
        except BusError:
            return                       # a missed poll; the watchdog covers a dead bus
        self.servo_status[sid] = st
        self._polled = {sid: asdict(st)}
        if plausible:
            self._implausible.discard(sid)
            self.safety.status(sid, st.error_bits, st.temperature)
        elif sid in self._implausible:
            self.safety.implausible_status(sid)
        else:
            self._implausible.add(sid)

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
        self.running, self.move = False, None
        self.bus.torque_off()
