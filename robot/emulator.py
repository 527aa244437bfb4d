"""A servo bus on a pseudo-terminal that the unmodified Feetech SDK talks to.

    with ServoBusEmulator() as emu:          # six STS3215s, ids 1..6, on an SO-101
        port = PortHandler(emu.port)          # scservo_sdk, exactly as on the real arm

Protocol (Feetech SCS/STS v1): PING, READ, WRITE, REG_WRITE/ACTION, SYNC_READ (replies in
list order), SYNC_WRITE, broadcast id 254 (a broadcast PING is answered by every servo, in id
order); a packet whose bytes stop coming is dropped after PACKET_TIMEOUT_S; a servo whose Baud_Rate register differs from the
line speed the host set on the port ignores what it hears; a control-table memory per servo
(robot/control_table.py) whose EEPROM writes last across `power_cycle()` only when made
with Lock = 0 (Feetech's memory table: Lock = 1 only stops them being saved);
Present_Position = (raw - Homing_Offset) mod 4096; Goal_Position clamped to the
Min/Max_Position_Limit registers; Torque_Enable 0 lets the joint fall.

The servos move by soarm/sim.py's ArmSim (the STS3215 model on the SO-101 dynamics,
gravity included), stepped in real time by a process of its own (robot/emulator_physics.py), so a policy
closed through the emulator meets the physics it was trained on. The bus thread does no
physics: it answers every packet from the plant's latest published state, within
REPLY_BUDGET_S of reading it, however slow the physics is (a plant that cannot keep real time
slows the simulated clock instead). Each servo's encoder zero sits at a seeded "assembly"
offset from the joint's zero: that is what calibration has to find.

Faults (FaultCfg, seeded): dropped, late or corrupted replies, readings of random data with
a valid checksum, replies longer than asked, error bits in every status packet, silent
servos, and `unplug()`.

The parts: robot/sts_protocol.py (instructions, framing, a servo's memory), robot/pty_link.py
(the line), robot/emulator_physics.py (the physics process), this module (the servos on the bus: what
each packet does, faults), robot/emulate.py (`soarm emulate`: serving it until stopped),
robot/emulator_process.py (`soarm emulate` as a process, for tests) and robot/emulated_operator.py (a person at the arm for `soarm calibrate`).
"""

from __future__ import annotations

import random
import termios
import threading
import time
from dataclasses import dataclass

from soarm.description import RobotDescription, load_robot
from soarm.robot import control_table as ct
from soarm.arm_params import ArmParams
from soarm.robot.emulator_physics import PlantProcess
from soarm.robot.pty_link import PtyLink
from soarm.robot.servo_protection import CURRENT_UNIT_A
from soarm.robot.servo_protection import REGISTERS as PROTECTION_REGISTERS
from soarm.robot.sts_protocol import (ACTION, BAUD_RATES, BROADCAST, PING, READ, REG_WRITE, SYNC_READ, SYNC_WRITE,
                                      PACKET_TIMEOUT_S, WRITE, Servo, drop_header, split_packets, status_packet)
from soarm.servo import TICK, ServoRegisters

# Registers that reach the servo model (ServoRegisters' fields). Torque_Limit is the one in
# force (Feetech: set from Max_Torque_Limit at power-on). The cut-out's registers
# (robot/servo_protection.py) reach the physics process beside them.
PHYSICS_REGISTERS = {"P_Coefficient": "p", "D_Coefficient": "d", "I_Coefficient": "i",
                     "Acceleration": "acceleration", "Torque_Limit": "torque_limit"}

# Longest time from reading a packet to writing its reply: well inside the SDK's own
# timeout (2 x 16 ms latency timer + 2 ms + the bytes' time, about 34 ms at 1 Mbaud).
REPLY_BUDGET_S = 0.005


@dataclass
class FaultCfg:
    drop: float = 0.0               # probability that a reply is not sent
    late: float = 0.0               # probability that a reply comes after the SDK's timeout
    late_s: float = 0.06
    corrupt: float = 0.0            # probability of a reply with a wrong checksum
    garbage: float = 0.0            # probability of a SYNC_READ reply with random data, valid checksum
    oversize: float = 0.0           # probability of a READ reply one byte longer than asked, valid checksum
    spike: float = 0.0              # probability that a position reading is spike_ticks off, valid checksum
    spike_ticks: int = 180
    noise: bool = False             # bytes on the line all the time and no valid reply (a bad cable)
    error_bits: int = 0             # OR-ed into every status packet (e.g. 0x20 overload)
    silent_ids: tuple[int, ...] = ()
    seed: int = 0


class ServoBusEmulator:
    def __init__(self, ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6), robot: RobotDescription | None = None,
                 faults: FaultCfg | None = None, seed: int = 0, assembly_offset_ticks: int = 300,
                 q0: list[float] | None = None, compile: bool = False, plant: str = "armsim",
                 arm: ArmParams | None = None, factory: bool = False):
        """`compile`: fuse the physics step with torch.compile (about 15x faster per step,
        some seconds to compile once): real-time physics on a slow machine. `plant`: 'armsim'
        (our training plant) or 'mujoco' (the published MJCF); `arm`: how the armsim arm
        differs from the nominal one (robot/emulator_physics.py). `factory`: servos as they
        leave the factory, every one at ID 1 (connect one at a time, `attach`, to give each its
        own, as `lerobot-setup-motors` does)."""
        self.robot = robot or load_robot()
        if len(ids) != len(self.robot.joints):
            raise ValueError(f"{len(ids)} servo ids for {len(self.robot.joints)} joints")
        self.faults = faults or FaultCfg()
        self.rng = random.Random(self.faults.seed)
        self.units = [Servo(1 if factory else sid) for sid in ids]     # one per joint, in joint order
        self.attached = set(range(len(ids)))                 # the units on the line
        self._wire()
        # Raw encoder reading at joint angle 0, different per unit and assembly.
        g = random.Random(seed)
        self.zero_raw = [ct.MIDDLE + g.randint(-assembly_offset_ticks, assembly_offset_ticks) for _ in ids]
        self.plant = PlantProcess(self.robot, q0, compile, plant, arm)
        self.link = PtyLink()
        self.port = self.link.port
        self.counters = {"packets": 0, "replies": 0, "dropped": 0, "late": 0, "corrupted": 0, "bad_checksum": 0,
                         "wrong_baud": 0, "malformed": 0, "over_budget": 0, "garbage": 0, "oversize": 0,
                         "spike": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._late: list[tuple[float, bytes]] = []
        self._out = bytearray()
        self.max_reply_s = 0.0                               # longest read-to-reply time so far
        self.torque_dropped_at: float | None = None          # monotonic: the latest packet that turned a servo off
        self._t_rx = 0.0                                     # monotonic: when the bytes being handled arrived
        self.write_hooks: list = []                          # called after each write, lock held (the operator)
        self._now = self.plant.state()                       # the state replies are built from

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ServoBusEmulator":
        self._thread = threading.Thread(target=self._run, name="servo-bus-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.plant.close()
        self.link.close()

    def __enter__(self) -> "ServoBusEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def unplug(self) -> None:
        """Pull the USB adapter: the port stops answering, reads fail."""
        self.link.unplug()

    def supply(self, volts: float) -> None:
        """Set the arm's supply (V): every servo reads it, flags it outside its voltage limits,
        and its motor is driven by it (a sagging supply)."""
        with self._lock:
            for s in self.units:
                s.set("Present_Voltage", round(volts * 10))
            self.plant.command_supply(volts)

    def attach(self, joints: list[str]) -> None:
        """Which servos are connected to the adapter (by joint name); the others hear nothing."""
        with self._lock:
            self.attached = {self.robot.names.index(n) for n in joints}
            self._wire()

    def _wire(self) -> None:
        """The servos on the line by the ID each holds now (after an ID write, an attach or a
        power cycle). Two with one ID on the line: the later joint's answers."""
        self.servos = {self.units[j].get("ID"): self.units[j] for j in sorted(self.attached)}
        self.joint_of = {sid: self.units.index(s) for sid, s in self.servos.items()}
        self._rewire = False

    def power_cycle(self) -> None:
        """Switch the arm's supply off and on: every servo's torque off, RAM back to its
        power-up values, EEPROM to what was last written with Lock = 0."""
        with self._lock:
            for j, s in enumerate(self.units):
                s.power_cycle()
                self.plant.command_torque(j, False)
                self._command_registers(s)
            self._wire()

    # ------------------------------------------------------------ state
    def assemble_as(self, cal: dict) -> None:
        """Make the emulated arm the one a calibration file describes (LeRobot format,
        name -> MotorCalibration): each servo's EEPROM holds the file's homing offset and
        limits, and its encoder sits so that the file's mapping reads the true joint angles."""
        names = self.robot.names
        missing = [n for n in names if n not in cal]
        if missing:
            raise ValueError(f"calibration has no entry for {', '.join(missing)}")
        with self._lock:
            for j, n in enumerate(names):
                c, s = cal[n], self.units[j]
                if c.drive_mode:
                    raise ValueError(f"'{n}': the emulator assembles drive_mode 0 joints only (LeRobot's SO-101)")
                self.zero_raw[j] = round(c.middle + c.homing_offset) % ct.TICKS
                s.set("Homing_Offset", c.homing_offset)
                s.set("Min_Position_Limit", c.range_min)
                s.set("Max_Position_Limit", c.range_max)
                s.save()

    def place(self, q: list[float]) -> None:
        """Move the arm by hand to joint angles q (rad), at rest (torque-off servos follow)."""
        with self._lock:
            self.plant.place(q)
            self.refresh()

    def refresh(self) -> None:
        """Answer from the plant's latest state from now on (lock held). A drive the overcurrent
        cut-out turned off reads Torque_Enable 0 from then on: the host turns it on again."""
        self._now = self.plant.state()
        for j, s in enumerate(self.units):
            if self._now.cut[j] and s.get("Torque_Enable") == 1:
                s.set("Torque_Enable", 0)
                self.plant.command_torque(j, False)

    def joint_positions(self) -> list[float]:
        """True joint angles (rad), for tests and benchmarks."""
        return self.plant.state().q

    def torque_enabled(self) -> list[bool]:
        """Each servo's Torque_Enable register, in joint order."""
        with self._lock:
            return [s.get("Torque_Enable") == 1 for s in self.units]

    def wait(self, sim_seconds: float) -> bool:
        """Until the arm's simulated clock has advanced by sim_seconds (any machine speed)."""
        return self.plant.wait(sim_seconds)

    def settle(self, within_s: float = 30.0, still: float = 1e-3) -> bool:
        """Until the arm has stayed still (every joint slower than `still` rad/s at both ends of
        0.1 s of simulated time, and moved less than that allows between them): a let-go arm
        has fallen to rest (an arm whose gearboxes hold hard, as SAGE's real one, can creep for
        seconds). At most within_s simulated seconds; False if it had not by then.
        One look is not enough: an arm just placed reads at rest until the physics steps it
        (on a busy machine, tens of milliseconds), and then falls."""
        before = self.plant.state()
        for _ in range(round(within_s / 0.1)):
            if not self.plant.wait(0.1):
                return False
            now = self.plant.state()
            if (max(abs(v) for v in before.qd + now.qd) < still
                    and max(abs(a - b) for a, b in zip(before.q, now.q)) < 0.1 * still):
                return True
            before = now
        return False

    def raw_position(self, sid: int) -> int:
        return self._raw(sid, self.plant.state())

    def _raw(self, sid: int, state) -> int:
        j = self.joint_of[sid]
        return (self.zero_raw[j] + round(state.q[j] / TICK)) % ct.TICKS

    def _present(self, sid: int) -> dict[str, int]:
        j, s = self.joint_of[sid], self.servos[sid]
        qd = self._now.qd[j]
        return {"Present_Position": (self._raw(sid, self._now) - s.get("Homing_Offset")) % ct.TICKS,
                "Present_Velocity": round(qd / TICK), "Moving": int(abs(qd) > 2 * TICK),
                "Present_Load": round(self._now.duty[j] * 1000), "Present_Current": round(
                    self._now.current_a[j] / CURRENT_UNIT_A), "Status": self._error_bits(sid)}

    def _error_bits(self, sid: int) -> int:
        """What the servo reports in Status and every status packet: its cut-out's latched bits,
        the supply outside Min/Max_Voltage_Limit (0.1 V) and the injected fault's."""
        s = self.servos[sid]
        volts = s.get("Present_Voltage")
        supply = ct.ERR_VOLTAGE if not s.get("Min_Voltage_Limit") <= volts <= s.get("Max_Voltage_Limit") else 0
        return self.faults.error_bits | self._now.status[self.joint_of[sid]] | supply

    def _goal_to_rad(self, sid: int, goal: int) -> float:
        s, j = self.servos[sid], self.joint_of[sid]
        lo, hi = s.get("Min_Position_Limit"), s.get("Max_Position_Limit")
        goal = min(max(goal, lo), hi)
        raw = goal + s.get("Homing_Offset")
        # Nearest turn to the present reading: the servo works within one turn.
        delta = (raw - self._raw(sid, self._now) + ct.TICKS // 2) % ct.TICKS - ct.TICKS // 2
        return self._now.q[j] + delta * TICK

    # ------------------------------------------------------------ protocol
    def _run(self) -> None:
        buf = bytearray()
        partial_since = None                                  # when the incomplete packet in buf began
        while not self._stop.is_set():
            timeout = 0.002 if self.faults.noise else 0.05
            if self._late:
                timeout = min(timeout, max(0.0, self._late[0][0] - time.monotonic()))
            data = self.link.read(timeout)
            if data is None:
                if self._stop.is_set():
                    return
                self._stop.wait(0.001)                       # the host's end is gone (unplugged): idle
                data = b""
            t_read = self._t_rx = time.monotonic()
            with self._lock:
                buf.extend(data)
                self.refresh()
                while True:
                    size = len(buf)
                    for packet in split_packets(buf, self.counters):
                        try:
                            self._handle(packet)
                        except (IndexError, KeyError, ValueError):
                            self.counters["malformed"] += 1   # a servo ignores what it cannot parse
                        if self._rewire:                      # an ID written: answers at it from the next packet
                            self._wire()
                    if len(buf) < 2:
                        partial_since = None
                    elif len(buf) < size or partial_since is None:   # a new packet has begun
                        partial_since = t_read
                    if partial_since is None or t_read - partial_since <= PACKET_TIMEOUT_S:
                        break
                    drop_header(buf, self.counters)           # its rest never came: look for the next
                    partial_since = None
                self._flush_late()
                if self.faults.noise and not self.link.unplugged:
                    self._out += bytes(self.rng.randrange(0xFE) for _ in range(32))   # never 0xFF: no header
                out, self._out = bytes(self._out), bytearray()
            if out:
                self.link.write(out)                         # all the replies to what was read, at once
                took = time.monotonic() - t_read
                self.max_reply_s = max(self.max_reply_s, took)
                if took > REPLY_BUDGET_S:
                    self.counters["over_budget"] += 1

    def _hears(self, sid: int) -> bool:
        """A servo set to another baud rate than the line's reads noise, not packets."""
        code = self.servos[sid].get("Baud_Rate")
        want = getattr(termios, f"B{BAUD_RATES.get(code, 0)}", None)
        return want is not None and self.link.line_speed() == want

    def _handle(self, packet: bytes) -> None:
        self.counters["packets"] += 1
        sid, inst, params = packet[2], packet[4], packet[5:-1]
        if sid != BROADCAST and sid in self.servos and not self._hears(sid):
            self.counters["wrong_baud"] += 1
            return
        if inst == SYNC_WRITE:
            addr, n = params[0], params[1]
            if n == 0 or (len(params) - 2) % (n + 1):
                raise ValueError("sync write whose entries do not fit its data length")
            for k in range(2, len(params), n + 1):
                if params[k] in self.servos and self._hears(params[k]):
                    self._write(params[k], addr, params[k + 1:k + 1 + n])
            return
        if inst == SYNC_READ:
            addr, n = params[0], params[1]
            for target in params[2:]:
                if target in self.servos and self._hears(target):
                    data = self._read(target, addr, n)
                    if self.faults.garbage and self.rng.random() < self.faults.garbage:
                        data = bytes(self.rng.randrange(256) for _ in data)
                        self.counters["garbage"] += 1
                    self._reply(target, data)
            return
        if inst == ACTION:
            for target in (self.servos if sid == BROADCAST else [sid]):
                s = self.servos.get(target)
                if s is not None and s.pending is not None and self._hears(target):
                    self._write(target, *s.pending)
                    s.pending = None
            return
        if sid == BROADCAST and inst == WRITE:                # every servo acts, none replies
            for target in self.servos:
                if self._hears(target):
                    self._write(target, params[0], params[1:])
            return
        if sid == BROADCAST and inst == PING:                 # who is there: each servo answers, in id order
            for target in sorted(self.servos):
                if self._hears(target):
                    self._reply(target, b"")
            return
        if sid not in self.servos:
            return
        if inst == PING:
            self._reply(sid, b"")
        elif inst == READ:
            data = self._read(sid, params[0], params[1])
            if self.faults.oversize and self.rng.random() < self.faults.oversize:
                data += b"\x00"                           # as a late reply to a longer read
                self.counters["oversize"] += 1
            self._reply(sid, data)
        elif inst == WRITE:
            self._write(sid, params[0], params[1:])
            self._reply(sid, b"")
        elif inst == REG_WRITE:
            self.servos[sid].pending = (params[0], bytes(params[1:]))
            self._reply(sid, b"")

    def _read(self, sid: int, addr: int, n: int) -> bytes:
        s = self.servos[sid]
        if addr + n > len(s.mem):
            raise ValueError("read past the control table")
        for name, value in self._present(sid).items():
            s.set(name, value)
        pos = ct.STS3215["Present_Position"].address
        if self.faults.spike and addr <= pos < addr + n and self.rng.random() < self.faults.spike:
            s.set("Present_Position", (s.get("Present_Position") + self.faults.spike_ticks) % ct.TICKS)
            self.counters["spike"] += 1
        return bytes(s.mem[addr:addr + n])

    def _write(self, sid: int, addr: int, data: bytes) -> None:
        s = self.servos[sid]
        if not data or addr + len(data) > len(s.mem):
            raise ValueError("write outside the control table")
        locked, was_on = s.get("Lock") == 1, s.get("Torque_Enable") == 1
        for i, byte in enumerate(data):
            a = addr + i
            reg = ct.BY_ADDRESS.get(a)
            if reg is not None and reg.read_only:
                continue
            s.mem[a] = byte
        if addr < ct.EEPROM_END and not locked:
            s.save()                                      # unlocked: kept across a power cycle
        j = self.joint_of[sid]
        touched = range(addr, addr + len(data))
        self._rewire |= ct.STS3215["ID"].address in touched
        goal_written = ct.STS3215["Goal_Position"].address in touched
        if ct.STS3215["Torque_Enable"].address in touched:
            on = s.get("Torque_Enable") == 1
            self.plant.command_torque(j, on)
            if on and not was_on and not goal_written:     # torque on holds where it is: goal := present
                s.set("Goal_Position", self._present(sid)["Present_Position"])
            if was_on and not on:
                self.torque_dropped_at = self._t_rx
        if goal_written:
            self.plant.command_goal(j, self._goal_to_rad(sid, s.get("Goal_Position")))
        if any(ct.STS3215[name].address in touched for name in (*PHYSICS_REGISTERS, *PROTECTION_REGISTERS)):
            self._command_registers(s)
        for hook in self.write_hooks:
            hook()

    def _command_registers(self, s: Servo) -> None:
        """The servo's control and cut-out registers, as written, into its joint's physics."""
        j = self.units.index(s)
        self.plant.command_registers(j, ServoRegisters(
            **{field: s.get(name) for name, field in PHYSICS_REGISTERS.items()}))
        self.plant.command_protection(j, [s.get(name) for name in PROTECTION_REGISTERS])

    def _reply(self, sid: int, params: bytes) -> None:
        f = self.faults
        if self.link.unplugged or sid in f.silent_ids or f.noise:
            return
        if f.drop and self.rng.random() < f.drop:
            self.counters["dropped"] += 1
            return
        packet = bytearray(status_packet(sid, self._error_bits(sid), params))
        if f.corrupt and self.rng.random() < f.corrupt:
            packet[-1] ^= 0x5A
            self.counters["corrupted"] += 1
        if f.late and self.rng.random() < f.late:
            self._late.append((time.monotonic() + f.late_s, bytes(packet)))
            self.counters["late"] += 1
            return
        self._out += packet
        self.counters["replies"] += 1

    def _flush_late(self) -> None:
        now = time.monotonic()
        while self._late and self._late[0][0] <= now:
            self._out += self._late.pop(0)[1]
            self.counters["replies"] += 1
