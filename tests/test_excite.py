"""`soarm excite`: the plan stays inside the calibrated range at the speed asked, says what it
leaves out, and runs through the driver on the emulated arm into an encoder log."""

import json

import numpy as np
import pytest

from soarm import REPO_ROOT
from soarm.calibration.excite import ExcitationCfg, make_plan

ARM = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll"]
LOWER = np.array([-1.8, -1.6, -1.6, -1.5, -2.8])
UPPER = np.array([1.8, 1.6, 1.6, 1.5, 2.8])
POSES = {"home": np.array([0.0, -0.6, 0.6, 0.9, 0.0]), "park": np.array([0.0, -1.59, 1.3, 0.7, 0.0])}


def test_every_segment_stays_in_range_at_the_speed_asked_with_the_other_joints_held():
    cfg = ExcitationCfg(max_speed=0.8)
    plan = make_plan(LOWER, UPPER, POSES, ARM, cfg)
    assert len(plan.segments) == 2 * len(ARM) and not plan.skipped
    for seg in plan.segments:
        j = ARM.index(seg.joint)
        assert (seg.positions >= LOWER - 1e-9).all() and (seg.positions <= UPPER + 1e-9).all()
        assert seg.peak_speed() <= cfg.max_speed
        others = np.delete(seg.positions, j, axis=1)
        assert np.ptp(others, axis=0).max() == 0                      # held
        assert np.ptp(seg.positions[:, j]) >= 1.5 * seg.amplitude   # the joint does move
        assert seg.positions[0, j] == seg.positions[-1, j] == seg.centre
    lift_park = next(s for s in plan.segments if s.joint == "shoulder_lift" and s.pose == "park")
    assert lift_park.centre == pytest.approx(LOWER[1] + cfg.amplitude)        # moved off the stop, inward


def test_a_joint_without_room_is_skipped_and_said_so():
    lower, upper = LOWER.copy(), UPPER.copy()
    lower[2], upper[2] = 0.55, 0.65
    plan = make_plan(lower, upper, POSES, ARM, ExcitationCfg())
    assert not [s for s in plan.segments if s.joint == "elbow_flex"]
    assert plan.skipped == ["elbow_flex: its calibrated range less the margin (0.100 rad) is narrower than the "
                            "excitation needs (2 x 0.080 rad)"]
    assert "skipped: elbow_flex" in "\n".join(plan.describe())


@pytest.mark.parametrize("cfg, joints, words", [
    (ExcitationCfg(), ["elbow"], "unknown joint 'elbow'"),
    (ExcitationCfg(max_speed=5.0), None, "max_speed 5.0: must be in (0, 2] rad/s"),
    (ExcitationCfg(f_start=3.0, f_end=2.0), None, "need 0 < f_start (3.0) < f_end (2.0)"),
])
def test_bad_plan_requests_are_one_line(cfg, joints, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make_plan(LOWER, UPPER, POSES, ARM, cfg, joints)


def test_dry_run_opens_no_port(tmp_path, capsys):
    from soarm.cli import main
    from tests.reference.lerobot_calibration import LEROBOT_SO101

    cal = tmp_path / "arm.json"
    cal.write_text(json.dumps(LEROBOT_SO101))
    assert main(["excite", "--port", str(tmp_path / "no_adapter"), "--calibration", str(cal), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "excitation plan: 10 segments" in out and "dry run, nothing moved" in out


@pytest.mark.bus
def test_excitation_runs_through_the_driver_into_an_encoder_log(tmp_path):
    from soarm import logs
    from soarm.robot.bus import FeetechBus
    from soarm.robot.driver import DriverCfg, ReachDriver
    from soarm.robot.emulator_process import EmulatorProcess
    from soarm.calibration.excite import driver_plan, excite

    cfg = ExcitationCfg(chirp_s=2.0, dwell_s=0.5)
    with EmulatorProcess(tmp_path / "cal.json", seed=3, args=("--no-compile",)) as emu:
        driver = ReachDriver(DriverCfg(port=emu.port, policy=str(REPO_ROOT / "data" / "policies" / "reach.onnx"), calibration=str(emu.calibration),
                                       log_dir=str(tmp_path / "logs")))
        plan = driver_plan(driver, cfg, ["elbow_flex"])
        report = excite(driver, plan, cfg, out=lambda line: None)
        assert report.done == ["elbow_flex at home", "elbow_flex at park"] and not report.fault
        bus = FeetechBus(emu.port, {"shoulder_pan": 1, "shoulder_lift": 2, "elbow_flex": 3, "wrist_flex": 4,
                                    "wrist_roll": 5, "gripper": 6})
        bus.connect()
        assert all(bus.read("Torque_Enable", sid) == 0 for sid in range(1, 7))      # ends torque off
        bus.close()
    (log,) = (tmp_path / "logs").glob("*.mcap")
    _, ticks = logs.read_log(log)
    moving = [t for t in ticks if t.move and t.move["name"] == "trajectory" and t.q and t.goal_sent]
    q = np.array([t.q for t in moving])
    goal = np.array([t.goal_sent for t in moving])
    elbow = ARM.index("elbow_flex")
    assert np.ptp(goal[:, elbow]) > 2 * cfg.min_amplitude
    # The servo followed its goals: a reading lags its goal by the bus, the latency and the
    # servo's rise time (longer when the emulator's physics runs late on a busy machine), so
    # the goals are compared at the lag that fits best, up to 8 ticks.
    q, goal = q[:, elbow], goal[:, elbow]
    error = min(np.sqrt(((q[lag:] - goal[:len(goal) - lag]) ** 2).mean()) for lag in range(9))
    assert error < 0.2 * np.std(goal), (error, np.std(goal))
    assert any(t.status for t in ticks)                         # load, voltage, temperature recorded
