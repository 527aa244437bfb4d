"""The Feetech bus driver: a thin layer over the real `scservo_sdk`, driven by the control table.

All bus I/O happens on one thread (the SDK is not thread-safe) except
`broadcast_torque_off`, which an e-stop sends from its own thread under the port's write lock.
What the SDK gets wrong, handled here:
- a reply that arrives after the timeout is read as the answer to the next request, so
  after any failure the input buffer is flushed and the port's `is_using` flag reset;
- `GroupSyncRead.getData` returns 0 for a servo that did not answer, so every value is
  checked with `isAvailable` first, and a tick with any missing servo fails as a whole;
- `GroupSyncRead` drops each servo's error byte, so `read_status` polls Status,
  temperature and load with plain reads (the control loop does it every few ticks);
- a read takes any reply from the right id and slices it to the length it asked for, so a
  late reply to a longer read passes; `_StrictPackets` also requires the reply's length;
- a reading can have a valid checksum and still be garbage: the control loop refuses a
  jump no joint can make in the time since the last reading (robot/loop.py).

Every error is a BusError with one line naming the port and the servo.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from soarm.robot import control_table as ct

BAUD = 1_000_000


class BusError(RuntimeError):
    """The bus or a servo failed; one line naming the port and the servo."""


class ImplausibleStatus(BusError):
    """A status read whose supply voltage or temperature no working servo reports: a garbled
    reply once, a failing supply or sensor when it comes again."""

    def __init__(self, message: str, status: "ServoStatus"):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServoStatus:
    error_bits: int
    temperature: int            # deg C
    load: int                   # per mille of max torque, signed
    voltage: float              # V


def _strict_packets():
    """The SDK's packet handler, with every read reply's length checked against its request
    (the reply to a READ of n bytes carries LENGTH = n + 2)."""
    import importlib

    import scservo_sdk as scs

    pph = importlib.import_module("scservo_sdk.protocol_packet_handler")   # the module (its class shares the name)

    class StrictPackets(scs.protocol_packet_handler):
        def rxPacket(self, port):
            # The SDK's framing, with its timeout checked on every pass: its own loop checks
            # it only while bytes are missing, so a line that keeps delivering bytes but no
            # valid packet (noise, a babbling device) held the caller for seconds.
            ID, LEN, ERR = pph.PKT_ID, pph.PKT_LENGTH, pph.PKT_ERROR
            rx, wait = [], 6                              # HEADER0 HEADER1 ID LENGTH ERROR CHECKSUM
            while True:
                rx.extend(port.readPort(wait - len(rx)))
                if len(rx) >= wait:
                    start = next((i for i in range(len(rx) - 1) if rx[i] == 0xFF and rx[i + 1] == 0xFF),
                                 len(rx) - 1)
                    if start > 0:
                        del rx[:start]                    # bytes before a header
                    elif rx[ID] > 0xFD or rx[LEN] > pph.RXPACKET_MAX_LEN or rx[ERR] > 0x7F:
                        del rx[0]                         # not a status packet's header
                    elif wait != rx[LEN] + LEN + 1:
                        wait = rx[LEN] + LEN + 1          # the packet's own length
                        continue
                    else:
                        port.is_using = False
                        ok = rx[wait - 1] == ~sum(rx[2:wait - 1]) & 0xFF
                        return rx, scs.COMM_SUCCESS if ok else scs.COMM_RX_CORRUPT
                if port.isPacketTimeout():
                    port.is_using = False
                    return rx, scs.COMM_RX_CORRUPT if rx else scs.COMM_RX_TIMEOUT

        def readRx(self, port, scs_id, length):
            while True:
                rx, result = self.rxPacket(port)
                if result != scs.COMM_SUCCESS or rx[pph.PKT_ID] == scs_id:
                    break
            if result != scs.COMM_SUCCESS:
                return [], result, 0
            if rx[pph.PKT_LENGTH] != length + 2:
                return [], scs.COMM_RX_CORRUPT, 0
            return list(rx[pph.PKT_PARAMETER0:pph.PKT_PARAMETER0 + length]), result, rx[pph.PKT_ERROR]

        def readTxRx(self, port, scs_id, address, length):
            tx = [0] * 8
            tx[pph.PKT_ID], tx[pph.PKT_LENGTH], tx[pph.PKT_INSTRUCTION] = scs_id, 4, scs.INST_READ
            tx[pph.PKT_PARAMETER0], tx[pph.PKT_PARAMETER0 + 1] = address, length
            rx, result, error = self.txRxPacket(port, tx)
            if result != scs.COMM_SUCCESS:
                return [], result, error
            if rx[pph.PKT_LENGTH] != length + 2:
                return [], scs.COMM_RX_CORRUPT, error
            return list(rx[pph.PKT_PARAMETER0:pph.PKT_PARAMETER0 + length]), result, error

    scs.SCS_SETEND(0)
    return StrictPackets()


def _locked_port(name: str):
    """The SDK's port, every write under one lock: the e-stop's broadcast, sent from the
    requesting thread, never interleaves its bytes with a packet the bus thread is sending."""
    import scservo_sdk as scs

    class LockedPort(scs.PortHandler):
        def __init__(self, port_name):
            super().__init__(port_name)
            self.tx_lock = threading.Lock()

        def setupPort(self, cflag_baud):
            """The SDK's, then the port held exclusively (an advisory lock on POSIX): a second
            process on the same adapter would interleave its goals with ours tick by tick."""
            super().setupPort(cflag_baud)
            try:
                self.ser.exclusive = True                 # pyserial locks as it reconfigures
            except Exception:
                self.closePort()
                raise
            return True

        def writePort(self, packet):
            with self.tx_lock:
                return super().writePort(packet)

    return LockedPort(name)


class FeetechBus:
    def __init__(self, port: str, ids: dict[str, int], baud: int = BAUD):
        self.port_name, self.ids, self.baud = port, dict(ids), baud
        self.names = {sid: name for name, sid in self.ids.items()}
        self.port = self.packets = None
        self._reads: dict[tuple[int, int], object] = {}
        self.torque_off_sent_at: float | None = None     # perf_counter of the last broadcast torque off

    # ------------------------------------------------------------- connect
    def connect(self) -> None:
        """Open the port, ping every servo, check its model. No motion, torque untouched."""
        if not os.path.exists(self.port_name):
            raise BusError(f"{self.port_name}: no such serial port (is the servo adapter plugged in?)")
        if not os.access(self.port_name, os.R_OK | os.W_OK):
            raise BusError(f"{self.port_name}: permission denied (add your user to the 'dialout' group)")
        self.close()                            # our own earlier open of it, if any
        self.port, self.packets = _locked_port(self.port_name), _strict_packets()
        self._reads = {}                        # sync-read groups hold the port they were made with
        try:
            self.port.baudrate = self.baud
            if not self.port.openPort():
                raise BusError(f"{self.port_name}: unsupported baud rate {self.baud}")
        except Exception as e:  # noqa: BLE001 - OSError, pyserial's SerialException (an OSError) and friends
            if "exclusively lock" in str(e):
                raise BusError(f"{self.port_name}: in use by another process (another node, `soarm run` "
                               "or LeRobot on the same adapter): stop it first") from None
            if isinstance(e, OSError) and e.errno:
                raise BusError(f"{self.port_name}: cannot open ({os.strerror(e.errno)})") from None
            raise BusError(f"{self.port_name}: cannot open ({str(e).splitlines()[0]})") from None
        firmware = {}
        for name, sid in self.ids.items():
            model = self._ping(sid)
            if model != ct.MODEL_STS3215:
                raise BusError(f"{self.port_name}: servo {sid} ({name}) is model {model}, "
                               f"expected STS3215 ({ct.MODEL_STS3215})")
            firmware[sid] = (self.read("Firmware_Major_Version", sid), self.read("Firmware_Minor_Version", sid))
        # As LeRobot does: one firmware on the whole arm, or the control tables may differ.
        if len(set(firmware.values())) > 1:
            versions = ", ".join(f"{sid}: {a}.{b}" for sid, (a, b) in firmware.items())
            raise BusError(f"{self.port_name}: servos run different firmware ({versions}); update them to one version")
        self.firmware = next(iter(firmware.values()))

    def close(self) -> None:
        if self.port is not None and self.port.is_open:
            try:
                self.port.closePort()
            except Exception:  # noqa: BLE001 - closing an unplugged port
                pass

    def _ping(self, sid: int, tries: int = 5) -> int:
        for k in range(tries):
            out, ok = self._call(self.packets.ping, self.port, sid)
            if ok:
                return out[0]
            time.sleep(0.02 * (k + 1))          # a servo still booting, or a busy host
        raise BusError(f"{self.port_name}: servo {sid} ({self.names[sid]}) does not answer "
                       f"(wrong id, wrong baud rate or not powered?)")

    # ----------------------------------------------------------- registers
    def read(self, register: str, sid: int, tries: int = 3) -> int:
        reg = ct.STS3215[register]
        for _ in range(tries):
            out, ok = self._call(self.packets.readTxRx, self.port, sid, reg.address, reg.size)
            if ok and len(out[0]) == reg.size:
                return ct.from_bytes(reg, out[0])
            self._settle()
        raise BusError(f"{self.port_name}: reading {register} from servo {sid} ({self.names[sid]}) failed")

    def write(self, register: str, sid: int, value: int, tries: int = 3) -> None:
        reg = ct.STS3215[register]
        data = ct.to_bytes(reg, value)
        for _ in range(tries):
            if self._call(self.packets.writeTxRx, self.port, sid, reg.address, reg.size, data)[1]:
                return
            self._settle()
        raise BusError(f"{self.port_name}: writing {register} to servo {sid} ({self.names[sid]}) failed")

    def sync_read(self, register: str, ids: list[int] | None = None, tries: int = 1) -> dict[int, int]:
        """SYNC_READ; every servo must answer, or BusError. In the control loop one try: a
        tick without a fresh reading is the watchdog's business, not a reason to wait."""
        import scservo_sdk as scs

        reg = ct.STS3215[register]
        ids = list(self.ids.values()) if ids is None else ids
        key = (reg.address, reg.size)
        group = self._reads.get(key)
        if group is None:
            group = self._reads[key] = scs.GroupSyncRead(self.port, self.packets, reg.address, reg.size)
        group.clearParam()
        for sid in ids:
            group.addParam(sid)
        for _ in range(tries):
            ok = self._call(group.txRxPacket)[1]
            missing = [sid for sid in ids if not group.isAvailable(sid, reg.address, reg.size)]
            if ok and not missing:
                return {sid: ct.decode(reg, group.getData(sid, reg.address, reg.size)) for sid in ids}
        who = ", ".join(f"{s} ({self.names[s]})" for s in missing) or "?"
        raise BusError(f"{self.port_name}: sync read of {register} failed; no reply from {who}")

    def sync_write(self, register: str, values: dict[int, int]) -> None:
        """One SYNC_WRITE (no replies on the bus by design)."""
        import scservo_sdk as scs

        reg = ct.STS3215[register]
        group = scs.GroupSyncWrite(self.port, self.packets, reg.address, reg.size)
        for sid, value in values.items():
            group.addParam(sid, ct.to_bytes(reg, value))
        if not self._call(group.txPacket)[1]:
            raise BusError(f"{self.port_name}: sync write of {register} failed")

    def read_status(self, sid: int) -> ServoStatus:
        """What SYNC_READ hides: load, voltage, temperature and the error bits of one servo,
        in one READ of addresses 60..65, so that a stale reply to a shorter read (the SDK
        cannot tell) fails the length check instead of passing for a fault. An implausible
        temperature or voltage is ImplausibleStatus (a BusError): the caller decides whether once
        is a garbled reply or a fault."""
        first, last = ct.STS3215["Present_Load"], ct.STS3215["Status"]
        n = last.address + last.size - first.address
        out, ok = self._call(self.packets.readTxRx, self.port, sid, first.address, n)
        if not ok or len(out[0]) != n:
            raise BusError(f"{self.port_name}: status read from servo {sid} ({self.names[sid]}) failed")
        data = out[0]

        def at(name: str) -> int:
            reg = ct.STS3215[name]
            return ct.from_bytes(reg, data[reg.address - first.address:])
        status = ServoStatus(at("Status"), at("Present_Temperature"), at("Present_Load"),
                             at("Present_Voltage") / 10.0)
        (v_lo, v_hi), (t_lo, t_hi) = ct.PLAUSIBLE_VOLTAGE, ct.PLAUSIBLE_TEMPERATURE
        if not (t_lo <= status.temperature <= t_hi and v_lo <= status.voltage <= v_hi):
            raise ImplausibleStatus(f"{self.port_name}: servo {sid} ({self.names[sid]}) reports {status.voltage:.1f} V "
                                    f"and {status.temperature} deg C, which no working servo reports", status)
        return status

    # -------------------------------------------------------------- torque
    def enable_torque(self) -> dict[int, int]:
        """Goal := Present on every servo, then torque on, so nothing jumps to a stale goal.
        Returns the positions it held."""
        present = self.sync_read("Present_Position", tries=3)
        for sid, pos in present.items():
            self.write("Goal_Position", sid, pos)
        for sid in present:
            self.write("Torque_Enable", sid, 1)
        return present

    def torque_off(self, tries: int = 5) -> bool:
        """Torque off on every servo: one broadcast WRITE first (every servo acts on it at
        once, none replies; `torque_off_sent_at` is when it went out), then each servo's
        own write, retried, as confirmation. Never raises (it is what faults end in). True
        when every servo acknowledged."""
        if self.port is None:
            return False
        self.broadcast_torque_off()
        ok = True
        for sid in self.ids.values():
            for _ in range(tries):
                try:
                    done = self._call(self.packets.write1ByteTxRx, self.port, sid,
                                      ct.STS3215["Torque_Enable"].address, 0)[1]
                except Exception:  # noqa: BLE001 - whatever the port does, this must not raise
                    done = False
                if done:
                    break
            else:
                ok = False
        return ok

    def broadcast_torque_off(self) -> float | None:
        """One broadcast WRITE of Torque_Enable = 0: every servo acts on it at once and none
        replies. The one call any thread may make while the bus thread is busy (an e-stop
        must not wait behind a blocked read). Returns when it went out (perf_counter), None
        on a dead port. Never raises."""
        import scservo_sdk as scs

        port = self.port
        if port is None:
            return None
        body = [scs.BROADCAST_ID, 4, scs.INST_WRITE, ct.STS3215["Torque_Enable"].address, 0]
        try:
            port.writePort(bytes([0xFF, 0xFF, *body, ~sum(body) & 0xFF]))
        except Exception:  # noqa: BLE001 - a dead port; the caller's confirmations report it
            return None
        self.torque_off_sent_at = time.perf_counter()
        return self.torque_off_sent_at

    # ------------------------------------------------------------ plumbing
    def _call(self, fn, *args) -> tuple[object, bool]:
        """One SDK transaction on a clean input buffer: (what the SDK returned, success).
        A failed or garbled transaction resets the port; a dead port raises BusError."""
        import termios

        import serial

        try:
            # A late reply to an earlier request must not pass for this request's answer.
            self.port.ser.reset_input_buffer()
            out = fn(*args)
        except (OSError, serial.SerialException, termios.error) as e:   # unplugged adapter, dead pty
            self._recover()
            why = (os.strerror(e.args[0]) if isinstance(e, termios.error) and e.args
                   else str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise BusError(f"{self.port_name}: port failed ({why})") from None
        except (IndexError, TypeError, ValueError):
            # The SDK indexes replies without checking their length: a stale or short
            # reply taken for this one. A failed transaction, not a dead bus.
            self._recover()
            return None, False
        # SDK shapes: int, (result, error) or (value, result, error).
        result = out if isinstance(out, int) else out[1] if len(out) == 3 else out[0]
        if result != 0:
            self._recover()
        return out, result == 0

    def _settle(self, seconds: float = 0.05) -> None:
        """Before retrying a register access: let a late reply to the failed attempt arrive,
        then drop it; otherwise it answers the retry, and the retry's own reply answers the
        next read (same servo, same length: nothing in the protocol tells them apart). Not
        used in the control tick, where a failed read is the watchdog's business."""
        time.sleep(seconds)
        self._recover()

    def _recover(self) -> None:
        # A late reply still in the buffer would be taken as the answer to the next request.
        try:
            self.port.ser.reset_input_buffer()
        except Exception:  # noqa: BLE001 - the port may be gone
            pass
        self.port.is_using = False
