"""Every rule of the safety layer, exactly."""

import numpy as np
import pytest

from soarm.robot.safety import COMMAND, HOLD, TORQUE_OFF, SafetyCfg, SafetyLayer

LO, HI = np.array([-1.0, -2.0]), np.array([1.0, 2.0])


@pytest.fixture
def layer():
    s = SafetyLayer(SafetyCfg(margin=0.1, max_step=0.05, max_velocity=5.0, hold_after=2, torque_off_after=4),
                    LO, HI)
    s.reset([0.0, 0.0])
    return s


def test_limits_are_the_models_within_the_calibrated_stops(robot):
    from soarm.calibration.calibration import MotorCalibration, rad_to_ticks

    idx = robot.arm_index
    lo, hi = robot.lower[idx], robot.upper[idx]
    # wrist_roll calibrated as a full turn (wider than the model); shoulder_pan's stops 0.01
    # rad inside the model's limits; drive_mode 1 on elbow_flex (ignored, as LeRobot's degrees).
    cal = {}
    for k, n in enumerate(robot.arm_joints):
        c = MotorCalibration(k + 1, int(n == "elbow_flex"), 0, 0, 4095)
        ends = (lo[k] + 0.01, hi[k] - 0.01) if n == "shoulder_pan" else (lo[k] - 0.2, hi[k] + 0.2)
        ticks = sorted(rad_to_ticks(c, e) for e in ends)
        cal[n] = c if n == "wrist_roll" else MotorCalibration(k + 1, c.drive_mode, 0, *ticks)
    s = SafetyLayer.for_arm(SafetyCfg(margin=0.03), robot, cal)
    pan = list(robot.arm_joints).index("shoulder_pan")
    expect_lo, expect_hi = lo.copy(), hi.copy()
    expect_lo[pan], expect_hi[pan] = lo[pan] + 0.04, hi[pan] - 0.04
    assert s.lower == pytest.approx(expect_lo, abs=2e-3) and s.upper == pytest.approx(expect_hi, abs=2e-3)


def step(s, goal, fresh=True, policy=True, velocity=(0.0, 0.0), elapsed=None):
    return s.filter(np.array(goal), np.zeros(2), fresh, policy, 1 / 30, elapsed=elapsed, velocity=np.array(velocity))


def test_limits_with_margin_and_rate_limit(layer):
    d = step(layer, [5.0, -0.01])
    assert d.kind == COMMAND and d.goal.tolist() == [0.05, -0.01]
    assert set(d.events) == {"joint_limit", "rate_limit"}
    for _ in range(40):
        d = step(layer, [5.0, -5.0])
    assert d.goal.tolist() == pytest.approx([0.9, -1.9])           # limit minus margin, never beyond


def test_non_finite_goal_holds_the_last_safe_goal(layer):
    step(layer, [0.03, 0.0])
    d = step(layer, [np.nan, 0.0])
    assert d.kind == HOLD and d.goal.tolist() == [0.03, 0.0] and layer.counters["non_finite_goal"] == 1


def test_velocity_cap_holds_the_last_goal(layer):
    """Not where the reading says the arm is: a fast reading may be a bogus one."""
    step(layer, [0.05, 0.0])
    step(layer, [0.1, 0.0])
    d = step(layer, [0.2, 0.0], velocity=(0.0, 7.0))
    assert d.kind == HOLD and d.goal.tolist() == pytest.approx([0.1, 0.0])
    assert layer.counters["velocity_cap"] == 1


def test_watchdog_hold_then_torque_off_and_stays_off(layer):
    kinds = [step(layer, [0.0, 0.0], fresh=False).kind for _ in range(5)]
    assert kinds == [HOLD, HOLD, HOLD, TORQUE_OFF, TORQUE_OFF]
    assert step(layer, [0.0, 0.0]).kind == TORQUE_OFF                # latched until reset
    layer.reset([0.0, 0.0])
    assert step(layer, [0.01, 0.0]).kind == COMMAND


def test_the_watchdog_goes_by_the_clock_not_by_ticks(layer):
    """A tick that came late (a read blocked) counts for the time it took: one stale tick
    4.5 periods after the last is past torque_off_after (4), one 2.5 periods late holds."""
    step(layer, [0.02, 0.0])
    d = step(layer, [0.0, 0.0], fresh=False, elapsed=2.5 / 30)
    assert d.kind == HOLD and d.events == ["watchdog_hold"]
    assert step(layer, [0.0, 0.0], fresh=False, elapsed=2.0 / 30).kind == TORQUE_OFF
    layer.reset([0.0, 0.0])
    assert step(layer, [0.0, 0.0], fresh=False, elapsed=4.5 / 30).kind == TORQUE_OFF
    assert layer.tripped == "watchdog_torque_off"
    layer.reset([0.0, 0.0])
    assert step(layer, [0.01, 0.0], elapsed=10 / 30).kind == COMMAND        # late but fresh: no fault


def test_fresh_data_resets_the_watchdog(layer):
    for _ in range(3):
        step(layer, [0.0, 0.0], policy=False)
        step(layer, [0.0, 0.0])
    assert layer.tripped is None


@pytest.mark.parametrize("bits, temp, trips", [(0x20, 30, True), (0x04, 30, True), (0x01, 30, True),
                                               (0x08, 30, True), (0x02, 30, True), (0x00, 80, True),
                                               (0x00, 40, False), (0x10, 40, False)])   # 0x10: a goal past a limit
def test_servo_status_faults(layer, bits, temp, trips):
    layer.status(3, bits, temp)
    assert (step(layer, [0.0, 0.0]).kind == TORQUE_OFF) == trips


def test_estop(layer):
    layer.estop()
    assert step(layer, [0.0, 0.0]).kind == TORQUE_OFF and layer.tripped == "estop"


def test_enable_inside_the_margin_band_holds_there_and_walks_out_at_the_cap(layer):
    """Enabled with a joint past the margin (resting on its stop): the first goal is where
    the joint is, and a command moves it into the limits no faster than max_step per tick."""
    below = layer.lower[0] - 0.2
    layer.reset([below, 0.0])
    for _ in range(5):                                                 # no target yet: held where it is
        d = layer.filter(np.array([below, 0.0]), np.array([below, 0.0]), True, True, 1 / 30,
                         velocity=np.zeros(2), hold=True)
        assert d.kind == HOLD and d.goal[0] == below
    goals = [step(layer, [0.0, 0.0]).goal[0] for _ in range(20)]
    assert np.all(np.diff([below, *goals]) <= layer.cfg.max_step + 1e-12)
    assert goals[-1] >= layer.lower[0]
