"""Logs of real motion: the encoder logs the control loop writes, and the one log type that
identification fits and `soarm arm-check` replays, with a reader for each source of real data.

Encoder logs (MCAP, mcap.dev; ROS 2 bags use it too) hold one JSON channel:

    metadata "soarm.encoder_log": {"schema": "1", "header": JSON}
        header: joint names, servo ids, calibration (LeRobot format), control rate,
                policy file and contract hash, source ("soarm")
    channel "/soarm/tick" (message encoding json), one `TickRecord` per tick, log_time = ns

The writer works on `<name>.tmp` and renames it on close, so a finished log is whole.

`MotionLog` is a recorded motion whatever recorded it (our encoder logs, BAM's servo bench):
the goals a plant is driven with and the angles it must read back, in SI units.

    log = read_motion("run.mcap")        # or a BAM bench log (.json)
    log.t, log.goal, log.measured        # [T] s, [T, A] rad, [T, A] rad

Anything unusable raises LogError: one line naming the file and, where it can, the row and
the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = "1"
TOPIC = "/soarm/tick"
METADATA = "soarm.encoder_log"
TICK_SCHEMA = {"type": "object", "required": ["t", "raw", "q", "decision"]}


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


def read_motion(path: str | Path) -> MotionLog:
    """A motion log of any kind this project reads: an encoder log (.mcap) or a BAM bench log (.json)."""
    return read_bam(path) if str(path).endswith(".json") else read_encoder_log(path)


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


BAM_COLUMNS = ("timestamp", "goal_position", "position", "input_volts", "torque_enable")


def read_bam(path: str | Path) -> MotionLog:
    """A servo bench log in BAM's format (data/real_servo_logs/README.md): one servo swinging a
    point mass under gravity. The rig: motor (servo type), kp, mass (kg), length (m), vin (V)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise LogError(path, f"cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise LogError(path, f"not valid JSON (line {e.lineno}: {e.msg})") from None
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
