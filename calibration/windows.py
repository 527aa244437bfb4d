"""Logged motion laid on a plant's physics grid: what identification fits and `soarm arm-check`
replays.

A window is a stretch of one log's commanded motion. On the grid of physics steps `dt`, each
joint's goal is the one in force at every step (a goal reaches its servo `goal_delay` after
its tick), and each logged reading falls on the step nearest the moment that joint was read
(`read_delay` after its tick): a bus that reads the servos one at a time spreads a row over
the tick, and a plant read as if the row were one instant is compared with the arm a few
milliseconds off.

    w = cut_windows(logs, robot, window_s=10.0, min_motion_s=2.0, dt=task.physics_dt)   # sysid
    w = whole_logs(logs, robot, dt)                                                     # arm-check
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from soarm.description import RobotDescription
from soarm.logs import LogError, MotionLog
from soarm.servo import TICK, ServoConfig

POSES = ("home", "park")            # the base poses windows are sorted by (the excitation's)


@dataclass
class Windows:
    """Logged motion on the physics grid, padded to one length; S windows, A arm joints."""
    q0: torch.Tensor              # [S, A] rad, measured at each window's start
    qd0: torch.Tensor             # [S, A] rad/s, estimated there
    goals: torch.Tensor           # [S, G, A] rad, the goal in force at each physics step
    at: torch.Tensor              # [S, K, A] long: the physics step each joint's logged reading was taken at
    measured: torch.Tensor        # [S, K, A] rad
    valid: torch.Tensor           # [S, K] bool (padding: False)
    pose: list[str]               # the base pose nearest each window
    source: list[str]             # "file:t0-t1 s" per window
    log: list[str]                # the log each window comes from
    dt: float                     # s per physics step

    def take(self, idx: list[int]) -> Windows:
        i = torch.tensor(idx, dtype=torch.long)
        pick = lambda xs: [xs[k] for k in idx]   # noqa: E731
        return Windows(self.q0[i], self.qd0[i], self.goals[i], self.at[i], self.measured[i], self.valid[i],
                       pick(self.pose), pick(self.source), pick(self.log), self.dt)


@dataclass
class Piece:
    """One window of one log before packing: t from its start."""
    log: MotionLog
    lo: int                       # its rows of the log, [lo, hi)
    hi: int
    pose: str

    @property
    def t(self) -> np.ndarray:
        return self.log.t[self.lo:self.hi] - self.log.t[self.lo]

    @property
    def source(self) -> str:
        return f"{Path(self.log.source).name}:{self.log.t[self.lo]:.1f}-{self.log.t[self.hi - 1]:.1f} s"


def cut_windows(logs: list[MotionLog], robot: RobotDescription, window_s: float, min_motion_s: float,
                dt: float, per_log: int = 0) -> Windows:
    """Every log's commanded motion as windows of about `window_s` (`per_log` > 0: that many of
    each log's, evenly spread); LogError naming the file for a log of other joints, too short,
    holding no motion or with torque off throughout."""
    pieces = []
    for log in logs:
        first = len(pieces)
        _check_joints(log, robot)
        t = log.t
        on = log.torque & np.isfinite(log.measured).all(axis=1)
        if not on.any():
            raise LogError(log.source, "torque is off throughout (no goal was sent); nothing to identify")
        runs = _runs(on)
        motion = sum(t[b - 1] - t[a] for a, b in runs)
        if motion < min_motion_s:
            raise LogError(log.source, f"too short: {motion:.1f} s of commanded motion, sysid needs "
                                       f"{min_motion_s:.0f} s")
        if np.ptp(log.measured[on], axis=0).max() < 5 * TICK:
            raise LogError(log.source, "no motion: no joint moved more than 5 encoder ticks")
        for a, b in runs:
            for lo, hi in _cut(t[a:b], log.measured[a:b], window_s):
                lo, hi = a + lo, a + hi
                if t[hi - 1] - t[lo] < 1.0 or np.ptp(log.goal[lo:hi], axis=0).max() < 2 * TICK:
                    continue                                     # a hold: nothing moved here
                pieces.append(Piece(log, lo, hi, _nearest_pose(log.measured[lo:hi], robot)))
        if 0 < per_log < len(pieces) - first:
            keep = np.linspace(first, len(pieces) - 1, per_log).round().astype(int)
            pieces[first:] = [pieces[k] for k in keep]
    if not pieces:
        raise LogError(logs[0].source, "no window of commanded motion longer than 1 s")
    return _pack(pieces, dt)


def whole_logs(logs: list[MotionLog], robot: RobotDescription, dt: float) -> Windows:
    """Each log as one window, from its first row to its last (torque on throughout)."""
    for log in logs:
        _check_joints(log, robot)
        if not (log.torque.all() and np.isfinite(log.measured).all()):
            raise LogError(log.source, "torque off or a failed read somewhere: replay its stretches of motion instead")
    return _pack([Piece(log, 0, len(log.t), _nearest_pose(log.measured, robot)) for log in logs], dt)


def as_recorded(servo: ServoConfig, logs: list[MotionLog]) -> ServoConfig:
    """The servo model with the registers the logs were recorded with (a log's rig may say,
    e.g. SAGE's: no profile ramp); one set for every log of a fit."""
    written = [log.rig.get("registers") for log in logs]
    if any(w != written[0] for w in written):
        odd = next(log for log, w in zip(logs, written) if w != written[0])
        raise LogError(odd.source, f"recorded with servo registers {odd.rig.get('registers')}, "
                                   f"{logs[0].source} with {written[0]}: fit them apart")
    if not written[0]:
        return servo
    return dataclasses.replace(servo, registers=dataclasses.replace(servo.registers, **written[0]))


def _check_joints(log: MotionLog, robot: RobotDescription) -> None:
    if log.joints != list(robot.arm_joints):
        raise LogError(log.source, f"logged joints {log.joints} are not this robot's arm joints "
                                   f"{list(robot.arm_joints)}")


def _nearest_pose(q: np.ndarray, robot: RobotDescription) -> str:
    median = np.median(q, axis=0)
    return min(POSES, key=lambda p: float(np.abs(np.asarray(getattr(robot, p)) - median).sum()))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _cut(t: np.ndarray, q: np.ndarray, window_s: float) -> list[tuple[int, int]]:
    """Cut one run into windows of about window_s, each boundary at the stillest tick within
    a quarter window of where it would fall (a window starts nearly at rest)."""
    speed = np.r_[0.0, np.abs(np.diff(q, axis=0)).max(axis=1) / np.diff(t)]
    cuts, start = [0], 0
    while t[-1] - t[start] > 1.5 * window_s:
        near = np.flatnonzero(np.abs(t - (t[start] + window_s)) <= window_s / 4)
        cut = int(near[np.argmin(speed[near])])
        cuts.append(cut)
        start = cut
    return list(zip(cuts, cuts[1:] + [len(t)]))


def _pack(pieces: list[Piece], dt: float) -> Windows:
    """The pieces on the physics grid: each joint's goal in force at every step, each joint's
    reading at the step nearest the moment it was read."""
    delays = [p.log.delays() for p in pieces]
    G = max(int(math.ceil((p.t[-1] + read.max()) / dt)) + 1 for p, (_, read) in zip(pieces, delays))
    K = max(p.hi - p.lo for p in pieces)
    S, A = len(pieces), len(pieces[0].log.joints)
    goals, at = np.zeros((S, G, A)), np.zeros((S, K, A), dtype=np.int64)
    measured, valid = np.zeros((S, K, A)), np.zeros((S, K), dtype=bool)
    q0, qd0 = np.zeros((S, A)), np.zeros((S, A))
    grid = np.arange(G) * dt
    for s, (p, (goal_delay, read_delay)) in enumerate(zip(pieces, delays)):
        t, n = p.t, p.hi - p.lo
        q, goal = p.log.measured[p.lo:p.hi], p.log.goal[p.lo:p.hi]
        for j in range(A):
            k = np.clip(np.searchsorted(t + goal_delay[j], grid + 1e-9, side="right") - 1, 0, None)   # in force
            goals[s, :, j] = goal[k, j]
            at[s, :n, j] = np.minimum(np.round((t + read_delay[j]) / dt).astype(np.int64), G - 1)
        measured[s, :n], valid[s, :n] = q, True
        q0[s] = q[0]
        m = min(2, n - 1)
        qd0[s] = (q[m] - q[0]) / max(t[m], 1e-6)
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return Windows(f(q0), f(qd0), f(goals), torch.tensor(at), f(measured), torch.tensor(valid),
                   [p.pose for p in pieces], [p.source for p in pieces], [Path(p.log.source).name for p in pieces], dt)
