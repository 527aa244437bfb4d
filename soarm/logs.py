"""Logs of real motion: the encoder logs the control loop writes, and the one log type that
identification fits and `soarm arm-check` replays, with a reader for each source of real data.

Encoder logs (MCAP, mcap.dev; ROS 2 bags use it too) hold one JSON channel:

    metadata "soarm.encoder_log": {"schema": "1", "header": JSON}
        header: joint names, servo ids, calibration (LeRobot format), control rate,
                policy file and contract hash, source ("soarm")
    channel "/soarm/tick" (message encoding json), one `TickRecord` per tick, log_time = ns

The writer works on `<name>.tmp` and renames it on close, so a finished log is whole.

`MotionLog` is a recorded motion whatever recorded it (our encoder logs, BAM's servo bench,
NVIDIA SAGE's real SO-101, a LeRobot dataset's episodes): the goals a plant is driven with and
the angles it must read back, in SI units and this project's joint zero.

    log = read_motion("run.mcap")        # or a BAM bench log (.json), or a SAGE motion folder
    log.t, log.goal, log.measured        # [T] s, [T, A] rad, [T, A] rad
    logs = read_motions("my_dataset/")   # a LeRobot dataset: one MotionLog per episode

Anything unusable raises LogError: one line naming the file and, where it can, the row and
the field.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

SCHEMA = "1"
TOPIC = "/soarm/tick"
METADATA = "soarm.encoder_log"
TICK_SCHEMA = {"type": "object", "required": ["t", "raw", "q", "decision"]}
ToRad = Callable[[str, np.ndarray], np.ndarray]     # (joint, a LeRobot dataset's values) -> rad


class LogError(ValueError):
    """A log that cannot be used: one line naming the file and, where known, the row and the field."""

    def __init__(self, path: str | Path, problem: str, row: int | None = None, field: str | None = None):
        where = ", ".join(part for part in (f"row {row}" if row is not None else "",
                                            f"field '{field}'" if field else "") if part)
        super().__init__(f"{path}: {where}: {problem}" if where else f"{path}: {problem}")


# ---------------------------------------------------------------- encoder logs
@dataclass
class TickRecord:
    """One control tick as the loop read, decided and sent it."""
    t: float                             # s since start: the tick began (its read was sent)
    t_read: float | None = None          # s since start: the reading arrived, or None (failed)
    t_sent: float | None = None          # s since start: the goal was written, or None (not sent)
    raw: dict | None = None              # {servo id: Present_Position ticks}, None when the read failed
    q: list[float] | None = None         # arm joint angles (rad) decoded through the calibration
    target: list[float] | None = None    # commanded fingertip target (m), None before the first (goal held)
    action: list[float] | None = None    # policy output
    goal_policy: list[float] | None = None   # arm goal the policy asked for (rad)
    goal_sent: list[float] | None = None     # arm goal written after the safety layer (rad), None: torque off
    decision: str = "command"            # command | hold | torque_off
    events: list[str] = field(default_factory=list)   # safety rules that fired this tick
    fault: str | None = None             # bus or policy error text
    # {name, pose (rad), max_step (rad)} while a joint move runs instead of the policy (parking
    # before torque off, home, park, a trajectory)
    move: dict | None = None
    # {servo id: {error_bits, temperature (deg C), load (per mille), voltage (V)}} polled since
    # the previous tick (one servo each `status_every` ticks, round robin)
    status: dict | None = None

    @classmethod
    def from_json(cls, d: dict, path: Path, row: int) -> TickRecord:
        if not isinstance(d, dict):
            raise LogError(path, "a tick is not a JSON object", row)
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise LogError(path, "written by an older version of soarm; record it again", row, unknown[0])
        return cls(**d)


class EncoderLogWriter:
    def __init__(self, path: str | Path, header: dict):
        from mcap.writer import CompressionType, Writer

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self.tmp, "wb")
        self._writer = Writer(self._file, compression=CompressionType.ZSTD)
        self._writer.start(profile="", library="soarm")
        self._writer.add_metadata(METADATA, {"schema": SCHEMA, "header": json.dumps(header)})
        schema = self._writer.register_schema("soarm.tick", "jsonschema", json.dumps(TICK_SCHEMA).encode())
        self._channel = self._writer.register_channel(TOPIC, "json", schema)

    def write(self, tick: TickRecord) -> None:
        ns = int(tick.t * 1e9)
        self._writer.add_message(self._channel, log_time=ns, publish_time=ns,
                                 data=json.dumps(dataclasses.asdict(tick)).encode())

    def close(self) -> Path:
        self._writer.finish()
        self._file.close()
        os.replace(self.tmp, self.path)
        return self.path


def read_log(path: str | Path) -> tuple[dict, list[TickRecord]]:
    """(header, ticks) of an encoder log; LogError for a missing, foreign or truncated file."""
    from mcap.reader import make_reader

    path = Path(path)
    if not path.is_file():
        raise LogError(path, "no such encoder log")
    try:
        with open(path, "rb") as f:
            reader = make_reader(f)
            meta = {m.name: m.metadata for m in reader.iter_metadata()}
            if METADATA not in meta:
                raise LogError(path, f"not a soarm encoder log (no '{METADATA}' metadata)")
            if meta[METADATA].get("schema") != SCHEMA:
                raise LogError(path, f"encoder log schema {meta[METADATA].get('schema')!r}, this version reads "
                                     f"{SCHEMA!r}; record it again")
            header = json.loads(meta[METADATA]["header"])
            # In the order written, not sorted by time: a clock that stepped back must show.
            messages = reader.iter_messages(topics=[TOPIC], log_time_order=False)
            raw = [json.loads(m.data) for _, ch, m in messages]
    except LogError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or not MCAP at all
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise LogError(path, f"unreadable or truncated encoder log ({why})") from None
    return header, [TickRecord.from_json(d, path, k) for k, d in enumerate(raw)]


# ---------------------------------------------------------------- the log type identification reads
@dataclass
class MotionLog:
    """A recorded motion of one servo or an arm: T samples of A joints, SI units."""
    source: str                      # the file (or folder) it was read from
    joints: list[str]                # the logged joints: the columns below
    t: np.ndarray                    # [T] s from the first sample, increasing
    goal: np.ndarray                 # [T, A] rad, the goal in force from t[k] on (NaN: none sent)
    measured: np.ndarray             # [T, A] rad, the encoder reading at t[k] (NaN: the read failed)
    torque: np.ndarray               # [T] bool, torque on: the goal acts
    rate_hz: float                   # the rate the goals were sent at
    volts: np.ndarray | None = None  # [T] V, the supply as the servo reported it, where logged
    rig: dict = field(default_factory=dict)   # what the reader knows of the setup (a bench's load, ...)
    # [A] s after t[k] each joint's goal reached its servo, and each joint was read (a bus that
    # talks to one servo at a time spreads a row over the tick); None: all at t[k].
    goal_delay: np.ndarray | None = None
    read_delay: np.ndarray | None = None

    def __post_init__(self) -> None:
        T, A = len(self.t), len(self.joints)
        for name, shape in (("goal", (T, A)), ("measured", (T, A)), ("torque", (T,))):
            if np.shape(getattr(self, name)) != shape:
                raise LogError(self.source, f"{name} has shape {np.shape(getattr(self, name))}, expected {shape}")
        if T < 2:
            raise LogError(self.source, f"{T} samples: a motion needs at least two")
        bad = np.flatnonzero(~np.isfinite(self.t))
        if bad.size:
            raise LogError(self.source, "time is not a finite number", int(bad[0]), "t")
        back = np.flatnonzero(np.diff(self.t) <= 0)
        if back.size:
            k = int(back[0]) + 1
            raise LogError(self.source, f"timestamps go backwards ({self.t[k - 1]:.4f} -> {self.t[k]:.4f} s)", k, "t")
        sent = np.isfinite(self.goal).all(axis=1)
        bad = np.flatnonzero(self.torque & ~sent)
        if bad.size:
            raise LogError(self.source, "torque on but no finite goal", int(bad[0]), "goal")
        bad = np.flatnonzero(np.isinf(self.measured).any(axis=1))
        if bad.size:
            raise LogError(self.source, "reading is infinite", int(bad[0]), "measured")
        if self.volts is not None and not np.isfinite(self.volts).all():
            raise LogError(self.source, "supply voltage is not finite", int(np.flatnonzero(~np.isfinite(self.volts))[0]),
                           "volts")


    def delays(self) -> tuple[np.ndarray, np.ndarray]:
        """(goal_delay, read_delay) [A] s, zeros where the log has none."""
        zero = np.zeros(len(self.joints))
        return (zero if self.goal_delay is None else self.goal_delay,
                zero if self.read_delay is None else self.read_delay)


def read_motion(path: str | Path) -> MotionLog:
    """A motion log of any kind this project reads: an encoder log (.mcap), a BAM bench log
    (.json) or a SAGE motion folder (control.csv and state_motor.csv)."""
    if Path(path).is_dir():
        return read_sage(path)
    return read_bam(path) if str(path).endswith(".json") else read_encoder_log(path)


def read_motions(path: str | Path, to_rad: ToRad | None = None) -> list[MotionLog]:
    """The motions in `path`: each episode of a LeRobot dataset (a folder with meta/info.json;
    `to_rad` as read_lerobot's), or the one motion of any other log (`read_motion`)."""
    if (Path(path) / "meta" / "info.json").is_file():
        return read_lerobot(path, to_rad)
    return [read_motion(path)]


def read_encoder_log(path: str | Path) -> MotionLog:
    """Our encoder log as a motion: the goals sent and the angles read, tick by tick."""
    header, ticks = read_log(path)
    arm = header.get("arm_joints")
    if not isinstance(arm, list) or not arm:
        raise LogError(path, "header names no arm joints (arm_joints)")
    rate = float(header.get("rate_hz", 0) or 0)
    if not rate > 0:
        raise LogError(path, "header has no control rate (rate_hz)")
    if not ticks:
        raise LogError(path, "holds no ticks")
    nan = [np.nan] * len(arm)
    for k, tick in enumerate(ticks):
        for name in ("q", "goal_sent"):
            value = getattr(tick, name)
            if value is not None and len(value) != len(arm):
                raise LogError(path, f"{len(value)} values for {len(arm)} arm joints", k, name)
    return MotionLog(str(path), list(arm), np.array([k.t for k in ticks], dtype=float),
                     np.array([nan if k.goal_sent is None else k.goal_sent for k in ticks], dtype=float),
                     np.array([nan if k.q is None else k.q for k in ticks], dtype=float),
                     np.array([k.goal_sent is not None for k in ticks]), rate, rig={"header": header})


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise LogError(path, f"cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise LogError(path, f"not valid JSON (line {e.lineno}: {e.msg})") from None


BAM_COLUMNS = ("timestamp", "goal_position", "position", "input_volts", "torque_enable")


def read_bam(path: str | Path) -> MotionLog:
    """A servo bench log in BAM's format (data/real_servo_logs/README.md): one servo swinging a
    point mass under gravity. The rig: motor (servo type), kp, mass (kg), length (m), vin (V)."""
    path = Path(path)
    raw = _read_json(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list):
        raise LogError(path, "not a servo bench log (no 'entries' list)")
    rig = {}
    for key, kind in (("motor", str), ("kp", int), ("mass", float), ("length", float), ("vin", float)):
        value = raw.get(key)
        if not isinstance(value, (kind, int) if kind is float else kind) or isinstance(value, bool):
            raise LogError(path, f"not a servo bench log (header '{key}' is {value!r})")
        rig[key] = kind(value)
    cols = {k: [] for k in BAM_COLUMNS}
    for row, entry in enumerate(raw["entries"]):
        for k in BAM_COLUMNS:
            value = entry.get(k) if isinstance(entry, dict) else None
            if isinstance(value, bool) and k != "torque_enable" or not isinstance(value, (int, float)):
                raise LogError(path, f"missing or not a number ({value!r})", row, k)
            if not np.isfinite(value):
                raise LogError(path, "not finite", row, k)
            cols[k].append(float(value))
    t = np.asarray(cols["timestamp"])
    log = MotionLog(str(path), ["servo"], t - t[0] if len(t) else t, np.asarray(cols["goal_position"])[:, None],
                    np.asarray(cols["position"])[:, None], np.asarray(cols["torque_enable"]) != 0,
                    1.0 / float(np.median(np.diff(t))) if len(t) > 1 else 0.0, np.asarray(cols["input_volts"]), rig)
    return log


# ---------------------------------------------------------------- NVIDIA SAGE's real SO-101
SAGE_JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
# SAGE's collector (sage/real_so101/so101_lerobot_collector.py) writes the six goals one servo at
# a time, then reads Present_Position, Present_Velocity and Present_Current of each in turn: 24
# transactions a tick. Its 50 Hz loop never overran 20.7 ms in 25 motions, so one takes under
# 0.83 ms; this is the time the identification replays read them at (docs/sysid.md).
SAGE_TRANSACTION_S = 0.0008
SAGE_RATE_HZ = 50.0
# SAGE clips each goal to the joint's calibrated range and the servo clamps it to its position
# limits; the logs record neither. A goal this far beyond every reading of its joint was not
# the goal the servo held (single_joint_wrist_roll: goals to -1.60 rad, the joint stops at
# -1.03): it is held at the joint's extreme reading.
SAGE_UNREACHED_RAD = 0.2
# What the servos ran with: SAGE writes P, I and D; it never writes Acceleration (LeRobot's
# SO101Follower.configure does, SAGE does not call it), a RAM register the servo powers up
# with at 0: no profile ramp. The logs agree: replayed with LeRobot's 254, the nominal model is
# 43 mrad off on prbs_excitation; with 0, 25 (docs/sysid.md).
SAGE_REGISTERS = {"p": 16, "i": 0, "d": 32, "acceleration": 0}


def read_sage(folder: str | Path, transaction_s: float = SAGE_TRANSACTION_S) -> MotionLog:
    """A motion of NVIDIA SAGE's real SO-101 (data/sage_so101/README.md), the five arm joints in
    this project's convention: SAGE reads positions with 4096 ticks a turn and writes goals
    truncated to whole ticks with 4095 a turn (LeRobot's); here both are LeRobot's degrees
    scale, and the goal is the tick the servo was sent. The gripper column, a 0-1 fraction of
    its calibrated range, is left out. Each joint's goal and reading carry their place in the
    tick's bus traffic (`goal_delay`, `read_delay`)."""
    folder = Path(folder)
    control = _sage_rows(folder, "control", ("type", "timestamp", "positions"))
    state = _sage_rows(folder, "state_motor", ("type", "timestamp", "positions", "velocities", "torques"))
    if len(control[0]) != len(state[0]):
        raise LogError(state[2], f"{len(state[0])} rows, but control.csv has {len(control[0])}")
    t_ctl, goal_sent, _ = control
    t, pos, where = state
    bad = np.flatnonzero(np.abs(t - t_ctl) > 1.0)
    if bad.size:
        raise LogError(where, f"timestamp {t[bad[0]]:.0f} us, control.csv's row has {t_ctl[bad[0]]:.0f}",
                       int(bad[0]) + 1, "timestamp")
    arm = len(SAGE_JOINTS) - 1
    ticks = pos[:, :arm] * 4096 / (2 * math.pi)               # the encoder, relative to the range's middle
    half = np.round(np.median(ticks % 1.0, axis=0) * 2) / 2 % 1.0   # the middle is a whole or a half tick
    measured = ticks * 2 * math.pi / 4095
    goal_ticks = np.floor(goal_sent[:, :arm] * 4095 / (2 * math.pi) + half) - half
    lo, hi = measured.min(axis=0), measured.max(axis=0)
    goal = goal_ticks * 2 * math.pi / 4095
    goal = np.where(goal < lo - SAGE_UNREACHED_RAD, lo, np.where(goal > hi + SAGE_UNREACHED_RAD, hi, goal))
    order = np.arange(arm)
    return MotionLog(str(folder), list(SAGE_JOINTS[:arm]), (t - t[0]) / 1e6, goal, measured,
                     np.ones(len(t), dtype=bool), SAGE_RATE_HZ,
                     rig={"source": "NVIDIA SAGE, real SO-101", "registers": dict(SAGE_REGISTERS)},
                     goal_delay=(order + 1) * transaction_s,
                     read_delay=(len(SAGE_JOINTS) + 3 * order + 0.5) * transaction_s)


def _sage_rows(folder: Path, name: str, columns: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, Path]:
    """(timestamps [T] us, positions [T, 6] rad, the file) of one of a SAGE motion's CSV files."""
    path = next((p for p in (folder / f"{name}.csv", folder / f"{name}.csv.gz") if p.is_file()), None)
    if path is None:
        raise LogError(folder, f"no {name}.csv or {name}.csv.gz: not a SAGE motion folder")
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path, newline="")) as f:
            rows = list(csv.reader(f))
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        raise LogError(path, f"unreadable ({type(e).__name__}: {str(e)[:80]})") from None
    if not rows or tuple(rows[0]) != columns:
        raise LogError(path, f"header {rows[0] if rows else None}, expected {list(columns)}", 0)
    t, pos = [], []
    for k, row in enumerate(rows[1:], start=1):
        if len(row) != len(columns):
            raise LogError(path, f"{len(row)} columns, expected {len(columns)}", k)
        try:
            stamp, values = float(row[1]), json.loads(row[2])
        except ValueError as e:
            raise LogError(path, f"not a number or a list ({str(e)[:60]})", k,
                           "timestamp" if not _is_float(row[1]) else "positions") from None
        if not isinstance(values, list) or len(values) != len(SAGE_JOINTS):
            count = len(values) if isinstance(values, list) else 0
            raise LogError(path, f"{count} joints, expected {len(SAGE_JOINTS)} ({', '.join(SAGE_JOINTS)})", k,
                           "positions")
        if not (math.isfinite(stamp) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)):
            raise LogError(path, "not finite", k, "timestamp" if not math.isfinite(stamp) else "positions")
        if t and stamp <= t[-1]:
            raise LogError(path, f"timestamps go backwards ({t[-1]:.0f} -> {stamp:.0f} us)", k, "timestamp")
        t.append(stamp)
        pos.append(values)
    if len(t) < 2:
        raise LogError(path, f"{len(t)} rows: a motion needs at least two")
    return np.asarray(t), np.asarray(pos, dtype=float), path


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- LeRobot datasets of an SO-101
# What LeRobot's SO101Follower writes to every servo when it connects (its configure(): P, I, D
# from its config's defaults, Acceleration 254 by configure_motors); a dataset does not record them.
LEROBOT_REGISTERS = {"p": 16, "i": 0, "d": 32, "acceleration": 254}
LEROBOT_FORMAT = "v3."          # the dataset layout LeRobot 0.4 and later write (meta/info.json's codebase_version)


def read_lerobot(root: str | Path, to_rad: ToRad | None = None) -> list[MotionLog]:
    """A LeRobot dataset of an SO-101 follower (format v3: meta/info.json, data/**/*.parquet),
    one MotionLog per episode: `action` as the goals, `observation.state` as the readings, at
    the dataset's fps. LeRobot records a frame as it runs it: read the joints (one sync read),
    then send the action, so each reading precedes its frame's goal. Joint values in degrees
    (LeRobot 0.6's SO-101 default, `use_degrees`), or, recorded with `use_degrees` off, in a
    -100..100 range per joint that `to_rad(joint, values)` converts (its calibration file:
    soarm.calibration.calibration.range_mode); nothing in the files says which. The gripper
    (a 0-100 range) is left out. Needs pyarrow."""
    root = Path(root)
    info_path = root / "meta" / "info.json"
    info = _read_json(info_path)
    version = str(info.get("codebase_version", "")) if isinstance(info, dict) else ""
    if not version.startswith(LEROBOT_FORMAT):
        raise LogError(info_path, f"LeRobot dataset format {version or 'unknown'}; this reads v3 "
                                  "(LeRobot 0.4 and later; `lerobot-edit-dataset` converts older ones)")
    fps = info.get("fps")
    if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0:
        raise LogError(info_path, f"fps is {fps!r}, expected a positive number", field="fps")
    features = info.get("features") if isinstance(info.get("features"), dict) else {}
    arm = SAGE_JOINTS[:-1]
    columns = {}
    for key in ("action", "observation.state"):
        names = (features.get(key) or {}).get("names") if isinstance(features.get(key), dict) else None
        wanted = [f"{joint}.pos" for joint in arm]
        if not isinstance(names, list) or any(w not in names for w in wanted):
            raise LogError(info_path, f"feature '{key}' names {names!r}; an SO-101 dataset names "
                                      f"{', '.join(wanted)}", field=key)
        columns[key] = [names.index(w) for w in wanted]
    table = _lerobot_table(root, ("episode_index", "timestamp", "action", "observation.state"))
    episodes = table["episode_index"]
    logs = []
    for episode in np.unique(episodes):
        rows = np.flatnonzero(episodes == episode)
        rows = rows[np.argsort(table["timestamp"][rows], kind="stable")]
        t = table["timestamp"][rows]
        source = f"{root}/episode_{int(episode):06d}"
        goal = _lerobot_rad(table["action"][rows][:, columns["action"]], arm, to_rad)
        measured = _lerobot_rad(table["observation.state"][rows][:, columns["observation.state"]], arm, to_rad)
        for name, values in (("action", goal), ("observation.state", measured)):
            bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
            if bad.size:
                raise LogError(source, "not finite", int(bad[0]), name)
        logs.append(MotionLog(source, list(arm), t - t[0], goal, measured, np.ones(len(t), dtype=bool),
                              float(fps), rig={"source": "LeRobot dataset", "registers": dict(LEROBOT_REGISTERS),
                                               "robot_type": info.get("robot_type")}))
    return logs


def _lerobot_rad(values: np.ndarray, joints: tuple[str, ...], to_rad: ToRad | None) -> np.ndarray:
    if to_rad is None:
        return np.radians(values)
    return np.stack([to_rad(joint, values[:, j]) for j, joint in enumerate(joints)], axis=1)


def _lerobot_table(root: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The columns of every data file of a LeRobot dataset, as arrays (lists become [T, n])."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise LogError(root, "reading a LeRobot dataset needs pyarrow (pip install pyarrow)") from None
    files = sorted((root / "data").glob("**/*.parquet"))
    if not files:
        raise LogError(root / "data", "no .parquet files: not a LeRobot dataset's data")
    parts = {c: [] for c in columns}
    for path in files:
        try:
            table = pq.read_table(path, columns=list(columns))
        except Exception as e:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, KeyError for a column, OSError)
            raise LogError(path, f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:100]})") from None
        for c in columns:
            column = table.column(c).to_pylist()
            try:
                parts[c].append(np.asarray(column, dtype=float))
            except (TypeError, ValueError):
                raise LogError(path, "values of unequal length or not numbers", field=c) from None
    out = {}
    for c in columns:
        try:
            out[c] = np.concatenate(parts[c])
        except ValueError:
            raise LogError(root / "data", "files disagree on the length of each value", field=c) from None
    return out
