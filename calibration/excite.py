"""`soarm excite`: the identification excitation on the arm, through the driver the ROS node runs.

For each arm joint and each base pose (the description's `home`, where gravity loads the
shoulder and elbow, and `park`, folded, where it loads them little) one segment: move to the
pose, a chirp around it whose speed never exceeds `max_speed` (the position amplitude shrinks
as the frequency rises), then ramped steps, the other joints held at the pose. Every segment
stays inside the calibrated range less the safety margin; a joint without room for
`min_amplitude` around a pose is skipped there, and the plan says so. Each segment goes
through `ReachDriver.follow` (its checks, the safety layer's clamps and rate cap), and the
driver records the MCAP encoder log (goals, positions, servo status) that identification fits.

    plan = driver_plan(driver, cfg, joints=None)       # every arm joint; reads no port
    print("\\n".join(plan.describe())); report = excite(driver, plan, cfg)

Ctrl-C parks and turns torque off as `disable` does; a fault ends it with torque off.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from soarm.robot.driver import FAULT, ReachDriver, Trajectory
from soarm.robot.run import start_enabled

POSES = ("home", "park")
POINT_HZ = 50.0              # trajectory points per second (the driver interpolates between them)


@dataclass
class ExcitationCfg:
    max_speed: float = 1.0       # rad/s, the fastest any joint is asked to move
    amplitude: float = 0.35      # rad, the largest excursion from a segment's centre
    min_amplitude: float = 0.08  # rad: a joint with less room than this around a pose is skipped there
    chirp_s: float = 8.0         # s per chirp
    f_start: float = 0.2         # Hz, the chirp's first frequency
    f_end: float = 2.0           # Hz, its last
    dwell_s: float = 1.0         # s at each step level
    transit_speed: float = 0.5   # rad/s, moving to a segment's pose

    def validate(self) -> None:
        if not 0 < self.max_speed <= 2.0:
            raise ValueError(f"max_speed {self.max_speed}: must be in (0, 2] rad/s")
        if not 0 < self.min_amplitude <= self.amplitude <= 1.0:
            raise ValueError(f"need 0 < min_amplitude ({self.min_amplitude}) <= amplitude ({self.amplitude}) <= 1 rad")
        if not 0 < self.f_start < self.f_end <= 10.0:
            raise ValueError(f"need 0 < f_start ({self.f_start}) < f_end ({self.f_end}) <= 10 Hz")
        for name in ("chirp_s", "dwell_s", "transit_speed"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive")


@dataclass
class Segment:
    joint: str
    pose: str
    centre: float                # rad
    amplitude: float             # rad, the largest excursion
    times: np.ndarray            # [K] s from the segment's start
    positions: np.ndarray        # [K, arm joints] rad

    @property
    def duration(self) -> float:
        return float(self.times[-1])

    def peak_speed(self) -> float:
        return float((np.abs(np.diff(self.positions, axis=0)) / np.diff(self.times)[:, None]).max())


@dataclass
class Plan:
    arm_joints: list[str]
    segments: list[Segment] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)        # one line each: what was left out and why

    def describe(self) -> list[str]:
        lines = [f"  {s.joint:14s} at {s.pose:5s}: centre {s.centre:+.3f} rad, up to ±{s.amplitude:.3f} rad, "
                 f"peak {s.peak_speed():.2f} rad/s, {s.duration:.1f} s" for s in self.segments]
        lines += [f"  skipped: {why}" for why in self.skipped]
        total = sum(s.duration for s in self.segments)
        return [f"excitation plan: {len(self.segments)} segments, {total:.0f} s", *lines]


def make_plan(lower: np.ndarray, upper: np.ndarray, poses: dict[str, np.ndarray], arm_joints: list[str],
              cfg: ExcitationCfg, joints: list[str] | None = None) -> Plan:
    """The segments for `joints` (default: every arm joint) within [lower, upper] (rad, the
    calibrated limits less the margin), from the named base poses."""
    cfg.validate()
    unknown = [j for j in joints or [] if j not in arm_joints]
    if unknown:
        raise ValueError(f"unknown joint {unknown[0]!r}; arm joints: {', '.join(arm_joints)}")
    plan = Plan(list(arm_joints))
    for name in joints or arm_joints:
        j = arm_joints.index(name)
        half = (upper[j] - lower[j]) / 2
        if half < cfg.min_amplitude:
            plan.skipped.append(f"{name}: its calibrated range less the margin ({2 * half:.3f} rad) is narrower "
                                f"than the excitation needs (2 x {cfg.min_amplitude:.3f} rad)")
            continue
        for pose_name, pose in poses.items():
            base = np.clip(pose, lower, upper)
            amp = min(cfg.amplitude, half)
            centre = float(np.clip(base[j], lower[j] + amp, upper[j] - amp))
            base[j] = centre
            plan.segments.append(_segment(name, pose_name, j, base, amp, cfg))
    return plan


def _segment(name: str, pose_name: str, j: int, base: np.ndarray, amp: float, cfg: ExcitationCfg) -> Segment:
    """A chirp then ramped steps around base[j]; the first point is the pose itself."""
    dt = 1.0 / POINT_HZ
    # Chirp: instantaneous frequency f(t) rises linearly; the amplitude is capped where
    # 2 pi f A would pass the speed limit (10 % kept for the amplitude's own change).
    t = np.arange(0.0, cfg.chirp_s + dt / 2, dt)
    f = cfg.f_start + (cfg.f_end - cfg.f_start) * t / cfg.chirp_s
    phase = 2 * math.pi * (cfg.f_start * t + (cfg.f_end - cfg.f_start) * t ** 2 / (2 * cfg.chirp_s))
    a = np.minimum(amp, 0.9 * cfg.max_speed / (2 * math.pi * f))
    chirp = a * np.sin(phase)
    # Steps: to +A/2, -A/2, +A, 0, each reached by a ramp at max_speed and held for dwell_s.
    levels, steps, here = (0.5 * amp, -0.5 * amp, amp, 0.0), [], chirp[-1]
    for level in levels:
        ramp = np.linspace(here, level, max(2, math.ceil(abs(level - here) / (cfg.max_speed * dt)) + 1))[1:]
        steps += [*ramp, *[level] * round(cfg.dwell_s * POINT_HZ)]
        here = level
    offsets = np.concatenate([chirp, np.asarray(steps)])
    positions = np.repeat(base[None, :], len(offsets), axis=0)
    positions[:, j] = base[j] + offsets
    return Segment(name, pose_name, float(base[j]), amp, np.arange(len(offsets)) * dt, positions)


@dataclass
class ExciteReport:
    done: list[str] = field(default_factory=list)            # "joint at pose" per finished segment
    fault: str = ""
    logs: list[Path] = field(default_factory=list)           # the encoder logs written

    def summary(self, plan: Plan) -> str:
        text = f"{len(self.done)}/{len(plan.segments)} segments recorded"
        if plan.skipped:
            text += f" ({len(plan.skipped)} skipped)"
        return text + (f"; stopped: {self.fault}" if self.fault else "; parked, torque off")


def excite_arm(port: str, calibration: Path, policy: Path, cfg: ExcitationCfg, joints: list[str] | None,
               log_dir: Path, dry_run: bool = False, out: Callable[[str], None] = print) -> ExciteReport:
    """`soarm excite`: print the plan, then (unless a dry run) run it on the arm at `port`."""
    from soarm.robot.driver import DriverCfg

    driver = ReachDriver(DriverCfg(port=port, policy=str(policy), calibration=str(calibration), log_dir=str(log_dir)),
                         on_event=lambda level, msg: out(f"{level}: {msg}"))
    plan = driver_plan(driver, cfg, joints)
    out("\n".join(plan.describe()))
    if dry_run:
        out("soarm excite: dry run, nothing moved")
        return ExciteReport()
    before = set(Path(log_dir).glob("*.mcap"))
    report = excite(driver, plan, cfg, out)
    report.logs = sorted(set(Path(log_dir).glob("*.mcap")) - before)
    out(f"soarm excite: {report.summary(plan)}" + (f"; log {report.logs[-1]}" if report.logs else ""))
    return report


def driver_plan(driver: ReachDriver, cfg: ExcitationCfg, joints: list[str] | None = None) -> Plan:
    """The plan for this arm: its calibrated limits less the margin, its home and park poses."""
    robot = driver.robot
    poses = {name: np.asarray(getattr(robot, name), dtype=np.float64) for name in POSES}
    return make_plan(driver.safety.lower.astype(np.float64), driver.safety.upper.astype(np.float64), poses,
                     list(driver.runtime.contract.joint_names), cfg, joints)


def excite(driver: ReachDriver, plan: Plan, cfg: ExcitationCfg, out: Callable[[str], None] = print) -> ExciteReport:
    """Run the plan on the arm (connects and enables first; BusError if it cannot). The
    driver is closed at the end: it parks, then turns torque off."""
    report = ExciteReport()
    try:
        start_enabled(driver)
        for k, seg in enumerate(plan.segments):
            out(f"segment {k + 1}/{len(plan.segments)}: {seg.joint} at {seg.pose} ({seg.duration:.0f} s)")
            if not _run_segment(driver, plan, seg, cfg, report):
                break
            report.done.append(f"{seg.joint} at {seg.pose}")
    except KeyboardInterrupt:
        report.fault = "interrupted (Ctrl-C); parked, torque off"
    finally:
        driver.close()
    return report


def _run_segment(driver: ReachDriver, plan: Plan, seg: Segment, cfg: ExcitationCfg, report: ExciteReport) -> bool:
    """Transit to the segment's pose at transit_speed, then its points on their times."""
    goal = driver.loop.step.goal.astype(np.float64)
    transit = float(np.abs(seg.positions[0] - goal).max()) / cfg.transit_speed + 0.5     # + time to settle
    times = [transit, *(transit + seg.times[1:])]
    ok, msg = driver.follow(Trajectory(plan.arm_joints, seg.positions.tolist(), times))
    if not ok:
        report.fault = msg
        return False
    pace = threading.Event()                     # never set: a wait that Ctrl-C interrupts
    t_end = time.monotonic() + times[-1] + 10.0
    while True:
        pace.wait(0.1)
        if driver.state == FAULT:
            report.fault = driver.reason
            return False
        move = driver.diagnostics()["move"]
        if move is not None and move["name"] == "trajectory" and move["done"]:
            return True
        if time.monotonic() > t_end:
            report.fault = f"{seg.joint} at {seg.pose}: the arm did not reach the end of the segment in time"
            return False
