"""The servo side of the Feetech SCS/STS v1 protocol, as the emulator speaks it: instruction
codes, packet framing and checksums, and one servo's control-table memory
(robot/control_table.py)."""

from __future__ import annotations

from soarm.robot import control_table as ct

PING, READ, WRITE, REG_WRITE, ACTION, SYNC_READ, SYNC_WRITE = 1, 2, 3, 4, 5, 0x82, 0x83
# Baud_Rate register value -> line speed, as Feetech's STS memory table gives it (address 6);
# 0 (1 Mbaud) from the factory. LeRobot 0.6.1's table differs for 5-7 (57600, 38400, 19200).
BAUD_RATES = {0: 1_000_000, 1: 500_000, 2: 250_000, 3: 128_000, 4: 115_200, 5: 76_800, 6: 57_600, 7: 38_400}
BROADCAST = 0xFE

def checksum(body) -> int:
    return ~sum(body) & 0xFF


def status_packet(servo_id: int, error: int, params=()) -> bytes:
    body = [servo_id, len(params) + 2, error, *params]
    return bytes([0xFF, 0xFF, *body, checksum(body)])


class Servo:
    """One servo's control-table memory: the working copy every read and write sees, and the
    EEPROM bytes it powers up with (`saved`).

    Feetech's STS memory table (address 55, Lock): a write to an EEPROM address always takes
    effect; Lock = 0 also keeps it across a power cycle, Lock = 1 (as powered up) does not."""

    def __init__(self, servo_id: int):
        self.mem = bytearray(256)
        for name, value in ct.DEFAULTS.items():
            self.set(name, value)
        self.set("ID", servo_id)
        self.saved = bytes(self.mem[:ct.EEPROM_END])
        self.pending: tuple[int, bytes] | None = None      # REG_WRITE waiting for ACTION

    def save(self) -> None:
        """Keep the working EEPROM bytes across a power cycle (a write made while Lock = 0)."""
        self.saved = bytes(self.mem[:ct.EEPROM_END])

    def power_cycle(self) -> None:
        """Power off and on: RAM back to its power-up values, EEPROM to what was saved;
        Torque_Limit starts at Max_Torque_Limit."""
        self.mem = bytearray(256)
        for name, value in ct.DEFAULTS.items():
            self.set(name, value)
        self.mem[:ct.EEPROM_END] = self.saved
        self.set("Torque_Limit", self.get("Max_Torque_Limit"))
        self.pending = None

    def get(self, name: str) -> int:
        reg = ct.STS3215[name]
        return ct.from_bytes(reg, self.mem[reg.address:reg.address + reg.size])

    def set(self, name: str, value: int) -> None:
        reg = ct.STS3215[name]
        self.mem[reg.address:reg.address + reg.size] = bytes(ct.to_bytes(reg, value))


def split_packets(buf: bytearray, counters: dict[str, int]):
    """Complete packets with a valid checksum, taken off the front of `buf`; a bad checksum
    is counted (`counters["bad_checksum"]`) and dropped, as a real servo ignores it. What is
    left in `buf` is the start of a packet still arriving (`drop_header` gives up on it when the
    rest never comes).

    A header is two 0xFF bytes and an id that is not 0xFF: a run of stray 0xFF bytes resyncs
    on its last pair instead of reading a stray byte as the packet's length."""
    while True:
        start = buf.find(b"\xff\xff")
        if start < 0:
            del buf[:max(0, len(buf) - 1)]
            return
        del buf[:start]
        while len(buf) > 2 and buf[2] == 0xFF:
            del buf[0]
        if len(buf) < 4:
            return
        if buf[3] < 2:                                    # no instruction: not a packet
            counters["malformed"] += 1
            del buf[:2]
            continue
        total = buf[3] + 4
        if len(buf) < total:
            return
        packet = bytes(buf[:total])
        del buf[:total]
        if packet[-1] != checksum(packet[2:-1]):
            counters["bad_checksum"] += 1
            continue
        yield packet


# Longest a packet's bytes may take to arrive: a whole 255-byte packet is 2.6 ms at 1 Mbaud
# (27 ms at 115200 baud, 66 ms at the slowest rate); a servo drops a packet whose rest does
# not come, so one lost byte cannot swallow the packets after it.
PACKET_TIMEOUT_S = 0.1


def drop_header(buf: bytearray, counters: dict[str, int]) -> None:
    """Give up on the packet at the front of `buf` (its rest did not come within
    PACKET_TIMEOUT_S), so that `split_packets` looks for the next header."""
    counters["malformed"] += 1
    del buf[:2]
