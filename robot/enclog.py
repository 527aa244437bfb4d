"""Encoder logs: what the control loop read, decided and sent, tick by tick, in MCAP.

MCAP (mcap.dev, the `mcap` library; ROS 2 bags use it too) with one JSON channel:

    metadata "soarm.encoder_log": {"schema": "1", "header": JSON}
        header: joint names, servo ids, calibration (LeRobot format), control rate,
                policy file and contract hash, source ("soarm" or "bam-import")
    channel "/soarm/tick" (message encoding json), one message per tick, log_time = ns:
        t            s since start: the tick began (its read was sent)
        t_read       s since start: the reading arrived, or null (failed; absent from older logs)
        t_sent       s since start: the goal was written, or null (not sent; absent from older logs)
        raw          {servo id: Present_Position ticks}, or null when the read failed
        q            arm joint angles (rad) decoded through the calibration, or null
        target       commanded fingertip target (m), or null before the first (goal held)
        action       policy output, or null
        goal_policy  arm goal the policy asked for (rad), or null
        goal_sent    arm goal written after the safety layer (rad), or null (torque off)
        decision     command | hold | torque_off
        events       safety rules that fired this tick
        fault        bus or policy error text, or null
        move         {name, pose (rad), max_step (rad)} while a joint move runs instead of the
                     policy (parking before torque off, home, park, a trajectory), or null;
                     logs written before it call this `park` and have no name
        status       {servo id: {error_bits, temperature (deg C), load (per mille), voltage (V)}}
                     polled since the previous tick (one servo each `status_every` ticks,
                     round robin), or null; absent from older logs

The writer works on `<name>.tmp` and renames it on close, so a finished log is whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA = "1"
TOPIC = "/soarm/tick"
METADATA = "soarm.encoder_log"
TICK_SCHEMA = {"type": "object", "required": ["t", "raw", "q", "decision"]}


class LogError(ValueError):
    """An encoder log that cannot be used; one line naming the file."""


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

    def write(self, tick: dict) -> None:
        ns = int(tick["t"] * 1e9)
        self._writer.add_message(self._channel, log_time=ns, publish_time=ns, data=json.dumps(tick).encode())

    def close(self) -> Path:
        self._writer.finish()
        self._file.close()
        os.replace(self.tmp, self.path)
        return self.path


def read_log(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, ticks) of an encoder log; LogError for a missing, foreign or truncated file."""
    from mcap.reader import make_reader

    path = Path(path)
    if not path.is_file():
        raise LogError(f"{path}: no such encoder log")
    try:
        with open(path, "rb") as f:
            reader = make_reader(f)
            meta = {m.name: m.metadata for m in reader.iter_metadata()}
            if METADATA not in meta:
                raise LogError(f"{path}: not a soarm encoder log (no '{METADATA}' metadata)")
            if meta[METADATA].get("schema") != SCHEMA:
                raise LogError(f"{path}: encoder log schema {meta[METADATA].get('schema')!r}, "
                               f"this version reads {SCHEMA!r}")
            header = json.loads(meta[METADATA]["header"])
            # In the order written, not sorted by time: a clock that stepped back must show.
            messages = reader.iter_messages(topics=[TOPIC], log_time_order=False)
            ticks = [json.loads(m.data) for _, ch, m in messages]
    except LogError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or not MCAP at all
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise LogError(f"{path}: unreadable or truncated encoder log ({why})") from None
    return header, ticks
