"""The STS3215 firmware's overload and overcurrent cut-out, for the emulated servos.

Feetech's STS memory table (the registers' meanings and units; the defaults as a LeRobot
SO-101 follower reads them back):
    Overload_Torque (36)          %, duty above which the overload timer runs (default 80)
    Protection_Time (35)          10 ms, how long the duty must stay above it (default 200: 2 s)
    Protective_Torque (34)        %, the torque an overloaded servo is then held to (default 20)
    Protection_Current (28)       6.5 mA, motor current above which the overcurrent timer runs
                                  (default 500: 3.25 A; LeRobot writes 250 to the gripper)
    Over_Current_Protection_Time (38)  10 ms, how long the current must stay above it (default 200)
    Unloading_Condition (19)      which faults act (bits as Status: 0x08 overcurrent,
                                  0x20 overload; default 44 = 0x2C)

A fault sets its Status bit whether or not it acts. Acting, an overload holds the drive to
Protective_Torque and an overcurrent turns the drive off (the emulator then reads
Torque_Enable 0). Decided where the table is silent: both are latched until the host turns
torque on again (off, then on), which clears the bits and the timers; a timer restarts
whenever its condition lapses.
"""

from __future__ import annotations

import numpy as np

from soarm.robot.control_table import ERR_OVERCURRENT, ERR_OVERLOAD

# The registers the physics process needs, in the order it receives them.
REGISTERS = ("Unloading_Condition", "Overload_Torque", "Protection_Time", "Protective_Torque",
             "Protection_Current", "Over_Current_Protection_Time")
TIME_UNIT_S = 0.01             # s per unit of Protection_Time and Over_Current_Protection_Time
CURRENT_UNIT_A = 0.0065        # A per unit of Protection_Current and Present_Current


class Protection:
    """Per-joint state of the cut-out for J servos."""

    def __init__(self, joints: int):
        self.status = np.zeros(joints, dtype=np.int64)       # latched Status bits
        self._over_load_since = np.full(joints, np.nan)      # s (simulated) the condition began
        self._over_current_since = np.full(joints, np.nan)
        self._unload = np.zeros(joints, dtype=np.int64)      # Unloading_Condition, as last written

    def update(self, t: float, duty: np.ndarray, current_a: np.ndarray, on: np.ndarray,
               registers: np.ndarray) -> None:
        """Advance to simulated time t (s) with each servo's duty (fraction of full), motor
        current (A) and torque switch; `registers` [len(REGISTERS), J] as the host wrote them."""
        unload, overload_pct, overload_time, _, limit_current, current_time = registers
        self._over_load_since = self._watch(t, on & (np.abs(duty) * 100.0 > overload_pct),
                                            self._over_load_since, overload_time, ERR_OVERLOAD)
        self._over_current_since = self._watch(t, on & (np.abs(current_a) > limit_current * CURRENT_UNIT_A),
                                               self._over_current_since, current_time, ERR_OVERCURRENT)
        self._unload = unload.astype(np.int64)

    def _watch(self, t: float, over: np.ndarray, since: np.ndarray, time_units: np.ndarray, bit: int) -> np.ndarray:
        since = np.where(over, np.where(np.isnan(since), t, since), np.nan)
        tripped = over & (t - since >= time_units * TIME_UNIT_S - 1e-9)
        self.status[tripped] |= bit
        return since

    def clear(self, joints: np.ndarray) -> None:
        """Torque switched on again at `joints` (bool [J]): the servo starts afresh."""
        self.status[joints] = 0
        self._over_load_since[joints] = np.nan
        self._over_current_since[joints] = np.nan

    def acting(self, bit: int) -> np.ndarray:
        """Joints where the fault `bit` is latched and Unloading_Condition lets it act."""
        return (self.status & bit).astype(bool) & (self._unload & bit).astype(bool)

    def torque_limit(self, written: np.ndarray, registers: np.ndarray) -> np.ndarray:
        """The Torque_Limit in force (0.1 %): an acting overload holds it to Protective_Torque."""
        protective = registers[REGISTERS.index("Protective_Torque")] * 10.0
        return np.where(self.acting(ERR_OVERLOAD), np.minimum(written, protective), written)

    def cut(self) -> np.ndarray:
        """Joints whose drive an acting overcurrent has turned off."""
        return self.acting(ERR_OVERCURRENT)
