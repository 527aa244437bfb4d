"""The arm as a service (robot/driver.py) without ROS: requests from other threads, and a
failure anywhere ending in torque off with the bus thread still serving."""

import time

import pytest

from soarm.calibration import calibration
from soarm.robot.driver import DISABLED, ENABLED, FAULT, DriverCfg, ReachDriver
from soarm.robot.bus import FeetechBus
from soarm.robot.emulator import ServoBusEmulator

pytestmark = pytest.mark.bus


@pytest.fixture
def emulated(tmp_path, robot):
    with ServoBusEmulator(seed=7) as emu:
        bus = FeetechBus(emu.port, {n: i + 1 for i, n in enumerate(robot.names)})
        bus.connect()
        cal = calibration.calibrate_emulated(emu, bus, robot)
        bus.close()
        calibration.save(cal, tmp_path / "cal.json")
        yield emu, str(tmp_path / "cal.json")


def wait(pred, timeout=5.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.02)
    return False


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
        assert ok and not any(emu.torque_enabled())
    finally:
        driver.close()


def test_bad_configuration_is_one_line_before_the_bus_is_touched(emulated, tiny_policy):
    emu, cal = emulated
    before = emu.counters["packets"]
    with pytest.raises(ValueError, match="servo_ids: 5 ids for the arm's 6 joints"):
        ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal, servo_ids=[1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="'elbow_flex' is servo 3, servo_ids says 9"):
        ReachDriver(DriverCfg(port=emu.port, policy=str(tiny_policy), calibration=cal, servo_ids=[1, 2, 9, 4, 5, 6]))
    assert emu.counters["packets"] == before
