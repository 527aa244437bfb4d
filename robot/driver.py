"""The arm as a long-running service, ROS-agnostic: what the ROS 2 node wires to.

    driver = ReachDriver(DriverCfg(port=..., policy=..., calibration=...), on_state=publish)
    driver.start()                     # the bus thread: connect, check servos, read joints
    driver.enable()                    # Goal := Present, torque on, policy in the loop
    driver.set_target(xyz, "base_link")
    driver.move_to("home"); driver.follow(trajectory)    # joint-space moves instead of the policy
    driver.estop(); driver.disable(); driver.close()

One thread owns the bus (the SDK is not thread-safe) and runs at the control rate: while
enabled it runs the control loop's tick (read -> policy -> safety -> write), while
disabled it only reads the joints. Requests from other threads (enable, disable, e-stop)
are queued and wake the thread: they are served as soon as the tick in progress ends,
before anything else is written, so an e-stop takes effect within one tick. Until a valid
target arrives the arm holds its goal. A joint move (home, park, a trajectory) replaces the
policy until it ends, then holds its last pose; a new target hands the arm back to the
policy. Anything that goes wrong ends disabled with torque off and the reason in
`diagnostics()`; the thread itself keeps running, so the arm can be enabled again once the
fault is fixed: enable after a fault reopens the port first (a replugged adapter is a new
device behind the same path) and says so.

Bad configuration (files, contract vs arm) raises a one-line ValueError from the
constructor; nothing has touched the bus then.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

import numpy as np

from soarm.calibration import calibration
from soarm.description import load_robot
from soarm.export.runtime import PolicyRuntime
from soarm.robot.bus import BAUD, BusError, FeetechBus
from soarm.logs import EncoderLogWriter
from soarm.robot.loop import ControlLoop, JointMove, Ticker
from soarm.robot.safety import TORQUE_OFF, SafetyCfg, SafetyLayer

DISABLED, ENABLED, PARKING, FAULT = "disabled", "enabled", "parking", "fault"
HOME_SPEED = 0.6                           # rad/s of move_to when park_speed is 0 (no parking)
RECONNECT_S = 1.0                          # s between reconnect tries while disabled with the bus gone


@dataclass
class DriverCfg:
    port: str = ""                        # serial port of the servo adapter
    policy: str = ""                      # exported ONNX policy
    calibration: str = ""                 # LeRobot calibration JSON
    baud: int = BAUD
    servo_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])   # robot joint order
    rate_hz: float = 0.0                  # control rate: 0 or the policy contract's (another is refused)
    enable_on_start: bool = False
    log_dir: str = ""                     # an encoder log (MCAP) per enable; "" for none
    status_every: int = 5                 # ticks between servo status polls (round robin)
    park_speed: float = 0.6               # rad/s per joint on the way to the park pose; 0: torque off at once
    park_timeout_s: float = 8.0           # torque off after this long even if the park pose is not reached
    safety: SafetyCfg = field(default_factory=SafetyCfg)

    # The outer ranges (the ROS node's parameter descriptors show them); validate adds the gaps.
    BOUNDS = {"rate_hz": (0.0, 500.0), "status_every": (1, 1000), "park_speed": (0.0, 1.5),
              "park_timeout_s": (1.0, 30.0)}

    def validate(self) -> None:
        for key in ("port", "policy", "calibration"):
            if not getattr(self, key):
                raise ValueError(f"'{key}' is required")
        if len(set(self.servo_ids)) != len(self.servo_ids) or not all(0 <= i <= 253 for i in self.servo_ids):
            raise ValueError(f"servo_ids {self.servo_ids}: need distinct ids in 0..253")
        for name, (lo, hi) in self.BOUNDS.items():
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"{name}: {getattr(self, name)} is outside {lo:g}..{hi:g}")
        if 0 < self.rate_hz < 1:
            raise ValueError(f"rate_hz {self.rate_hz}: 0 (the policy's) or 1..500")
        if 0 < self.park_speed < 0.05:
            raise ValueError(f"park_speed {self.park_speed}: 0 (no parking) or 0.05..1.5 rad/s")
        if self.baud <= 0:
            raise ValueError(f"baud {self.baud}: must be positive")
        self.safety.validate()


@dataclass
class JointSample:
    names: list[str]
    positions: list[float]                # rad, robot joint order (gripper included)
    velocities: list[float]               # rad/s since the previous reading (0 for the first)


@dataclass
class Trajectory:
    """Joint-space waypoints for `ReachDriver.follow` (a ROS JointTrajectory, plain)."""
    joint_names: list[str]                # arm joints; the ones left out keep their goal
    positions: list[list[float]]          # rad, one row per point, in joint_names' order
    times: list[float]                    # s from the start, one per point, increasing


@dataclass
class _Request:
    kind: str
    move: JointMove | None = None       # "move": what to run
    joints: list[int] | None = None     # its poses' columns (arm joint indices); None: every arm joint
    t: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    message: str = ""
    sent: float | None = None           # e-stop: when the requester's broadcast torque off went out


class ReachDriver:
    def __init__(self, cfg: DriverCfg, on_state: Callable[[JointSample], None] = lambda s: None,
                 on_event: Callable[[str, str], None] = lambda level, msg: None):
        """on_state: every reading (bus thread); on_event(level, message): state changes
        and faults, level 'info' | 'warn' | 'error', for the front end's log."""
        cfg.validate()
        self.cfg, self.on_state, self.on_event = cfg, on_state, on_event
        self.robot = load_robot()
        if len(cfg.servo_ids) != len(self.robot.names):
            raise ValueError(f"servo_ids: {len(cfg.servo_ids)} ids for the arm's {len(self.robot.names)} "
                             f"joints ({', '.join(self.robot.names)})")
        self.runtime = PolicyRuntime(cfg.policy, self.robot)       # PolicyError (a ValueError)
        self.cal = calibration.load(cfg.calibration, self.robot.names)
        for name, sid in zip(self.robot.names, cfg.servo_ids):
            if self.cal[name].id != sid:
                raise ValueError(f"{cfg.calibration}: '{name}' is servo {self.cal[name].id}, "
                                 f"servo_ids says {sid}")
        # A policy acts per tick (relative targets, a history of past ticks) and the safety
        # layer's step bound is per tick: at another rate the same policy is another controller
        # (at 120 Hz a 30 Hz policy oscillated, 6.8 rad/s, with no fault).
        if cfg.rate_hz and abs(cfg.rate_hz - self.runtime.control_hz) > 1e-6:
            raise ValueError(f"rate_hz {cfg.rate_hz:g}: {cfg.policy} was trained at "
                             f"{self.runtime.control_hz:g} Hz and runs only at that rate (0 takes it)")
        self.rate = self.runtime.control_hz
        self.safety = SafetyLayer.for_arm(cfg.safety, self.robot, self.cal)
        self.bus = FeetechBus(cfg.port, dict(zip(self.robot.names, cfg.servo_ids)), cfg.baud)
        self.loop = ControlLoop(self.bus, self.runtime, self.cal, self.safety, self._target, self.rate,
                                cfg.status_every)
        self.state, self.reason = DISABLED, "starting"
        self.connected = False
        self.connections = 0                      # successful connects; > 1: reconnected after a fault
        self.target: np.ndarray | None = None
        self.target_serial = 0                    # counts set_target calls: a new target ends a holding move
        self._move_serial = 0
        self._target_lock = threading.Lock()
        self._requests: queue.Queue[_Request] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()            # a request is waiting: serve it now, not next tick
        self._cut_park = threading.Event()        # Ctrl-C again while parking on the way out
        self._finished = threading.Event()        # the bus thread has turned torque off and ended
        self._ready = threading.Event()           # the first connect (and enable_on_start) is done
        self._thread: threading.Thread | None = None
        self.read_failures = 0
        self._failed_reads = 0                    # in a row, while disabled
        self._next_reconnect = 0.0                # monotonic: the next reconnect try with the bus gone
        self._last_sample: tuple[float, list[float]] | None = None     # (time, positions) last published
        self.estop_latency_ms: float | None = None

    # ------------------------------------------------------- any thread
    def start(self) -> "ReachDriver":
        self._thread = threading.Thread(target=self._run, name="soarm-bus", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float) -> bool:
        """Wait for the bus thread's first verdict (connected, or a fault in `reason`)."""
        return self._ready.wait(timeout)

    def enable(self, timeout: float = 10.0) -> tuple[bool, str]:
        return self._request(_Request("enable"), timeout)

    def disable(self, timeout: float = 5.0) -> tuple[bool, str]:
        return self._request(_Request("disable"), timeout)

    def estop(self, timeout: float = 5.0) -> tuple[bool, str]:
        # From this thread at once, even while the bus thread is blocked in a read: the safety
        # layer tripped (no tick sends a goal after it) and a broadcast torque off on the wire.
        # The bus thread then confirms servo by servo.
        r = _Request("estop")
        self.safety.estop()
        r.sent = self.bus.broadcast_torque_off()
        return self._request(r, timeout)

    def set_target(self, xyz, frame: str | None = None) -> np.ndarray:
        """Validate and take a new target; PolicyError (one line) if refused, the old one kept."""
        t = self.runtime.check_target(xyz, frame)
        with self._target_lock:
            self.target = t
            self.target_serial += 1
        return t

    def move_to(self, pose: str, timeout: float = 5.0) -> tuple[bool, str]:
        """Move to the description's `home` or `park` pose at park_speed and hold there."""
        if pose not in ("home", "park"):
            return False, f"unknown pose {pose!r}: home or park"
        speed = self.cfg.park_speed or HOME_SPEED
        return self._request(_Request("move", JointMove.to(getattr(self.robot, pose), speed, name=pose)), timeout)

    def follow(self, traj: Trajectory, timeout: float = 5.0) -> tuple[bool, str]:
        """Move through joint-space waypoints on their times (from the current goal to the
        first point by its time), then hold the last one. Refused, one line, if a joint is not
        an arm joint, a position is not finite or outside its limits, or the times do not
        increase. The safety layer's clamps and rate cap apply as to the policy."""
        try:
            names, pos, times = self._checked(traj)
        except ValueError as e:
            return False, f"trajectory refused: {e}"
        move = JointMove(pos, times, self.cfg.safety.max_step * self.rate, name="trajectory")
        return self._request(_Request("move", move, joints=names), timeout)

    def _checked(self, traj: Trajectory) -> tuple[list[int], np.ndarray, np.ndarray]:
        arm = list(self.runtime.contract.joint_names)
        if not traj.positions or len(traj.positions) != len(traj.times):
            raise ValueError(f"{len(traj.positions)} points and {len(traj.times)} times; need one time per point")
        unknown = [n for n in traj.joint_names if n not in arm]
        if unknown or len(set(traj.joint_names)) != len(traj.joint_names) or not traj.joint_names:
            raise ValueError(f"joints {traj.joint_names}: need distinct arm joints ({', '.join(arm)}); "
                             f"the gripper is held where it is")
        if any(len(row) != len(traj.joint_names) for row in traj.positions):
            raise ValueError(f"every point needs one position per joint ({len(traj.joint_names)})")
        pos = np.asarray(traj.positions, dtype=np.float64)
        times = np.asarray(traj.times, dtype=np.float64)
        if not (np.isfinite(pos).all() and np.isfinite(times).all()):
            raise ValueError("positions and times must be finite")
        if times[0] < 0 or (np.diff(times) <= 0).any():
            raise ValueError(f"times {times.tolist()} s: need 0 <= t and strictly increasing")
        idx = [arm.index(n) for n in traj.joint_names]
        lower, upper = self.safety.lower[idx], self.safety.upper[idx]
        for k, row in enumerate(pos):
            bad = np.flatnonzero((row < lower) | (row > upper))
            if len(bad):
                j = bad[0]
                raise ValueError(f"point {k}: {traj.joint_names[j]} at {row[j]:.3f} rad is outside "
                                 f"{lower[j]:.3f}..{upper[j]:.3f} (the calibrated limits less the margin)")
        return idx, pos.astype(np.float32), times

    def close(self) -> None:
        """Stop the bus thread; it parks the arm and turns torque off on its way out. Ctrl-C
        while it parks (a second one, after the one that called this) cuts the park short:
        torque off at once, where the arm is, and no traceback."""
        self._stop.set()
        self._wake.set()
        # Waited on an event the bus thread sets last, not join(): a join that Ctrl-C interrupts
        # can mark the thread stopped while it still runs (CPython 3.11), and the port would
        # then be closed under it mid-park.
        if self._thread is not None:
            deadline = time.monotonic() + self.cfg.park_timeout_s + 5
            while not self._finished.is_set() and time.monotonic() < deadline:
                try:
                    self._finished.wait(0.1)
                except KeyboardInterrupt:
                    self._cut_park.set()
        if not self._finished.is_set():
            self.loop.shutdown()                # never started, or stuck: torque off from here
        self.bus.close()

    @property
    def park_cut_short(self) -> bool:
        """close() was interrupted again while parking: torque went off where the arm was."""
        return self._cut_park.is_set()

    def diagnostics(self) -> dict:
        stats = self.loop.stats.summary()
        status = {sid: {"temperature_c": s.temperature, "voltage_v": s.voltage, "load": s.load,
                        "error_bits": s.error_bits} for sid, s in dict(self.loop.servo_status).items()}
        return {"state": self.state, "reason": self.reason, "connected": self.connected,
                "reconnects": max(0, self.connections - 1), "rate_hz": self.rate,
                "target": None if self.target is None else self.target.tolist(), "targets": self.target_serial,
                "read_failures_disabled": self.read_failures, "estop_latency_ms": self.estop_latency_ms,
                "move": None if self.loop.move is None else {"name": self.loop.move.name, "done": self.loop.move.done},
                "tick": stats, "clamps": dict(self.safety.counters), "tripped": self.safety.tripped,
                "servos": status}

    def _target(self):
        with self._target_lock:
            return self.target

    def _request(self, r: _Request, timeout: float) -> tuple[bool, str]:
        if self._thread is None or not self._thread.is_alive():
            return False, f"{r.kind}: the driver is not running"
        self._requests.put(r)
        self._wake.set()
        if not r.done.wait(timeout):
            return False, f"{r.kind}: no answer from the bus thread within {timeout:.0f} s"
        return r.ok, r.message

    # -------------------------------------------------------- bus thread
    def _run(self) -> None:
        try:
            if self._connect() and self.cfg.enable_on_start:
                self._enable(_Request("enable"))
        except Exception as e:  # noqa: BLE001 - whatever it was, the arm ends safe
            self._fault(_internal(e))
        self._ready.set()
        ticker = Ticker(self.rate)
        k = 0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self._serve_requests()
                if not ticker.due:
                    pass                            # woken by a request between ticks
                elif self.loop.running:
                    self._tick()
                else:
                    self._read()
                    k += 1
                    if self.connected and k % self.cfg.status_every == 0:
                        self.loop.poll_status(k // self.cfg.status_every)
            except Exception as e:  # noqa: BLE001 - whatever it was, the arm ends safe
                self._fault(_internal(e))
            overran = ticker.wait(self._wake)
            if self.loop.running:
                self.loop.stats.overruns += overran
        try:
            self._park_then_disable(ticker)
        finally:
            self._finished.set()

    def _park_then_disable(self, ticker: Ticker) -> None:
        """Shutting down (Ctrl-C, close): park as disable does, ticking here, then torque off."""
        try:
            if self.loop.running and self.state == ENABLED and self._start_parking():
                while self.state == PARKING and not self._cut_park.is_set():
                    ticker.wait(self._cut_park)
                    if ticker.due:
                        self._tick()
        except Exception as e:  # noqa: BLE001 - whatever it was, the arm ends safe
            self._fault(_internal(e))
        if self._cut_park.is_set() and self.state == PARKING:
            self._set(PARKING, "interrupted again: park cut short, torque off where the arm is", "warn")
        self._disable(_Request("shutdown"))

    def _serve_requests(self) -> None:
        while True:
            try:
                r = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                {"enable": self._enable, "disable": self._disable, "estop": self._estop,
                 "move": self._move}[r.kind](r)
            finally:
                r.done.set()                      # the caller never waits out its timeout

    def _connect(self, quiet: bool = False) -> bool:
        """Open the port afresh and check the servos: at start, on enable after a fault (a
        replugged adapter or a restarted emulator is a new device behind the same path), and
        every RECONNECT_S while disabled with the bus gone (`quiet`: a failure keeps the
        fault's reason as it is)."""
        again = self.connections > 0
        try:
            self.bus.close()
            self.bus.connect()
            calibration.check_servos(self.bus, self.cal)
        except (BusError, ValueError) as e:
            self.connected = False
            if not quiet:
                self._set(FAULT, str(e), "error")
            return False
        self.connected = True
        self.connections += 1
        self._set(DISABLED, "reconnected; torque off" if again else "connected; torque off")
        return True

    def _enable(self, r: _Request) -> None:
        if self.loop.running and self.state == PARKING:            # enable cancels a park
            self.loop.move = None
            self._set(ENABLED, "torque on; parking cancelled")
            r.ok, r.message = True, "enabled (parking cancelled)"
            return
        if self.loop.running:
            r.ok, r.message = True, "already enabled"
            return
        if (not self.connected or self.state == FAULT) and not self._connect():
            r.message = f"enable refused: {self.reason}"
            return
        try:
            self.loop.start()               # EEPROM check, Goal := Present, torque on
        except (BusError, ValueError) as e:
            self.loop.shutdown()
            self._set(FAULT, str(e), "error")
            r.message = f"enable failed: {e}"
            return
        if self.cfg.log_dir:
            stamp = datetime.now().strftime("%Y%m%d_%H%M%S_%f")
            self.loop.recorder = EncoderLogWriter(Path(self.cfg.log_dir) / f"reach_{stamp}.mcap",
                                                  self.loop.log_header())
        self._set(ENABLED, "torque on" + ("" if self.target is not None else "; holding until a target arrives"))
        r.ok, r.message = True, "enabled"

    def _move(self, r: _Request) -> None:
        if not self.loop.running or self.state != ENABLED:
            r.message = f"{r.move.name} refused: the arm is {self.state}" + \
                ("" if self.state == PARKING else "; enable first")
            return
        move, goal = r.move, self.loop.step.goal
        if r.joints is not None:                    # joints left out keep their goal
            poses = np.repeat(goal[None], len(move.poses), axis=0)
            poses[:, r.joints] = move.poses
            move.poses = poses
            if move.times[0] > 0:                   # from where the goal is to the first point by its time
                move.poses = np.concatenate((goal[None], move.poses))
                move.times = np.concatenate(([0.0], move.times))
        with self._target_lock:                     # the policy stops; a new target resumes it
            self.target, self._move_serial = None, self.target_serial
        self.loop.move = move
        self._set(ENABLED, f"{move.name}: joint move; a new target resumes the policy")
        r.ok, r.message = True, f"{move.name}: moving"

    def _start_parking(self) -> bool:
        if not self.cfg.park_speed:
            return False
        self.loop.move = JointMove.to(self.robot.park, self.cfg.park_speed, "torque_off", "parking")
        self._park_deadline = time.monotonic() + self.cfg.park_timeout_s
        self._set(PARKING, f"moving to the park pose at {self.cfg.park_speed:g} rad/s, then torque off")
        return True

    def _disable(self, r: _Request) -> None:
        if r.kind == "disable" and self.loop.running and self.state == ENABLED and self._start_parking():
            r.ok, r.message = True, "parking; torque goes off at the park pose"
            return
        was = self.loop.running
        self.loop.shutdown()
        self._close_log()
        if self.state != FAULT:
            self._set(DISABLED, "torque off" + ("" if r.kind == "disable" else f" ({r.kind})"))
        r.ok, r.message = True, "disabled" if was else "already disabled"

    def _estop(self, r: _Request) -> None:
        self.loop.estop()                           # broadcast torque off again, then each servo confirms
        self._close_log()
        sent = r.sent if r.sent is not None else self.bus.torque_off_sent_at    # a dead port: none went out
        self.estop_latency_ms = ((sent or time.perf_counter()) - r.t) * 1e3
        self._set(FAULT, "e-stop: torque off; enable to resume", "warn")
        r.ok, r.message = True, f"e-stop: torque off {self.estop_latency_ms:.1f} ms after the request"

    def _tick(self) -> None:
        move = self.loop.move
        if move is not None and move.then == "hold" and self.target_serial != self._move_serial:
            self.loop.move = None
            self._set(ENABLED, f"torque on; {move.name} ended by a new target, the policy resumes")
        kind = self.loop.tick()
        self._publish(self.loop.reading)
        if kind == TORQUE_OFF:                      # the loop has already turned torque off
            self._close_log()
            why = self.safety.tripped or "safety"
            self._set(FAULT, f"torque off: {why}{self._bus_hint()}", "error")
        elif self.state == PARKING and (self.loop.move.done or time.monotonic() > self._park_deadline):
            how = "parked" if self.loop.move.done else "park pose not reached in time"
            self.loop.shutdown()
            self._close_log()
            self._set(DISABLED, f"{how}; torque off")

    def _read(self) -> None:
        """Disabled: read the joints for joint_states. A second of failed reads is a lost bus
        (an adapter pulled or replugged): a fault until a reconnect, tried every RECONNECT_S,
        finds the servos again, so the first enable after a replug works."""
        now = time.monotonic()
        if not self.connected:
            if now >= self._next_reconnect:
                self._next_reconnect = now + RECONNECT_S
                self._connect(quiet=True)
            return
        try:
            raw = self.bus.sync_read("Present_Position")
        except BusError as e:
            self.read_failures += 1
            self._failed_reads += 1
            if self._failed_reads >= self.rate:
                self.connected, self._next_reconnect = False, now + RECONNECT_S
                if self.state != FAULT:
                    self._set(FAULT, f"the bus is gone ({e}); reconnecting every {RECONNECT_S:g} s", "error")
            return
        self._failed_reads = 0
        self._publish(raw)

    def _publish(self, raw: dict[int, int] | None) -> None:
        if raw is None:
            return
        names, now = self.robot.names, time.perf_counter()
        pos = [calibration.ticks_to_rad(self.cal[n], raw[self.cal[n].id]) for n in names]
        vel = [0.0] * len(pos)
        if self._last_sample is not None and now > self._last_sample[0]:
            then, before = self._last_sample
            vel = [(a - b) / (now - then) for a, b in zip(pos, before)]
        self._last_sample = (now, pos)
        self.on_state(JointSample(names, pos, vel))

    def _fault(self, why: str) -> None:
        self.loop.shutdown()
        self._close_log()
        self._set(FAULT, why, "error")

    def _close_log(self) -> None:
        rec, self.loop.recorder = self.loop.recorder, None
        if rec is not None:
            path = rec.close()
            self._emit("info", f"encoder log: {path}")

    def _bus_hint(self) -> str:
        return " (no encoder readings: is the adapter connected and powered?)" \
            if self.safety.tripped == "watchdog_torque_off" and self.loop.stats.read_failures else ""

    def _set(self, state: str, reason: str, level: str = "info") -> None:
        changed = (state, reason) != (self.state, self.reason)
        self.state, self.reason = state, reason
        if changed:
            self._emit(level, f"{state}: {reason}")

    def _emit(self, level: str, message: str) -> None:
        try:
            self.on_event(level, message)
        except Exception:  # noqa: BLE001 - a front end's logging must not take the bus thread down
            pass


def _internal(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e).strip() else ""
    return f"internal error: {type(e).__name__}{': ' + text if text else ''}"
