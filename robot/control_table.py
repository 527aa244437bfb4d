"""The Feetech STS3215 control table, as data (after the Feetech memory table and LeRobot's
feetech tables). The bus driver and the emulator both read it; nothing else holds addresses.

Multi-byte values are little-endian (STS, `PacketHandler(0)`). Signed registers use
sign-magnitude with the sign in `sign_bit` (Feetech's SCS_TOSCS/SCS_TOHOST), not two's
complement. Addresses below 40 are EEPROM (kept across power-off only when written with
Lock = 0), from 40 on RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

from soarm.servo import TICKS_PER_REV

EEPROM_END = 40                 # first RAM address
MODEL_STS3215 = 777
TICKS = TICKS_PER_REV           # encoder ticks per turn
MIDDLE = 2047                   # what the homing pose reads after LeRobot's half-turn homing

# What a working STS3215 can report: a supply or temperature reading outside these is a
# garbled reply, or a failing supply or sensor when it persists.
PLAUSIBLE_VOLTAGE = (3.0, 16.0)         # V
PLAUSIBLE_TEMPERATURE = (0, 120)        # deg C

# Status-packet error bits (also the Status register's low bits).
ERR_VOLTAGE, ERR_ANGLE, ERR_OVERHEAT, ERR_OVERCURRENT, ERR_OVERLOAD = 0x01, 0x02, 0x04, 0x08, 0x20


@dataclass(frozen=True)
class Register:
    name: str
    address: int
    size: int                       # bytes
    sign_bit: int | None = None     # sign-magnitude sign bit, None for unsigned
    read_only: bool = False

    @property
    def eeprom(self) -> bool:
        return self.address < EEPROM_END


_REGISTERS = (
    # EEPROM
    Register("Firmware_Major_Version", 0, 1, read_only=True),
    Register("Firmware_Minor_Version", 1, 1, read_only=True),
    Register("Model_Number", 3, 2, read_only=True),
    Register("ID", 5, 1),
    Register("Baud_Rate", 6, 1),
    Register("Return_Delay_Time", 7, 1),
    Register("Response_Status_Level", 8, 1),
    Register("Min_Position_Limit", 9, 2),
    Register("Max_Position_Limit", 11, 2),
    Register("Max_Temperature_Limit", 13, 1),
    Register("Max_Voltage_Limit", 14, 1),
    Register("Min_Voltage_Limit", 15, 1),
    Register("Max_Torque_Limit", 16, 2),
    Register("Phase", 18, 1),
    Register("Unloading_Condition", 19, 1),
    Register("LED_Alarm_Condition", 20, 1),
    Register("P_Coefficient", 21, 1),
    Register("D_Coefficient", 22, 1),
    Register("I_Coefficient", 23, 1),
    Register("Minimum_Startup_Force", 24, 2),
    Register("CW_Dead_Zone", 26, 1),
    Register("CCW_Dead_Zone", 27, 1),
    Register("Protection_Current", 28, 2),
    Register("Angular_Resolution", 30, 1),
    Register("Homing_Offset", 31, 2, sign_bit=11),
    Register("Operating_Mode", 33, 1),
    Register("Protective_Torque", 34, 1),
    Register("Protection_Time", 35, 1),
    Register("Overload_Torque", 36, 1),
    Register("Over_Current_Protection_Time", 38, 1),
    # RAM
    Register("Torque_Enable", 40, 1),
    Register("Acceleration", 41, 1),
    Register("Goal_Position", 42, 2, sign_bit=15),
    Register("Goal_Time", 44, 2),
    Register("Goal_Velocity", 46, 2, sign_bit=15),
    Register("Torque_Limit", 48, 2),
    Register("Lock", 55, 1),
    Register("Present_Position", 56, 2, sign_bit=15, read_only=True),
    Register("Present_Velocity", 58, 2, sign_bit=15, read_only=True),
    Register("Present_Load", 60, 2, sign_bit=10, read_only=True),
    Register("Present_Voltage", 62, 1, read_only=True),
    Register("Present_Temperature", 63, 1, read_only=True),
    Register("Status", 65, 1, read_only=True),
    Register("Moving", 66, 1, read_only=True),
    Register("Present_Current", 69, 2, sign_bit=15, read_only=True),
)
STS3215: dict[str, Register] = {r.name: r for r in _REGISTERS}
BY_ADDRESS: dict[int, Register] = {r.address: r for r in _REGISTERS}

# Factory defaults the emulator powers up with (a fresh servo, before calibration; the values
# of Feetech's STS memory table where it gives one, and for the cut-out's registers those a
# LeRobot SO-101 follower reads back).
DEFAULTS = {
    "Firmware_Major_Version": 3, "Firmware_Minor_Version": 9, "Model_Number": MODEL_STS3215, "ID": 1,
    "Baud_Rate": 0, "Return_Delay_Time": 0, "Response_Status_Level": 1, "Min_Position_Limit": 0,
    "Max_Position_Limit": TICKS - 1, "Max_Temperature_Limit": 70, "Max_Voltage_Limit": 140,
    "Min_Voltage_Limit": 40, "Max_Torque_Limit": 1000, "Unloading_Condition": 44, "LED_Alarm_Condition": 47,
    "P_Coefficient": 16, "D_Coefficient": 32, "I_Coefficient": 0, "Protection_Current": 500,
    "Protective_Torque": 20, "Protection_Time": 200, "Overload_Torque": 80, "Over_Current_Protection_Time": 200,
    "Homing_Offset": 0, "Torque_Limit": 1000, "Acceleration": 254, "Lock": 1, "Present_Voltage": 74,
    "Present_Temperature": 30,
}


def encode(reg: Register, value: int) -> int:
    """Host integer -> register word (sign-magnitude where the register is signed)."""
    value = int(value)
    if reg.sign_bit is not None and value < 0:
        value = (-value) | (1 << reg.sign_bit)
    limit = 1 << (8 * reg.size)
    if not 0 <= value < limit:
        raise ValueError(f"{reg.name}: {value} does not fit in {reg.size} byte(s)")
    return value


def decode(reg: Register, word: int) -> int:
    """Register word -> host integer."""
    if reg.sign_bit is not None and word & (1 << reg.sign_bit):
        return -(word & ~(1 << reg.sign_bit))
    return word


def to_bytes(reg: Register, value: int) -> list[int]:
    word = encode(reg, value)
    return [(word >> (8 * i)) & 0xFF for i in range(reg.size)]


def from_bytes(reg: Register, data) -> int:
    return decode(reg, sum(int(b) << (8 * i) for i, b in enumerate(data[: reg.size])))
