"""LeRobot-format calibration: the file, the ticks <-> radians mapping, and the procedure run
against the emulated arm through the real SDK."""

import json

import pytest

from soarm.calibration.calibration import (MotorCalibration, check_home, check_servos, load,
                                           rad_to_ticks, save, ticks_to_rad)
from soarm.config import ConfigError
from tests.helpers import calibrated_arm
from tests.reference.lerobot_calibration import LEROBOT_SO101 as LEROBOT


def test_lerobot_file_loads_and_saves_unchanged(tmp_path):
    src = tmp_path / "so101.json"
    src.write_text(json.dumps(LEROBOT))
    cal = load(src, motors=list(LEROBOT))
    assert cal["elbow_flex"] == MotorCalibration(3, 0, 1368, 869, 3059)
    save(cal, tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text()) == LEROBOT


@pytest.mark.parametrize("drive_mode", [0, 1])
def test_mapping_both_ways_and_degrees_ignore_drive_mode(drive_mode):
    """LeRobot 0.6.1's MotorsBus._normalize: DEGREES does not flip with drive_mode (only the
    range modes do, the gripper's); our radians are its degrees."""
    cal = MotorCalibration(1, drive_mode, 0, 900, 3100)
    assert ticks_to_rad(cal, 2000) == 0.0                     # the middle of the calibrated range
    for ticks in (0, 100, 2047, 3000, 4095):
        assert rad_to_ticks(cal, ticks_to_rad(cal, ticks)) == ticks
    for rad in (-1.5, -0.01, 0.0, 0.7):
        assert abs(ticks_to_rad(cal, rad_to_ticks(cal, rad)) - rad) <= 3.1416 / 4095
    assert ticks_to_rad(cal, 2100) > 0


def lerobot_degrees(entry: dict, ticks: int) -> float:
    """lerobot 0.6.1 (and 0.4.x), MotorsBus._normalize, MotorNormMode.DEGREES, STS3215
    (resolution 4096), as written there; lerobot 0.6 needs Python 3.12 and 0.4 pulls in
    accelerate and more even with --no-deps, so its formula stands here, not its import."""
    mid = (entry["range_min"] + entry["range_max"]) / 2
    max_res = 4096 - 1
    return (ticks - mid) * 360 / max_res


def test_mapping_is_lerobots_degrees_convention(tmp_path):
    import math

    src = tmp_path / "so101.json"
    src.write_text(json.dumps(LEROBOT))
    cal = load(src)
    for name, entry in LEROBOT.items():
        for ticks in (entry["range_min"], 1000, 2047, 2048, 3000, entry["range_max"]):
            assert math.degrees(ticks_to_rad(cal[name], ticks)) == pytest.approx(lerobot_degrees(entry, ticks), abs=1e-9)
    # The pose that reads 2047 after homing is not the joint's zero unless the range is centred on it.
    assert math.degrees(ticks_to_rad(cal["elbow_flex"], 2047)) == pytest.approx(lerobot_degrees(LEROBOT["elbow_flex"], 2047))
    assert abs(ticks_to_rad(cal["elbow_flex"], 2047)) > 0.05


def test_robot_zero_is_the_published_models_zero(robot):
    """Under the mid-range convention a joint's zero is the middle of its swept stops. Ours is
    the same physical pose as TheRobotStudio's so101_new_calib model's: the same limits, and the
    arm joints' limits are symmetric about zero in both (the wrist roll is a full-turn joint,
    recorded 0..4095, whose zero is the homing pose in both)."""
    import mujoco

    from soarm.mujoco_arm import load_model

    model = load_model()

    for j in robot.joints:
        jid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, j.name)
        assert jid >= 0, j.name
        lo, hi = model.jnt_range[jid]
        assert (lo, hi) == pytest.approx((j.lower, j.upper), abs=1e-5), j.name
    for name in ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex"):
        j = robot.joints[robot.index(name)]
        assert j.lower == pytest.approx(-j.upper), name


def test_a_range_without_the_home_pose_is_refused_naming_the_joint(tmp_path, robot):
    src = tmp_path / "so101.json"
    src.write_text(json.dumps(LEROBOT))
    cal = load(src)
    check_home(cal, robot)                                          # a real arm's file passes
    shifted = dict(cal, wrist_flex=MotorCalibration(4, 0, -1470, 859, 1500))   # home 0.9 rad lies beyond
    with pytest.raises(ConfigError) as e:
        check_home(shifted, robot)
    msg = str(e.value)
    assert "'wrist_flex'" in msg and "859..1500" in msg and "+0.900" in msg and "\n" not in msg


def test_a_range_swept_across_the_encoders_wrap_is_refused(tmp_path, robot):
    """LeRobot once wrote shoulder_lift 13..4094 for an emulated arm homed off its middle: the
    range holds the home angle, but spans 359 deg of a joint that travels 200."""
    src = tmp_path / "so101.json"
    src.write_text(json.dumps(dict(LEROBOT, shoulder_lift=dict(LEROBOT["shoulder_lift"], range_min=13,
                                                               range_max=4094))))
    with pytest.raises(ConfigError) as e:
        check_home(load(src), robot)
    msg = str(e.value)
    assert "'shoulder_lift'" in msg and "13..4094" in msg and "wrap" in msg and "\n" not in msg


@pytest.mark.parametrize("text, words", [
    ("{not json", "malformed calibration JSON"),
    ('{"shoulder_pan": {"id": 1}}', "must have exactly"),
    ('{"shoulder_pan": {"id": 1, "drive_mode": 2, "homing_offset": 0, "range_min": 0, "range_max": 9}}',
     "drive_mode"),
    ('{"shoulder_pan": {"id": 1, "drive_mode": 0, "homing_offset": 0, "range_min": 900, "range_max": 9}}',
     "'shoulder_pan': range_min 900, range_max 9: need 0 <= range_min < range_max"),
    ('{"elbow_flex": {"id": 3, "drive_mode": 0, "homing_offset": 0, "range_min": 2000, "range_max": 2000}}',
     "'elbow_flex': range_min 2000, range_max 2000"),
    ('{"shoulder_pan": {"id": 1, "drive_mode": 0, "homing_offset": 0, "range_min": 0, "range_max": "9"}}',
     "integers"),
])
def test_malformed_calibration_is_one_line(tmp_path, text, words):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(p)
    assert words in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.bus
def test_procedure_against_the_emulated_arm(robot):
    ids = {n: i + 1 for i, n in enumerate(robot.names)}
    with calibrated_arm(robot, seed=5) as (emu, bus, cal):
        lo, hi = robot.lower, robot.upper
        # The mapping gives back the true angles.
        q_true = [0.3, 0.5, -0.4, 0.8, -1.0, 0.2]
        emu.place(q_true)
        pos = bus.sync_read("Present_Position", tries=3)
        for n in robot.arm_joints:                             # the gripper is held in ticks, never mapped
            sid = ids[n]
            assert abs(ticks_to_rad(cal[n], pos[sid]) - q_true[sid - 1]) <= 1.5 * 2 * 3.1416 / 4096, n
        assert cal["wrist_roll"].range_min == 0 and cal["wrist_roll"].range_max == 4095
        lift = cal["shoulder_lift"]
        assert abs(ticks_to_rad(lift, lift.range_min) - lo[1]) < 0.01
        assert abs(ticks_to_rad(lift, lift.range_max) - hi[1]) < 0.01
        check_servos(bus, cal)                                   # EEPROM holds what the file says
        bad = dict(cal, elbow_flex=MotorCalibration(3, 0, cal["elbow_flex"].homing_offset + 5, 0, 4095))
        with pytest.raises(ConfigError, match=r"servo 3 \(elbow_flex\) holds"):
            check_servos(bus, bad)


def test_cli_calibrate_without_a_port_is_one_line(tmp_path, capsys):
    from soarm import cli

    assert cli.main(["calibrate", "--port", str(tmp_path / "ttyACM7"), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no such serial port" in err and err.count("\n") == 0 and not (tmp_path / "c.json").exists()


@pytest.mark.bus
def test_soarm_calibrate_end_to_end_with_the_emulated_operator(tmp_path, robot):
    """`soarm emulate --operator` puts a simulated person at the arm: `soarm calibrate` runs
    as on the bench (two Enters), and the file it writes spans each joint's travel."""
    import subprocess
    import sys
    import time

    from soarm.robot.emulator_process import EmulatorProcess

    link = tmp_path / "so101"
    emu = EmulatorProcess(tmp_path / "first.json", seed=2, args=("--no-compile", "--link", str(link), "--operator"))
    proc = None

    def wait_for(line: str, timeout: float = 60.0) -> None:
        t_end = time.monotonic() + timeout
        while not any(line in o for o in emu.output):
            assert time.monotonic() < t_end and proc.poll() is None, (line, emu.output[-5:])
            time.sleep(0.05)
    try:
        out = tmp_path / "cal.json"
        proc = subprocess.Popen([sys.executable, "-m", "soarm.cli", "calibrate", "--port", str(link), "--out", str(out)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for("operator: holding the arm in the middle pose")
        proc.stdin.write("\n")                                     # "the arm is in the middle"
        proc.stdin.flush()
        wait_for("operator: sweep done")
        proc.stdin.write("\n")                                     # "done sweeping"
        proc.stdin.flush()
        text, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, text
        cal = load(out)
        for n in ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex"):
            j = robot.index(n)
            lo, hi = ticks_to_rad(cal[n], cal[n].range_min), ticks_to_rad(cal[n], cal[n].range_max)
            assert abs(lo - robot.lower[j]) < 0.03 and abs(hi - robot.upper[j]) < 0.03, (n, lo, hi)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        emu.stop()
