"""The safety layer: every goal passes here before it reaches a servo.

Pure and bus-free (the control loop feeds it and obeys it), so every rule is tested exactly:
- NaN/inf goals are rejected (hold the last safe goal);
- goals are clamped to the joint limits: the robot description's limits (the ones training
  clipped its goals to, so a trained policy never meets this clamp) intersected with the
  calibrated range minus a margin (the hard stops, where a servo would stall);
- the change per tick is capped (a rate limit on the goal);
- a joint measured faster than the velocity cap makes the arm hold its last goal;
- watchdog: no fresh encoder reading or no fresh policy output for `hold_after` control
  periods of wall-clock time -> hold; for `torque_off_after` periods -> torque off (by the
  clock, so a tick that came late because a read blocked counts for the time it took);
- an error bit (voltage, angle sensor, overheat, overcurrent, overload), a temperature above
  the limit, or a status no working servo reports (read twice running) in a polled servo
  status -> torque off; `estop()` -> torque off.
Every rule that fires is counted, and logged as an event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from soarm.robot.control_table import PLAUSIBLE_VOLTAGE

COMMAND, HOLD, TORQUE_OFF = "command", "hold", "torque_off"
# Status register bits (Feetech's memory table: voltage, angle sensor, temperature, current,
# angle limit, overload); all but the angle limit (a goal beyond the limits) stop the arm.
FATAL_BIT_NAMES = {0x01: "input voltage", 0x02: "angle sensor", 0x04: "overheat", 0x08: "overcurrent",
                   0x20: "overload"}
FATAL_BITS = sum(FATAL_BIT_NAMES)


def fatal_faults(error_bits: int) -> list[str]:
    """The fatal faults a servo's Status register reports, by name."""
    return [name for bit, name in FATAL_BIT_NAMES.items() if error_bits & bit]


@dataclass
class SafetyCfg:
    margin: float = 0.03               # rad kept clear of each limit
    max_step: float = 0.08             # rad per tick a goal may move
    max_velocity: float = 6.0          # rad/s measured, above which the arm holds
    hold_after: int = 3                # control periods (wall clock) without fresh data before holding
    torque_off_after: int = 15         # control periods without fresh data before torque off (0.5 s at 30 Hz)
    max_temperature: int = 65          # deg C

    # Physically sensible ranges: a value outside one is a typo or a unit mistake, refused.
    BOUNDS = {"margin": (0.0, 0.3),                # rad; more would cut the workspace
              "max_step": (1e-4, 0.25),            # rad per tick; 0.25 at 30 Hz is past any servo's speed
              "max_velocity": (0.1, 12.0),         # rad/s; above the STS3215's no-load speed at 12 V
              "hold_after": (1, 300),              # ticks
              "torque_off_after": (2, 600),        # ticks
              "max_temperature": (30, 80)}         # deg C; the STS3215 itself cuts out at 70-80

    def validate(self) -> None:
        for name, (lo, hi) in self.BOUNDS.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"safety.{name}: {value} is outside {lo:g}..{hi:g}")
        if not self.hold_after < self.torque_off_after:
            raise ValueError("safety: need hold_after < torque_off_after")


@dataclass
class Decision:
    kind: str                          # command | hold | torque_off
    goal: np.ndarray | None            # rad, what to write (None with torque_off)
    events: list[str] = field(default_factory=list)


class SafetyLayer:
    def __init__(self, cfg: SafetyCfg, lower, upper, stops=None):
        """lower/upper: the model's joint limits (rad). stops: (lower, upper) of the arm's
        calibrated range (rad), kept clear by cfg.margin; None takes the model's limits as
        the stops."""
        self.cfg = cfg
        lower, upper = np.asarray(lower, dtype=float), np.asarray(upper, dtype=float)
        s_lo, s_hi = (lower, upper) if stops is None else (np.asarray(stops[0], float), np.asarray(stops[1], float))
        self.lower = np.maximum(lower, s_lo + cfg.margin)
        self.upper = np.minimum(upper, s_hi - cfg.margin)
        if not (self.lower < self.upper).all():
            raise ValueError("safety: the margin leaves no room inside the joint limits")
        self.last: np.ndarray | None = None
        self.stale = 0.0                   # control periods since the last fresh data, by the clock
        self.tripped: str | None = None
        self.counters: dict[str, int] = {}
        self.events: deque[str] = deque(maxlen=1000)          # the latest, for logs

    @classmethod
    def for_arm(cls, cfg: SafetyCfg, robot, cal: dict) -> "SafetyLayer":
        """The arm joints' limits: the robot description's, within the calibrated range. A
        calibration whose range does not hold the home pose is refused (ConfigError)."""
        from soarm.calibration.calibration import check_home, ticks_to_rad

        arm = list(robot.arm_joints)
        check_home(cal, robot)
        ends = np.array([[ticks_to_rad(cal[n], cal[n].range_min), ticks_to_rad(cal[n], cal[n].range_max)]
                         for n in arm])
        idx = robot.arm_index
        return cls(cfg, robot.lower[idx], robot.upper[idx], (ends.min(1), ends.max(1)))

    def reset(self, measured) -> None:
        """Start from the measured pose (after Goal := Present and torque on), where it is:
        a joint inside the margin band is held there and walked out of it at the rate cap
        once the policy commands, never jumped on enable."""
        self.last = np.asarray(measured, dtype=float).copy()
        self.stale, self.tripped = 0.0, None

    def _fire(self, rule: str, out: list[str]) -> None:
        self.counters[rule] = self.counters.get(rule, 0) + 1
        out.append(rule)

    def filter(self, goal, measured, fresh_reading: bool, fresh_policy: bool, period: float, *,
               elapsed: float | None = None, velocity=None, hold: bool = False) -> Decision:
        """The goal to send this tick, given the policy's goal and the latest reading.
        period: the control period (s); elapsed: wall-clock seconds since the previous
        decision (None: one period). `hold`: no policy goal (no target yet): keep the last
        goal as it is, even outside the limits' margin, since walking it in would move the
        arm unasked."""
        events: list[str] = []
        if self.tripped:
            return Decision(TORQUE_OFF, None, [self.tripped])
        fresh = fresh_reading and fresh_policy
        self.stale = 0.0 if fresh else self.stale + (period if elapsed is None else elapsed) / period
        if self.stale >= self.cfg.torque_off_after:
            return self._trip("watchdog_torque_off", events)
        if self.stale >= self.cfg.hold_after:
            self._fire("watchdog_hold", events)
            return self._record(Decision(HOLD, self.last.copy(), events))
        if not fresh:                              # a missed tick: keep the last goal
            return self._record(Decision(HOLD, self.last.copy(), events))
        goal = np.asarray(goal, dtype=float)
        if not np.isfinite(goal).all():
            self._fire("non_finite_goal", events)
            return self._record(Decision(HOLD, self.last.copy(), events))
        if velocity is not None and (np.abs(velocity) > self.cfg.max_velocity).any():
            # Hold the last goal: a fast reading may be a bogus one, and stepping toward it
            # would act on it.
            self._fire("velocity_cap", events)
            return self._record(Decision(HOLD, self.last.copy(), events))
        if hold:
            return self._record(Decision(HOLD, self.last.copy(), events))
        clipped = np.clip(goal, self.lower, self.upper)
        if (clipped != goal).any():
            self._fire("joint_limit", events)
        step = np.clip(clipped - self.last, -self.cfg.max_step, self.cfg.max_step)
        if (self.last + step != clipped).any():
            self._fire("rate_limit", events)
        self.last = self.last + step
        return self._record(Decision(COMMAND, self.last.copy(), events))

    def servo_faults(self, error_bits: int, temperature: int, voltage: float | None = None) -> list[str]:
        """What makes a servo unfit to drive, by name: the one rule for enable, the polls while
        enabled and the diagnostics."""
        hot = [f"overheating ({temperature} deg C, above safety.max_temperature {self.cfg.max_temperature})"]
        lo, hi = PLAUSIBLE_VOLTAGE
        supply = [] if voltage is None or lo <= voltage <= hi else [f"a supply of {voltage:.1f} V"]
        return fatal_faults(error_bits) + (hot if temperature > self.cfg.max_temperature else []) + supply

    def status(self, sid: int, error_bits: int, temperature: int) -> None:
        """A polled servo status; a fault trips the layer (next decision: torque off)."""
        if self.servo_faults(error_bits, temperature):
            bits = error_bits & FATAL_BITS
            named = "_".join(name.replace(" ", "_") for name in fatal_faults(error_bits))   # e.g. _input_voltage
            self._trip(f"servo_{sid}_error_0x{error_bits:02x}_{named}" if bits else f"servo_{sid}_overheat_{temperature}C",
                       [])

    def implausible_status(self, sid: int) -> None:
        """A servo reported, twice running, a supply or temperature no working servo reports."""
        self._trip(f"servo_{sid}_implausible_status", [])

    def estop(self, reason: str = "estop") -> None:
        self._trip(reason, [])

    def _trip(self, rule: str, events: list[str]) -> Decision:
        if self.tripped is None:
            self.tripped = rule
            self._fire(rule, events)
            self.events.append(rule)
        return Decision(TORQUE_OFF, None, events)

    def _record(self, d: Decision) -> Decision:
        self.events.extend(d.events)
        return d
