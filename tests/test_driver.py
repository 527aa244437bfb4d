"""The arm as a service (robot/driver.py) without ROS: requests from other threads, and a
failure anywhere ending in torque off with the bus thread still serving."""

import time

import numpy as np
import pytest

from soarm.calibration import calibration
from soarm.robot.driver import DISABLED, ENABLED, FAULT, PARKING, DriverCfg, ReachDriver, Trajectory
from soarm.robot.emulator import FaultCfg
from soarm.robot.emulator_process import EmulatorProcess
from soarm.logs import read_log
from tests.helpers import SoarmRun, calibrated_arm, wait_until as wait

pytestmark = pytest.mark.bus


@pytest.fixture
def emulated(tmp_path, robot):
    """A calibrated emulated arm and its calibration file; the bus is the driver's to open."""
    with calibrated_arm(robot, seed=7) as (emu, bus, cal):
        bus.close()
        calibration.save(cal, tmp_path / "cal.json")
        yield emu, str(tmp_path / "cal.json")


def test_a_failing_front_end_callback_ends_in_torque_off_and_the_driver_recovers(emulated, tiny_policy):
    emu, cal = emulated
    calls = {"n": 0, "fail": True}

    def on_state(sample):
        calls["n"] += 1
        if calls["fail"] and calls["n"] > 5:
            raise RuntimeError("publisher gone")
    driver = ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal), on_state=on_state)
    driver.start()
    try:
        assert wait(lambda: driver.state == DISABLED)
        ok, msg = driver.enable()
        assert ok, msg
        assert wait(lambda: driver.state == FAULT)
        assert driver.reason == "internal error: RuntimeError: publisher gone"
        assert not any(emu.torque_enabled())                      # torque off
        calls["fail"] = False
        ok, msg = driver.enable()                                    # the bus thread still serves
        assert ok and driver.state == ENABLED, msg
        ok, _ = driver.disable()
        assert ok and wait(lambda: driver.state == DISABLED, 30) and not any(emu.torque_enabled())
    finally:
        driver.close()


def test_bad_configuration_is_one_line_before_the_bus_is_touched(emulated, tiny_policy):
    emu, cal = emulated
    before = emu.counters["packets"]
    with pytest.raises(ValueError, match="servo_ids: 5 ids for the arm's 6 joints"):
        ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal, servo_ids=[1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="'elbow_flex' is servo 3, servo_ids says 9"):
        ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal, servo_ids=[1, 2, 9, 4, 5, 6]))
    with pytest.raises(ValueError, match="rate_hz 120: .* was trained at 30 Hz and runs only at that rate"):
        ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal, rate_hz=120))
    assert emu.counters["packets"] == before


def test_enable_after_the_bus_was_lost_reopens_the_port(tmp_path, tiny_policy):
    """The emulator killed and started again behind the same path (an adapter unplugged and
    replugged): the next enable reconnects, says so, and the arm runs again."""
    link, cal = tmp_path / "so101", tmp_path / "cal.json"
    args = ("--no-compile", "--link", str(link))
    emu = EmulatorProcess(cal, seed=3, args=args)
    driver = ReachDriver(DriverCfg(port=str(link), policy=str(tiny_policy), calibration=str(cal)))
    driver.start()
    try:
        assert wait(lambda: driver.state == DISABLED, 30)
        ok, msg = driver.enable()
        assert ok, msg
        emu.kill()
        assert wait(lambda: driver.state == FAULT, 10), driver.reason
        ok, msg = driver.enable()
        assert not ok and "enable refused" in msg                     # nothing behind the path yet
        emu = EmulatorProcess(cal, seed=3, args=args, calibrate=False)
        ok, msg = driver.enable()
        assert ok and driver.state == ENABLED, msg
        assert driver.diagnostics()["reconnects"] >= 1
        ticks = driver.diagnostics()["tick"]["ticks"]
        assert wait(lambda: driver.diagnostics()["tick"]["ticks"] > ticks + 10, 10)     # the loop runs
        assert driver.state == ENABLED, driver.reason
        ok, _ = driver.disable()
        assert ok
    finally:
        driver.close()
        emu.stop()


def test_a_replug_while_disabled_is_a_fault_until_it_reconnects_by_itself(tmp_path, tiny_policy):
    """Disabled, the adapter pulled and plugged back: the driver used to stay 'ok' with no
    joint states, and the first enable failed. Now a lost bus is a fault, reconnects are
    tried every second, joint states come back and the first enable works."""
    link, cal = tmp_path / "so101", tmp_path / "cal.json"
    args = ("--no-compile", "--link", str(link))
    emu = EmulatorProcess(cal, seed=3, args=args)
    samples = []
    driver = ReachDriver(DriverCfg(port=str(link), policy=str(tiny_policy), calibration=str(cal)))
    driver.on_state = samples.append
    driver.start()
    try:
        assert wait(lambda: driver.state == DISABLED and len(samples) > 5, 30), driver.reason
        emu.kill()
        assert wait(lambda: driver.state == FAULT, 10), driver.reason
        assert "the bus is gone" in driver.reason and not driver.diagnostics()["connected"]
        emu = EmulatorProcess(cal, seed=3, args=args, calibrate=False)
        assert wait(lambda: driver.state == DISABLED, 15), driver.reason
        assert "reconnected" in driver.reason
        n = len(samples)
        assert wait(lambda: len(samples) > n + 5, 10)                     # joint states again
        ok, msg = driver.enable()
        assert ok and driver.state == ENABLED, msg                        # the first enable works
        assert driver.disable()[0]
    finally:
        driver.close()
        emu.stop()


def test_enable_with_a_joint_outside_its_calibrated_range_refuses_and_moves_nothing(emulated, tiny_policy, tmp_path):
    """A slumped shoulder resting below a calibration's range_min: with torque on, the servo
    would clamp Goal := Present to its limit register and drive the joint there."""
    import dataclasses

    emu, cal_path = emulated
    cal = calibration.load(cal_path)
    lift = cal["shoulder_lift"]
    cal["shoulder_lift"] = dataclasses.replace(lift, range_min=lift.range_min + 300)   # still holds home
    emu.assemble_as(cal)
    calibration.save(cal, tmp_path / "narrow.json")
    q = emu.joint_positions()
    j = emu.robot.names.index("shoulder_lift")
    q[j] = calibration.ticks_to_rad(cal["shoulder_lift"], cal["shoulder_lift"].range_min) - 0.2
    emu.place(q)
    driver = ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=str(tmp_path / "narrow.json")))
    driver.start()
    try:
        assert wait(lambda: driver.state == DISABLED)
        ok, msg = driver.enable()
        assert not ok and "'shoulder_lift' (servo 2)" in msg and "outside its calibrated range" in msg, msg
        assert not any(emu.torque_enabled())
    finally:
        driver.close()


def reaching_driver(emu, cal, policy, seconds: float, log_dir: str = "", **kw) -> ReachDriver:
    """A driver started, enabled and reaching for a target for `seconds` of simulated time."""
    cfg = DriverCfg(port=emu.port, policy=str(policy), calibration=cal, log_dir=log_dir)
    driver = ReachDriver(cfg, **kw).start()
    assert wait(lambda: driver.state == DISABLED)
    assert driver.enable()[0]
    driver.set_target([0.25, 0.05, 0.2])
    assert emu.wait(seconds)
    return driver


def test_disable_parks_the_arm_slowly_then_turns_torque_off(emulated, tiny_policy, tmp_path):
    """Judged on the encoder log: every goal sent while parking moved by at most one tick's
    share of park_speed (exact, any machine speed), and the arm followed at about that speed
    in wall time (a dropped arm falls far faster); then torque off at the park pose."""
    emu, cal = emulated
    driver = reaching_driver(emu, cal, tiny_policy, 1.0, log_dir=str(tmp_path / "logs"))
    try:
        ok, msg = driver.disable()
        assert ok and "parking" in msg and driver.state == PARKING
        assert all(emu.torque_enabled())                           # holding while it parks
        assert wait(lambda: driver.state == DISABLED, 30), driver.reason
        assert driver.reason == "parked; torque off" and not any(emu.torque_enabled())
        arm = emu.robot.arm_index
        assert np.abs(np.array(emu.joint_positions())[arm] - emu.robot.park).max() < 0.15   # at the park pose
    finally:
        driver.close()
    _, ticks = read_log(next((tmp_path / "logs").glob("*.mcap")))
    first = next(i for i, t in enumerate(ticks) if t.move is not None)
    parked = ticks[first - 1:]
    max_step = parked[-1].move["max_step"]
    assert max_step == pytest.approx(driver.cfg.park_speed / driver.rate)
    goals = np.array([t.goal_sent for t in parked])
    assert np.abs(np.diff(goals, axis=0)).max() <= max_step + 1e-6
    read = [p for p in parked[1:] if p.q is not None]             # a failed read logs no position
    t, q = np.array([p.t for p in read]), np.array([p.q for p in read])
    for i in range(len(t)):                                         # every window of >= 0.5 s
        j = np.searchsorted(t, t[i] + 0.5)
        if j < len(t):
            speed = np.abs(q[j] - q[i]).max() / (t[j] - t[i])
            assert speed <= 2 * driver.cfg.park_speed, (t[i], speed)


def test_a_trajectory_runs_on_its_times_through_the_clamps_and_a_target_ends_it(emulated, tiny_policy, tmp_path):
    """Judged on the encoder log: the goals follow the trajectory's setpoints and never step
    more than the rate cap; bad trajectories are refused, naming what is wrong."""
    emu, cal = emulated
    driver = ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal,
                                   log_dir=str(tmp_path / "logs"))).start()
    try:
        assert wait(lambda: driver.state == DISABLED)
        ok, msg = driver.follow(Trajectory(["elbow_flex"], [[0.1]], [1.0]))
        assert not ok and "enable first" in msg
        assert driver.enable()[0]
        lo, hi = driver.safety.lower[2], driver.safety.upper[2]
        for traj, words in ((Trajectory(["gripper"], [[0.1]], [1.0]), "the gripper is held"),
                            (Trajectory(["elbow_flex"], [[hi + 0.2]], [1.0]), "elbow_flex at"),
                            (Trajectory(["elbow_flex"], [[0.1], [0.2]], [1.0, 1.0]), "strictly increasing"),
                            (Trajectory(["elbow_flex"], [[float("nan")]], [1.0]), "finite"),
                            (Trajectory(["elbow_flex"], [], []), "points")):
            ok, msg = driver.follow(traj)
            assert not ok and msg.startswith("trajectory refused") and words in msg, msg
        target = float(np.clip(driver.loop.step.goal[2] + 0.4, lo, hi))
        ok, msg = driver.follow(Trajectory(["elbow_flex"], [[target]], [1.5]))
        assert ok, msg
        assert emu.wait(2.5)
        assert wait(lambda: driver.diagnostics()["move"]["done"], 10), driver.diagnostics()["move"]
        assert abs(driver.loop.step.goal[2] - target) < 1e-6
        driver.set_target([0.22, 0.0, 0.15])               # the policy takes over again
        assert wait(lambda: driver.diagnostics()["move"] is None)
        assert driver.state == ENABLED
    finally:
        driver.close()
    _, ticks = read_log(next((tmp_path / "logs").glob("*.mcap")))
    moved = [t for t in ticks if t.move and t.move["name"] == "trajectory"]
    goals = np.array([t.goal_sent for t in moved])
    assert len(moved) > 30 and np.abs(np.diff(goals, axis=0)).max() <= driver.cfg.safety.max_step + 1e-6
    setpoints = np.array([t.move["pose"] for t in moved])
    assert np.all(np.diff(setpoints[:, 2]) * np.sign(target - setpoints[0, 2]) >= -1e-6)   # on its way, monotone
    assert abs(setpoints[-1, 2] - target) < 1e-6


def test_estop_under_line_noise_is_immediate(emulated, tiny_policy):
    """Bytes on the line all the time and never a valid reply: the bus thread spends each
    tick in a read that fails by its timeout, and the e-stop's broadcast torque off, sent
    from the requesting thread, reaches the servos within one control period of the
    request (timed by the emulator, when the packet arrived), then each servo confirms."""
    emu, cal = emulated
    driver = reaching_driver(emu, cal, tiny_policy, 0.3)
    try:
        emu.faults = FaultCfg(noise=True)
        assert wait(lambda: driver.loop.stats.read_failures >= 2)
        t_request = time.monotonic()
        ok, msg = driver.estop()
        assert ok, msg
        assert not any(emu.torque_enabled()) and driver.state == FAULT
        assert emu.torque_dropped_at - t_request <= 1 / driver.rate, msg
        assert driver.estop_latency_ms <= 1000 / driver.rate, msg
    finally:
        emu.faults = FaultCfg()
        driver.close()


def test_soarm_run_reaches_then_parks_with_torque_off(emulated, tmp_path):
    """`soarm run` (no ROS): targets checked before anything moves, progress printed, the arm
    parked and torque off at the end, a summary line."""
    from soarm import REPO_ROOT
    from soarm.export.runtime import PolicyError
    from soarm.robot.run import run

    emu, cal = emulated
    cfg = DriverCfg(port=emu.port, policy=str(REPO_ROOT / "data" / "policies" / "reach.onnx"), calibration=cal)
    with pytest.raises(PolicyError, match="outside the trained workspace"):
        run(cfg, [[0.22, 0.0, 0.15], [2.0, 0.0, 0.15]], 1.0, out=lambda line: None)
    assert not any(emu.torque_enabled())                      # refused before enabling
    lines = []
    report = run(cfg, [[0.22, 0.05, 0.15]], 4.0, out=lines.append)
    assert not report.fault, report.fault
    assert any("fingertip error" in line for line in lines), lines
    assert report.errors_m[0] < 0.5 * report.start_errors_m[0], report     # it reached toward the target
    assert not any(emu.torque_enabled()) and "parked, torque off" in report.summary()


def test_ctrl_c_again_while_parking_turns_torque_off_at_once_without_a_traceback(tmp_path):
    """`soarm run` in its own process: the first Ctrl-C starts the park, a second one during
    it used to kill the bus thread mid-park and leave all six servos powered."""
    from soarm import REPO_ROOT
    from soarm.robot.bus import FeetechBus

    link, cal = tmp_path / "so101", tmp_path / "cal.json"
    emu = EmulatorProcess(cal, seed=3, args=("--no-compile", "--link", str(link)))
    run = SoarmRun("--port", str(link), "--calibration", str(cal), "--policy",
                   str(REPO_ROOT / "data" / "policies" / "reach.onnx"), "--target", "0.22", "0.1", "0.15", "--hold", "120")
    seen = run.seen
    try:
        assert wait(lambda: run.printed("fingertip error"), 120), "".join(seen)
        run.interrupt()
        assert wait(lambda: run.printed("moving to the park pose"), 30), "".join(seen)    # whole, unlike a list's repr
        run.interrupt()
        rc = run.proc.wait(30)
        err = run.proc.stderr.read()
        assert wait(lambda: run.printed("soarm run:"), 10), seen
        assert rc == 1 and "Traceback" not in err, err
        assert any("Ctrl-C twice" in line for line in seen), seen
        bus = FeetechBus(str(link), {f"j{sid}": sid for sid in range(1, 7)})
        bus.connect()
        assert all(bus.read("Torque_Enable", sid) == 0 for sid in range(1, 7)), (seen, err)
        bus.close()
    finally:
        run.kill()
        emu.stop()


def test_soarm_run_without_the_adapter_is_one_line(tmp_path, capsys):
    import json

    from soarm import REPO_ROOT
    from soarm.cli import main
    from tests.reference.lerobot_calibration import LEROBOT_SO101

    (tmp_path / "cal.json").write_text(json.dumps(LEROBOT_SO101))
    rc = main(["run", "--port", str(tmp_path / "ttyACM9"), "--policy", str(REPO_ROOT / "data" / "policies" / "reach.onnx"),
               "--calibration", str(tmp_path / "cal.json"), "--target", "0.22", "0.0", "0.15"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no such serial port" in err[0], err
