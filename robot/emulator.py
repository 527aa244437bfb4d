"""A servo bus on a pseudo-terminal that the unmodified Feetech SDK talks to.

    with ServoBusEmulator() as emu:          # six STS3215s, ids 1..6, on an SO-101
        port = PortHandler(emu.port)          # scservo_sdk, exactly as on the real arm

Protocol (Feetech SCS/STS v1): PING, READ, WRITE, REG_WRITE/ACTION, SYNC_READ (replies in
list order), SYNC_WRITE, broadcast id 254; a servo whose Baud_Rate register differs from the
line speed the host set on the port ignores what it hears; a control-table memory per servo
(robot/control_table.py) with EEPROM write-protected while Lock = 1;
Present_Position = (raw - Homing_Offset) mod 4096; Goal_Position clamped to the
Min/Max_Position_Limit registers; Torque_Enable 0 lets the joint fall.

The servos move by soarm/sim.py's ArmSim (the STS3215 model on the SO-101 dynamics,
gravity included), stepped in real time between packets, so a policy closed through the
emulator meets the physics it was trained on. Each servo's encoder zero sits at a seeded
"assembly" offset from the joint's zero: that is what calibration has to find.

Faults (FaultCfg, seeded): dropped, late or corrupted replies, error bits in every status
packet, silent servos, and `unplug()`.
"""

from __future__ import annotations

import os
import random
import select
import termios
import threading
import time
import tty
from dataclasses import dataclass

import torch

from soarm import CONFIG_DIR, config
from soarm.description import RobotDescription, load_robot
from soarm.robot import control_table as ct
from soarm.servo import TICK, ServoConfig
from soarm.sim import ArmSim

PING, READ, WRITE, REG_WRITE, ACTION, SYNC_READ, SYNC_WRITE = 1, 2, 3, 4, 5, 0x82, 0x83
# Baud_Rate register value -> line speed (the STS3215 manual's table); 0 (1 Mbaud) from the factory.
BAUD_RATES = {0: 1_000_000, 1: 500_000, 2: 250_000, 3: 128_000, 4: 115_200, 5: 76_800, 6: 57_600, 7: 38_400}
BROADCAST = 0xFE
_REST: dict = {}                   # settled power-on pose per (robot, dt), computed once


@dataclass
class FaultCfg:
    drop: float = 0.0               # probability that a reply is not sent
    late: float = 0.0               # probability that a reply comes after the SDK's timeout
    late_s: float = 0.06
    corrupt: float = 0.0            # probability of a reply with a wrong checksum
    error_bits: int = 0             # OR-ed into every status packet (e.g. 0x20 overload)
    silent_ids: tuple[int, ...] = ()
    seed: int = 0


def checksum(body) -> int:
    return ~sum(body) & 0xFF


def status_packet(servo_id: int, error: int, params=()) -> bytes:
    body = [servo_id, len(params) + 2, error, *params]
    return bytes([0xFF, 0xFF, *body, checksum(body)])


class Servo:
    """One servo's control-table memory."""

    def __init__(self, servo_id: int):
        self.mem = bytearray(256)
        for name, value in ct.DEFAULTS.items():
            self.set(name, value)
        self.set("ID", servo_id)
        self.pending: tuple[int, bytes] | None = None      # REG_WRITE waiting for ACTION

    def get(self, name: str) -> int:
        reg = ct.STS3215[name]
        return ct.from_bytes(reg, self.mem[reg.address:reg.address + reg.size])

    def set(self, name: str, value: int) -> None:
        reg = ct.STS3215[name]
        self.mem[reg.address:reg.address + reg.size] = bytes(ct.to_bytes(reg, value))


class ServoBusEmulator:
    def __init__(self, ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6), robot: RobotDescription | None = None,
                 faults: FaultCfg | None = None, seed: int = 0, assembly_offset_ticks: int = 300,
                 q0: list[float] | None = None, physics_dt: float = 0.0056, compile: bool = False):
        """`compile`: fuse the physics step with torch.compile (about 15x faster per step,
        some seconds to compile once); worth it for long runs and timing benchmarks."""
        self.robot = robot or load_robot()
        if len(ids) != len(self.robot.joints):
            raise ValueError(f"{len(ids)} servo ids for {len(self.robot.joints)} joints")
        self.faults = faults or FaultCfg()
        self.rng = random.Random(self.faults.seed)
        servo_cfg = config.load(ServoConfig, CONFIG_DIR / "servo" / "sts3215_7v4.yaml")
        self.sim = ArmSim(self.robot, servo_cfg.params, servo_cfg.registers, 1, physics_dt)
        self.joint_of = {sid: j for j, sid in enumerate(ids)}
        self.servos = {sid: Servo(sid) for sid in ids}
        # Raw encoder reading at joint angle 0, different per unit and assembly.
        g = random.Random(seed)
        self.zero_raw = [ct.MIDDLE + g.randint(-assembly_offset_ticks, assembly_offset_ticks) for _ in ids]
        q = torch.tensor([q0 if q0 is not None else self._rest_pose()], dtype=torch.float32)
        self.sim.reset(torch.ones(1, dtype=torch.bool), q)
        self.sim.enabled[:] = False                      # servos power up with torque off
        if compile:
            self.sim.compile()
        self.master, self.slave = os.openpty()
        tty.setraw(self.master)
        self.port = os.ttyname(self.slave)
        self.counters = {"packets": 0, "replies": 0, "dropped": 0, "late": 0, "corrupted": 0, "bad_checksum": 0,
                         "wrong_baud": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._late: list[tuple[float, bytes]] = []
        self._unplugged = False
        self._t_sim = time.monotonic()

    def _rest_pose(self) -> list[float]:
        """Power-on pose: where the unpowered arm comes to rest when let go at home."""
        home = dict(zip(self.robot.arm_joints, self.robot.home))
        q = [home.get(n, self.robot.gripper_hold) for n in self.robot.names]
        key = (id(self.robot), self.sim.dt)
        if key not in _REST:
            sim = ArmSim(self.robot, self.sim.servo, self.sim.registers, 1, self.sim.dt)
            sim.reset(torch.ones(1, dtype=torch.bool), torch.tensor([q], dtype=torch.float32))
            sim.enabled[:] = False
            chunk = round(0.5 / self.sim.dt)
            with torch.no_grad():
                for _ in range(20):                 # at most 10 s; it settles in about 4.5 s
                    sim.step(sim.goal, chunk)
                    if float(sim.qd.abs().max()) < 1e-3:
                        break
            _REST[key] = sim.q[0].tolist()
        return _REST[key]

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ServoBusEmulator":
        self._thread = threading.Thread(target=self._run, name="servo-bus-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for fd in (self.master, self.slave):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "ServoBusEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def unplug(self) -> None:
        """Pull the USB adapter: the port stops answering, reads fail."""
        self._unplugged = True
        try:
            os.close(self.slave)
        except OSError:
            pass

    # ------------------------------------------------------------ state
    def place(self, q: list[float]) -> None:
        """Move the arm by hand to joint angles q (rad), at rest (torque-off servos follow)."""
        with self._lock:
            qt = torch.tensor([q], dtype=torch.float32)
            self.sim.q, self.sim.qd = qt, torch.zeros_like(qt)

    def joint_positions(self) -> list[float]:
        """True joint angles (rad), for tests and benchmarks."""
        with self._lock:
            return self.sim.q[0].tolist()

    def raw_position(self, sid: int) -> int:
        j = self.joint_of[sid]
        return (self.zero_raw[j] + round(float(self.sim.q[0, j]) / TICK)) % ct.TICKS

    def _present(self, sid: int) -> dict[str, int]:
        j, s = self.joint_of[sid], self.servos[sid]
        qd = float(self.sim.qd[0, j])
        return {"Present_Position": (self.raw_position(sid) - s.get("Homing_Offset")) % ct.TICKS,
                "Present_Velocity": round(qd / TICK), "Moving": int(abs(qd) > 2 * TICK),
                "Status": self.faults.error_bits}

    def _goal_to_rad(self, sid: int, goal: int) -> float:
        s, j = self.servos[sid], self.joint_of[sid]
        lo, hi = s.get("Min_Position_Limit"), s.get("Max_Position_Limit")
        goal = min(max(goal, lo), hi)
        raw = goal + s.get("Homing_Offset")
        # Nearest turn to the present reading: the servo works within one turn.
        delta = (raw - self.raw_position(sid) + ct.TICKS // 2) % ct.TICKS - ct.TICKS // 2
        return float(self.sim.q[0, j]) + delta * TICK

    def _advance(self) -> None:
        """Step the physics towards now, a couple of substeps at a time so that a packet is
        never kept waiting behind a long catch-up; a backlog of more than 50 substeps
        (the host was suspended) is dropped."""
        behind = int((time.monotonic() - self._t_sim) / self.sim.dt)
        if behind > 50:
            self._t_sim += (behind - 2) * self.sim.dt
            behind = 2
        steps = min(behind, 2)
        if steps > 0:
            with torch.no_grad():
                self.sim.step(self.sim.goal, steps)
            self._t_sim += steps * self.sim.dt

    # ------------------------------------------------------------ protocol
    def _run(self) -> None:
        buf = bytearray()
        while not self._stop.is_set():
            timeout = max(0.0, self.sim.dt - (time.monotonic() - self._t_sim))
            if self._late:
                timeout = min(timeout, max(0.0, self._late[0][0] - time.monotonic()))
            try:
                ready, _, _ = select.select([self.master], [], [], timeout)
                data = os.read(self.master, 4096) if ready else b""
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.001)                         # slave closed (unplugged): idle
                data = b""
            with self._lock:
                # Answer first (state at most a substep old), then let time run.
                buf.extend(data)
                for packet in self._packets(buf):
                    self._handle(packet)
                self._flush_late()
                self._advance()

    def _packets(self, buf: bytearray):
        while True:
            start = buf.find(b"\xff\xff")
            if start < 0:
                del buf[:max(0, len(buf) - 1)]
                return
            del buf[:start]
            if len(buf) < 4:
                return
            total = buf[3] + 4
            if len(buf) < total:
                return
            packet = bytes(buf[:total])
            del buf[:total]
            if packet[-1] != checksum(packet[2:-1]):
                self.counters["bad_checksum"] += 1            # a real servo ignores it
                continue
            yield packet

    def _hears(self, sid: int) -> bool:
        """A servo set to another baud rate than the line's reads noise, not packets."""
        code = self.servos[sid].get("Baud_Rate")
        want = getattr(termios, f"B{BAUD_RATES.get(code, 0)}", None)
        try:
            line = termios.tcgetattr(self.master)[4]
        except termios.error:
            return False
        return want is not None and line == want

    def _handle(self, packet: bytes) -> None:
        self.counters["packets"] += 1
        sid, inst, params = packet[2], packet[4], packet[5:-1]
        if sid != BROADCAST and sid in self.servos and not self._hears(sid):
            self.counters["wrong_baud"] += 1
            return
        if inst == SYNC_WRITE:
            addr, n = params[0], params[1]
            for k in range(2, len(params), n + 1):
                if params[k] in self.servos and self._hears(params[k]):
                    self._write(params[k], addr, params[k + 1:k + 1 + n])
            return
        if inst == SYNC_READ:
            addr, n = params[0], params[1]
            for target in params[2:]:
                if target in self.servos and self._hears(target):
                    self._reply(target, self._read(target, addr, n))
            return
        if inst == ACTION:
            for target in (self.servos if sid == BROADCAST else [sid]):
                s = self.servos.get(target)
                if s is not None and s.pending is not None and self._hears(target):
                    self._write(target, *s.pending)
                    s.pending = None
            return
        if sid not in self.servos:
            return
        if inst == PING:
            self._reply(sid, b"")
        elif inst == READ:
            self._reply(sid, self._read(sid, params[0], params[1]))
        elif inst == WRITE:
            self._write(sid, params[0], params[1:])
            self._reply(sid, b"")
        elif inst == REG_WRITE:
            self.servos[sid].pending = (params[0], bytes(params[1:]))
            self._reply(sid, b"")

    def _read(self, sid: int, addr: int, n: int) -> bytes:
        s = self.servos[sid]
        for name, value in self._present(sid).items():
            s.set(name, value)
        return bytes(s.mem[addr:addr + n])

    def _write(self, sid: int, addr: int, data: bytes) -> None:
        s = self.servos[sid]
        locked = s.get("Lock") == 1
        for i, byte in enumerate(data):
            a = addr + i
            reg = ct.BY_ADDRESS.get(a)
            if reg is not None and reg.read_only:
                continue
            if a < ct.EEPROM_END and locked:
                continue                                  # EEPROM is write-protected while locked
            s.mem[a] = byte
        j = self.joint_of[sid]
        touched = range(addr, addr + len(data))
        if ct.STS3215["Torque_Enable"].address in touched:
            on = s.get("Torque_Enable") == 1
            if on and not bool(self.sim.enabled[0, j]):
                # Torque on: the firmware starts from where the joint is, then drives to the goal.
                self.sim.firmware.target[0, j] = self.sim.q[0, j]
                self.sim.firmware.target_vel[0, j] = 0.0
            self.sim.enabled[0, j] = on
        if ct.STS3215["Goal_Position"].address in touched:
            self.sim.goal[0, j] = self._goal_to_rad(sid, s.get("Goal_Position"))

    def _reply(self, sid: int, params: bytes) -> None:
        f = self.faults
        if self._unplugged or sid in f.silent_ids:
            return
        if f.drop and self.rng.random() < f.drop:
            self.counters["dropped"] += 1
            return
        packet = bytearray(status_packet(sid, f.error_bits, params))
        if f.corrupt and self.rng.random() < f.corrupt:
            packet[-1] ^= 0x5A
            self.counters["corrupted"] += 1
        if f.late and self.rng.random() < f.late:
            self._late.append((time.monotonic() + f.late_s, bytes(packet)))
            self.counters["late"] += 1
            return
        self._send(bytes(packet))

    def _flush_late(self) -> None:
        now = time.monotonic()
        while self._late and self._late[0][0] <= now:
            self._send(self._late.pop(0)[1])

    def _send(self, packet: bytes) -> None:
        try:
            os.write(self.master, packet)
            self.counters["replies"] += 1
        except OSError:
            pass


class EmulatorProcess:
    """`soarm emulate` in a process of its own, calibrated, for tests and benchmarks. The
    code under test then meets the bus as on the arm: a device driven by someone else,
    not a thread of its own process competing for the GIL on every reply.

        with EmulatorProcess(tmp / "cal.json") as emu:
            FeetechBus(emu.port, ids) ...; emu.unplug(); emu.kill()
    """

    def __init__(self, calibration: str | os.PathLike, seed: int = 0, args: tuple[str, ...] = (),
                 timeout: float = 180.0):
        """args: more `soarm emulate` options, e.g. ("--no-compile",) or ("--drop", "0.02")."""
        import queue
        import subprocess
        import sys

        self.calibration = calibration
        cmd = [sys.executable, "-m", "soarm.cli", "emulate", "--quiet", "--seed", str(seed),
               "--calibrate", str(calibration), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        lines: queue.Queue = queue.Queue()

        def drain():                          # keeps reading, so the pipe never fills up
            for line in self.proc.stdout:
                self.output.append(line.rstrip())
                lines.put(line)
            lines.put(None)
        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                raise RuntimeError("emulator did not start: " + " | ".join(self.output[-5:]))
            if "Ctrl-C" in line:
                self.port = line.split(" on ", 1)[1].split()[0].rstrip(";")
                return

    def unplug(self) -> None:
        import signal
        self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        import subprocess
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "EmulatorProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
