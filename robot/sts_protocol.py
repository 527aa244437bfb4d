"""The servo side of the Feetech SCS/STS v1 protocol, as the emulator speaks it: instruction
codes, packet framing and checksums, and one servo's control-table memory
(robot/control_table.py)."""

from __future__ import annotations

from soarm.robot import control_table as ct

PING, READ, WRITE, REG_WRITE, ACTION, SYNC_READ, SYNC_WRITE = 1, 2, 3, 4, 5, 0x82, 0x83
# Baud_Rate register value -> line speed (the STS3215 manual's table); 0 (1 Mbaud) from the factory.
BAUD_RATES = {0: 1_000_000, 1: 500_000, 2: 250_000, 3: 128_000, 4: 115_200, 5: 76_800, 6: 57_600, 7: 38_400}
BROADCAST = 0xFE

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


def split_packets(buf: bytearray, counters: dict[str, int]):
    """Complete packets with a valid checksum, taken off the front of `buf`; a bad checksum
    is counted (`counters["bad_checksum"]`) and dropped, as a real servo ignores it. What is
    left in `buf` is the start of a packet still arriving."""
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
            counters["bad_checksum"] += 1
            continue
        yield packet
