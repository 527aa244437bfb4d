"""SO-101 calibration in LeRobot's format, and the one mapping between encoder ticks and the
joint radians of configs/robot/so101.urdf.

A calibration file is LeRobot's JSON, so existing LeRobot calibrations load as they are:
    {"shoulder_pan": {"id": 1, "drive_mode": 0, "homing_offset": -1470,
                      "range_min": 758, "range_max": 3292}, ...}
`homing_offset` is what the servo's Homing_Offset register holds: Present_Position =
raw - homing_offset (mod 4096). LeRobot's half-turn homing makes the homing pose read 2047.

The mapping is LeRobot's degrees convention (lerobot 0.4-0.6, `MotorsBus._normalize` with
`MotorNormMode.DEGREES`, what the SO-101 follower uses with `use_degrees`): a joint's zero is
the middle of its calibrated range, and the full range of the encoder is resolution - 1 ticks:
    q = (ticks - (range_min + range_max) / 2) * 2 pi / 4095
The middle of the swept hard stops is a mechanical fact (the published `so101_new_calib` model's
limits are symmetric about that zero, and so are ours); the operator's homing pose is not.
The full-turn wrist roll is recorded as 0..4095 by LeRobot, so its zero is the homing pose.
`drive_mode` is read and kept but, as in LeRobot's degrees mode, does not flip the mapping
(LeRobot writes 0 for every SO-101 joint; only its range modes, the gripper's, flip with it;
our gripper is held in ticks, never mapped).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from soarm.config import ConfigError
from soarm.files import atomic_write
from soarm.robot.control_table import MIDDLE, TICKS

RAD_PER_TICK = 2 * math.pi / (TICKS - 1)   # LeRobot's degrees scale: 360 deg per (resolution - 1) ticks
FIELDS = ("id", "drive_mode", "homing_offset", "range_min", "range_max")


@dataclass(frozen=True)
class MotorCalibration:
    id: int
    drive_mode: int          # LeRobot's; flips only its range modes (never the radians here)
    homing_offset: int       # Homing_Offset register value
    range_min: int           # calibrated range, in Present_Position ticks
    range_max: int

    @property
    def middle(self) -> float:
        """The joint's zero, in ticks: the middle of the calibrated range."""
        return (self.range_min + self.range_max) / 2


def ticks_to_rad(cal: MotorCalibration, ticks: float) -> float:
    return (ticks - cal.middle) * RAD_PER_TICK


def rad_to_ticks(cal: MotorCalibration, rad: float) -> int:
    return round(cal.middle + rad / RAD_PER_TICK)


def range_to_rad(cal: MotorCalibration, value):
    """LeRobot's -100..100 range value of a joint (its SO-101 with `use_degrees` off) -> rad:
    the ticks LeRobot 0.6.1's MotorsBus._unnormalize gives for it, through ticks_to_rad."""
    value = -value if cal.drive_mode else value
    return ticks_to_rad(cal, (value + 100) / 200 * (cal.range_max - cal.range_min) + cal.range_min)


def range_mode(path: str | Path):
    """`to_rad` for soarm.logs.read_lerobot: a dataset recorded with `use_degrees` off, through
    the calibration file it was recorded with."""
    cal = load(path)
    return lambda joint, values: range_to_rad(cal[joint], values)


def load(path: str | Path, motors: list[str] | None = None) -> dict[str, MotorCalibration]:
    """Read and validate a LeRobot calibration file; one-line ConfigError otherwise."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read calibration ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed calibration JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: calibration must map motor names to their entries")
    out = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or set(entry) != set(FIELDS):
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ConfigError(f"{path}: '{name}' must have exactly {', '.join(FIELDS)} (got {got})")
        if not all(isinstance(entry[f], int) and not isinstance(entry[f], bool) for f in FIELDS):
            raise ConfigError(f"{path}: '{name}': all fields must be integers")
        cal = MotorCalibration(**{f: entry[f] for f in FIELDS})
        if cal.drive_mode not in (0, 1):
            raise ConfigError(f"{path}: '{name}.drive_mode' must be 0 or 1")
        if not 0 <= cal.range_min < cal.range_max < TICKS:
            raise ConfigError(f"{path}: '{name}': range_min {cal.range_min}, range_max {cal.range_max}: "
                              f"need 0 <= range_min < range_max < {TICKS}")
        if not -2047 <= cal.homing_offset <= 2047:
            raise ConfigError(f"{path}: '{name}.homing_offset' must lie in -2047..2047")
        out[name] = cal
    missing = [m for m in (motors or []) if m not in out]
    if missing:
        raise ConfigError(f"{path}: no calibration for {', '.join(missing)}")
    return out


# A calibrated range may span this much more than the joint's travel in the robot description
# (real arms' sweeps: up to ~6 % more). Wider, the sweep crossed the encoder's wrap (the
# homing pose was far from the middle): the range's middle, the joint's zero, is then wrong.
RANGE_OVER_TRAVEL = 0.2


def check_home(cal: dict[str, MotorCalibration], robot, where: str = "calibration") -> None:
    """Each arm joint's calibrated range must be no wider than the joint can travel and must
    contain the task's home pose: otherwise the file belongs to another arm, was written under
    another joint-zero convention, or its sweep crossed the encoder's wrap."""
    for name, q in zip(robot.arm_joints, robot.home):
        c = cal[name]
        joint = robot.joints[robot.index(name)]
        span, travel = (c.range_max - c.range_min) * RAD_PER_TICK, joint.upper - joint.lower
        if span > (1 + RANGE_OVER_TRAVEL) * travel:
            raise ConfigError(f"{where}: '{name}' calibrated range {c.range_min}..{c.range_max} spans "
                              f"{math.degrees(span):.0f} deg, the joint travels {math.degrees(travel):.0f}: "
                              "a sweep across the encoder's wrap (homing pose far from the middle?); recalibrate")
        lo, hi = ticks_to_rad(c, c.range_min), ticks_to_rad(c, c.range_max)
        if not lo <= q <= hi:
            raise ConfigError(f"{where}: '{name}' calibrated range {lo:+.3f}..{hi:+.3f} rad "
                              f"(ticks {c.range_min}..{c.range_max}) does not contain its home angle {q:+.3f} rad; "
                              "a file of another arm, or of another joint-zero convention?")


# Ticks a joint may read outside its calibrated range at enable: resting on a stop reads a
# tick or two past the extreme the sweep recorded, and the firmware's move to its limit
# register is then below a degree.
RANGE_SLACK_TICKS = 4


def check_in_range(cal: dict[str, MotorCalibration], present: dict[int, int]) -> None:
    """Before torque on: every joint must read inside its calibrated range, because the
    servo clamps Goal := Present to its limit registers and would drive the joint there."""
    for name, c in cal.items():
        t = present[c.id]
        if not c.range_min - RANGE_SLACK_TICKS <= t <= c.range_max + RANGE_SLACK_TICKS:
            raise ConfigError(f"enable refused: '{name}' (servo {c.id}) reads tick {t}, outside its calibrated "
                              f"range {c.range_min}..{c.range_max}: with torque on the servo would drive it to "
                              "that limit; move the joint inside by hand, or recalibrate")


def save(cal: dict[str, MotorCalibration], path: str | Path) -> None:
    text = json.dumps({k: asdict(v) for k, v in cal.items()}, indent=4) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))


# ------------------------------------------------------------------ on the arm
def calibrate(bus, names: list[str], confirm, sweep_done, full_turn: tuple[str, ...] = ("wrist_roll",),
              log=print) -> dict[str, MotorCalibration]:
    """LeRobot's SO-101 procedure on a connected FeetechBus, torque off throughout.

    confirm(message) returns once the operator has done what it says; sweep_done() is
    polled while the joints are swept and returns True when the operator is finished.
    Writes Homing_Offset and the position limits to the servos' EEPROM.
    """
    bus.torque_off()
    ids = {n: bus.ids[n] for n in names}
    for sid in ids.values():
        bus.write("Lock", sid, 0)
        bus.write("Homing_Offset", sid, 0)
        bus.write("Min_Position_Limit", sid, 0)
        bus.write("Max_Position_Limit", sid, TICKS - 1)
    confirm("Move the arm to the middle of its range (every joint centred), then confirm.")
    raw = bus.sync_read("Present_Position", tries=3)
    # Half-turn homing: the middle pose reads 2047 from now on.
    offsets = {n: _wrap(raw[sid] - MIDDLE) for n, sid in ids.items()}
    for n, sid in ids.items():
        bus.write("Homing_Offset", sid, offsets[n])
    turn = f" ({', '.join(full_turn)}: a full turn)" if full_turn else ""
    log(f"Now move every joint through its whole range{turn}")
    lo = {n: TICKS for n in ids}
    hi = {n: -1 for n in ids}
    while True:
        try:
            pos = bus.sync_read("Present_Position")
        except Exception:  # noqa: BLE001 - a missed reading only loses a sample
            pos = {}
        for n, sid in ids.items():
            if sid in pos:
                lo[n], hi[n] = min(lo[n], pos[sid]), max(hi[n], pos[sid])
        if sweep_done():
            break
    cal = {}
    for n, sid in ids.items():
        rmin, rmax = (0, TICKS - 1) if n in full_turn else (lo[n], hi[n])
        if not rmin < rmax:
            raise ConfigError(f"calibration: joint '{n}' did not move during the sweep")
        cal[n] = MotorCalibration(sid, 0, offsets[n], rmin, rmax)
        bus.write("Min_Position_Limit", sid, rmin)
        bus.write("Max_Position_Limit", sid, rmax)
        bus.write("Lock", sid, 1)
    return cal


def calibrate_on_port(port: str, out: str | Path, ask=input) -> dict[str, MotorCalibration]:
    """`soarm calibrate`: the procedure with a person at the arm, who answers `ask` prompts
    (Enter) when each step is done; the servos' torque is off at the end whatever happens.
    Writes `out` (LeRobot's format, atomically) and returns the calibration."""
    import threading

    from soarm.description import load_robot
    from soarm.robot.bus import FeetechBus

    names = list(load_robot().names)
    bus = FeetechBus(port, {n: i + 1 for i, n in enumerate(names)})
    bus.connect()
    done = threading.Event()
    # The sweep polls the encoders until the operator presses Enter, read on its own thread.
    waiter = threading.Thread(target=lambda: (ask("[Enter] when done "), done.set()), daemon=True)

    def sweep_done() -> bool:
        if not waiter.is_alive() and not done.is_set():
            waiter.start()               # first poll: the sweep has begun, wait for Enter
        return done.is_set()

    try:
        cal = calibrate(bus, names, lambda message: ask(f"{message} [Enter] "), sweep_done)
    finally:
        bus.torque_off()
        bus.close()
    save(cal, out)
    return cal


def calibrate_emulated(emu, bus, robot):
    """The procedure on an emulated arm (robot/emulator.py), the operator's moves scripted:
    the middle pose, then each joint to half and full travel both ways."""
    names = list(robot.names)
    middle = [0.0] * len(names)
    lo, hi = list(robot.lower), list(robot.upper)
    path = [middle, [x / 2 for x in lo], lo, [x / 2 for x in hi], hi, middle]
    step = iter(range(len(path) * 3))           # three readings at each pose

    def sweep_done():
        k = next(step)
        emu.place(path[min(k // 3, len(path) - 1)])
        return k >= len(path) * 3 - 1

    return calibrate(bus, names, confirm=lambda msg: emu.place([0.0] * len(names)), sweep_done=sweep_done,
                     log=lambda msg: None)


def check_servos(bus, cal: dict[str, MotorCalibration], where: str = "calibration") -> None:
    """The servos' EEPROM must hold the file's homing offsets and limits (start-up check)."""
    for name, c in cal.items():
        have = (bus.read("Homing_Offset", c.id), bus.read("Min_Position_Limit", c.id),
                bus.read("Max_Position_Limit", c.id))
        want = (c.homing_offset, c.range_min, c.range_max)
        if have != want:
            raise ConfigError(f"{where}: servo {c.id} ({name}) holds homing offset/min/max {have}, "
                              f"the calibration file says {want}; recalibrate or use the right file")


def _wrap(offset: int) -> int:
    """Into the register's -2047..2047 (the reading is modulo one turn)."""
    return (offset + 2048) % TICKS - 2048 if abs(offset) > 2047 else offset
