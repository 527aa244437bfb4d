"""`soarm replay`: an encoder log's readings through the same decision step the loop runs
(observation, inference, safety; robot/loop.py's PolicyStep), compared with the goals that
were really sent.

    soarm replay LOG.mcap --policy policy.onnx [--plot replay.png]

Also takes the real servo logs of data/real_servo_logs (BAM's STS3250 pendulum) as encoder
logs: one real servo's stream on the elbow, the other joints held at their middle.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from soarm.calibration.calibration import RAD_PER_TICK, MotorCalibration, rad_to_ticks, ticks_to_rad
from soarm.description import load_robot
from soarm.export.runtime import PolicyRuntime
from soarm.logs import LogError, TickRecord, read_bam, read_log
from soarm.robot.loop import PolicyStep
from soarm.robot.safety import SafetyCfg, SafetyLayer

TOLERANCE = 1e-5          # rad: recomputed and recorded goals agree below this


def replay_decisions(header: dict, ticks: list[TickRecord], runtime: PolicyRuntime, where: str = "log") -> dict:
    """Each tick's decision made again from its reading, against the goal that was sent."""
    robot = load_robot()
    arm = header["arm_joints"]
    if arm != list(runtime.contract.joint_names):
        raise LogError(where, f"logged joints {arm} differ from the policy's {list(runtime.contract.joint_names)}")
    cal = {n: MotorCalibration(**c) for n, c in header["calibration"].items()}
    safety = SafetyLayer.for_arm(SafetyCfg(**header.get("safety", {})), robot, cal)
    step = PolicyStep(runtime, safety, header["rate_hz"], np.asarray(header["start_q"], dtype=np.float32))
    t, recorded, recomputed, diffs = [], [], [], []
    events_differing, events = 0, {}
    for tick in ticks:
        raw = tick.raw
        q = None if raw is None else np.array([ticks_to_rad(cal[n], raw[str(cal[n].id)]) for n in arm],
                                              dtype=np.float32)
        target, move = tick.target, tick.move
        if move:                                   # a joint move (parking, home, trajectory): no policy
            r = step.toward(q, np.asarray(move["pose"], dtype=np.float32), move["max_step"], now=tick.t)
        else:
            r = step(q, None if target is None else np.asarray(target, dtype=np.float32), now=tick.t)
        a, b = tick.goal_sent, r.decision.goal
        events_differing += int(tick.events != r.decision.events)
        for e in r.decision.events:
            events[e] = events.get(e, 0) + 1
        t.append(tick.t)
        recorded.append(np.full(len(arm), np.nan) if a is None else np.asarray(a))
        recomputed.append(np.full(len(arm), np.nan) if b is None else np.asarray(b))
        if (a is None) != (b is None):
            diffs.append(math.inf)
        else:
            diffs.append(0.0 if a is None else float(np.abs(np.asarray(a) - b).max()))
    d = np.asarray(diffs)
    differ = np.flatnonzero(d > TOLERANCE)
    return {
        "ticks": len(ticks), "max_abs_diff_rad": float(d[np.isfinite(d)].max()) if np.isfinite(d).any() else 0.0,
        "ticks_differing": int(len(differ)),
        "events": events, "events_differing": events_differing,
        "first_difference_tick": int(differ[0]) if len(differ) else None,
        "tolerance_rad": TOLERANCE, "source": header.get("source"),
        "_series": (np.asarray(t), np.asarray(recorded), np.asarray(recomputed), d, arm),
    }


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, rec, new, d, arm = report["_series"]
    fig, axes = plt.subplots(len(arm) + 1, 1, figsize=(10, 2 * (len(arm) + 1)), sharex=True)
    for j, name in enumerate(arm):
        axes[j].plot(t, rec[:, j], label="recorded goal", lw=1.5)
        axes[j].plot(t, new[:, j], "--", label="recomputed goal", lw=1.2)
        axes[j].set_ylabel(f"{name}\n(rad)", fontsize=8)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].semilogy(t, np.clip(np.where(np.isfinite(d), d, 1.0), 1e-9, None))
    axes[-1].axhline(TOLERANCE, color="r", lw=0.8)
    axes[-1].set_ylabel("|diff| (rad)", fontsize=8)
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(f"replay: {report['ticks_differing']} of {report['ticks']} ticks differ "
                 f"(max {report['max_abs_diff_rad']:.2e} rad)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def import_bam(path: str | Path, joint: str = "elbow_flex") -> tuple[dict, list[TickRecord]]:
    """A BAM bench log (data/real_servo_logs) as an encoder log: its servo on `joint` (its
    goals as the goals sent), the other arm joints at their middle; a calibration of LeRobot's zero at the encoder's middle."""
    log = read_bam(path)
    robot = load_robot()
    arm = list(robot.arm_joints)
    if joint not in arm:
        raise LogError(path, f"joint {joint!r} is not an arm joint")
    j = arm.index(joint)
    # Each joint's travel and 0.15 rad more, about the encoder's middle (as a full-turn range
    # 0..4095 would be, which check_home refuses for a joint that cannot turn that far).
    half = {jt.name: min(2047, math.ceil(((jt.upper - jt.lower) / 2 + 0.15) / RAD_PER_TICK)) for jt in robot.joints}
    cal = {n: {"id": i + 1, "drive_mode": 0, "homing_offset": 0, "range_min": 2047 - half[n],
               "range_max": 2048 + half[n]} for i, n in enumerate(robot.names)}
    ticks = []
    for t, pos, goal in zip(log.t, log.measured[:, 0], log.goal[:, 0]):
        q, g = [0.0] * len(arm), [0.0] * len(arm)
        q[j], g[j] = float(pos), float(goal)
        raw = {str(cal[n]["id"]): rad_to_ticks(MotorCalibration(**cal[n]), q[k]) for k, n in enumerate(arm)}
        ticks.append(TickRecord(t=float(t), raw=raw, q=q, target=[0.25, 0.0, 0.15], goal_sent=g))
    header = {"source": f"bam-import:{Path(path).name}", "arm_joints": arm, "gripper": robot.gripper_joint,
              "rate_hz": log.rate_hz, "calibration": cal, "start_q": [0.0] * len(arm)}
    return header, ticks


def load_any(path: str | Path) -> tuple[dict, list[TickRecord]]:
    """An encoder log (.mcap) or a BAM servo log (.json)."""
    return import_bam(path) if str(path).endswith(".json") else read_log(path)
