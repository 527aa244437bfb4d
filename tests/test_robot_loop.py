"""The control loop closed through the emulator: SDK -> pty -> emulated servos and physics.
Every way it ends is torque off."""

import math

import numpy as np
import pytest

from soarm.export.runtime import PolicyRuntime
from soarm.robot.emulator import FaultCfg
from soarm.robot.loop import ControlLoop
from soarm.robot.safety import SafetyCfg, SafetyLayer
from tests.helpers import calibrated_arm

pytestmark = pytest.mark.bus

TARGET = np.array([0.2, 0.0, 0.15], dtype=np.float32)


@pytest.fixture
def arm(robot, tiny_policy):
    with calibrated_arm(robot, seed=2) as (emu, bus, cal):
        rt = PolicyRuntime(tiny_policy)
        safety = SafetyLayer.for_arm(SafetyCfg(), robot, cal)
        yield emu, bus, cal, rt, safety


def test_runs_at_rate_within_limits_and_ends_with_torque_off(arm, robot):
    emu, bus, cal, rt, safety = arm
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET)
    loop.start()
    assert all(emu.torque_enabled())
    stats = loop.run(seconds=1.0)
    # The emulator answers from a thread of this process: on a busy machine it can miss a
    # reply's deadline now and then, which the loop counts and rides through; a broken read
    # path fails every tick.
    assert 25 <= stats["ticks"] <= 31 and stats["read_failures"] <= 2
    assert not any(emu.torque_enabled())                       # torque off at the end
    q = np.array(emu.joint_positions())[robot.arm_index]
    idx = robot.arm_index
    assert (q >= robot.lower[idx] - 0.02).all() and (q <= robot.upper[idx] + 0.02).all()


def test_bad_target_holds_then_turns_torque_off(arm):
    emu, bus, cal, rt, safety = arm
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: np.full(3, math.nan, dtype=np.float32))
    loop.start()
    stats = loop.run(seconds=3.0)
    assert stats["policy_errors"] >= safety.cfg.torque_off_after - 1
    assert safety.tripped == "watchdog_torque_off" and safety.counters["watchdog_hold"] > 0
    assert not any(emu.torque_enabled())


def test_unplugged_adapter_ends_in_a_defined_state(arm):
    emu, bus, cal, rt, safety = arm
    ticks = iter(range(10**6))

    def target():
        if next(ticks) == 10:
            emu.unplug()
        return TARGET
    loop = ControlLoop(bus, rt, cal, safety, target=target)
    loop.start()
    stats = loop.run(seconds=3.0)                                 # no exception escapes
    assert stats["read_failures"] > 0 and safety.tripped == "watchdog_torque_off"
    assert not loop.running


def test_servo_overload_turns_torque_off(arm):
    emu, bus, cal, rt, safety = arm
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET, status_every=2)
    loop.start()
    emu.faults.error_bits = 0x20
    loop.run(seconds=2.0)
    assert safety.tripped is not None and "error_0x20" in safety.tripped
    assert not any(emu.torque_enabled())


def test_enable_is_refused_while_a_servo_reports_overload(arm):
    emu, bus, cal, rt, safety = arm
    emu.faults.error_bits = 0x20
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET)
    with pytest.raises(ValueError, match=r"enable refused: servo 1 \(shoulder_pan\) reports overload \(status 0x20\)"):
        loop.start()
    assert not loop.running and not any(emu.torque_enabled())
    emu.faults.error_bits = 0
    loop.start()                                                  # cleared: enable works
    assert loop.running and all(emu.torque_enabled())
    loop.shutdown()


@pytest.mark.parametrize("bits, name", [(0x08, "overcurrent"), (0x02, "angle sensor")])
def test_enable_is_refused_on_an_overcurrent_or_angle_sensor_bit(arm, bits, name):
    emu, bus, cal, rt, safety = arm
    emu.faults.error_bits = bits
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET)
    with pytest.raises(ValueError, match=f"reports {name} \\(status 0x0{bits}\\)"):
        loop.start()
    assert not loop.running and not any(emu.torque_enabled())


@pytest.mark.parametrize("register, value, shown", [("Present_Voltage", 25, ("voltage", 2.5)),
                                                    ("Present_Temperature", 125, ("temperature", 125))])
def test_a_supply_or_temperature_no_servo_reports_mid_run_turns_torque_off(arm, register, value, shown):
    """Once is a garbled reply; the next poll of the same servo saying it again is a fault.
    It used to be dropped as a failed read every time, the diagnostics showing the old values."""
    emu, bus, cal, rt, safety = arm
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET, status_every=2)
    loop.start()
    with emu._lock:
        emu.servos[3].set(register, value)
    loop.run(seconds=5.0)
    assert safety.tripped == "servo_3_implausible_status", safety.tripped
    assert not any(emu.torque_enabled())
    assert getattr(loop.servo_status[3], shown[0]) == shown[1]      # what it said, not the last good value


def test_a_garbage_reading_with_a_valid_checksum_is_a_failed_read(arm):
    """Readings of random data (checksum valid) would put a joint radians away in one tick;
    they count as failed reads, and no goal steps toward them."""
    emu, bus, cal, rt, safety = arm
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET)
    loop.start()
    seen, step = [], loop.step

    def recording_step(q, target, fault=None, now=None):
        if q is not None:
            seen.append(np.array(q))
        return step(q, target, fault, now=now)
    loop.step = recording_step
    emu.faults = FaultCfg(garbage=0.02, seed=4)
    stats = loop.run(seconds=2.0)
    assert emu.counters["garbage"] > 0 and stats["read_failures"] > 0, (emu.counters, stats)
    jumps = np.abs(np.diff(np.array(seen), axis=0)).max()
    assert jumps < 0.35, jumps                                    # 0.35 rad per tick is 10 rad/s


def test_a_one_tick_spike_of_a_few_hundred_ticks_is_a_failed_read(arm):
    """A reading 150-200 ticks off for one tick passed the speed bound (10 rad/s is 217
    ticks a tick at 30 Hz) and the goal stepped toward it; now it is judged against where the
    joint was heading and what its motor can do in a tick."""
    emu, bus, cal, rt, safety = arm
    loop = ControlLoop(bus, rt, cal, safety, target=lambda: TARGET)
    loop.start()
    seen, step = [], loop.step

    def recording_step(q, target, fault=None, now=None):
        seen.append(None if q is None else np.array(q))
        return step(q, target, fault, now=now)
    loop.step = recording_step
    emu.faults = FaultCfg(spike=0.03, spike_ticks=160, seed=5)
    stats = loop.run(seconds=3.0)
    assert emu.counters["spike"] > 0 and stats["read_failures"] >= emu.counters["spike"] // 2, (emu.counters, stats)
    # A spike is one tick out and back: no accepted reading stands out from both neighbours.
    for a, b, c in zip(seen, seen[1:], seen[2:]):
        if a is not None and b is not None and c is not None:
            assert np.abs(b - (a + c) / 2).max() < 0.12, (a, b, c)
