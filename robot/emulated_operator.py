"""A simulated person at the emulated arm (`soarm emulate --operator`), so that `soarm
calibrate` can be tried end to end without an arm."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING

from soarm.robot import control_table as ct

if TYPE_CHECKING:
    from soarm.robot.emulator import ServoBusEmulator


class Operator:
    """A simulated person at the arm for `soarm calibrate` (`soarm emulate --operator`): once
    the host resets the servos' calibration (Homing_Offset 0, limits 0..4095, torque off) it
    holds the arm in the middle pose; once the host writes the homing offsets it sweeps every
    joint to both ends of its travel and back, by hand (the arm is placed, the servos only
    read), then holds the middle again and says so. The sweep's pace is seeded.

    It watches every write as the servos receive it (`observe`, called by the emulator), not
    by polling: LeRobot resets the offsets, reads the middle pose and writes the new offsets
    within a few milliseconds, and the person is taken to be at the middle before the host's
    next read, as one who presses Enter only once there."""

    PERIOD_S = 0.02

    def __init__(self, emu: "ServoBusEmulator", seed: int = 0, log=print):
        self.emu, self.log = emu, log
        r = emu.robot
        middle = [0.0] * len(r.joints)
        lo, hi = list(r.lower), list(r.upper)
        self.path = [middle, [x / 2 for x in lo], lo, lo, [x / 2 for x in hi], hi, hi, middle]   # dwell at the ends
        self.leg_s = random.Random(seed).uniform(0.8, 1.2)      # seconds per leg of the sweep
        self.phase, self.t0 = "idle", 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="emulated-operator", daemon=True)

    def start(self) -> "Operator":
        self.emu.write_hooks.append(self.observe)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self.observe in self.emu.write_hooks:
            self.emu.write_hooks.remove(self.observe)

    def observe(self) -> None:
        """After each write, in the emulator's bus thread with its lock held."""
        servos = list(self.emu.servos.values())
        reset = all(s.get("Homing_Offset") == 0 and s.get("Max_Position_Limit") == ct.TICKS - 1
                    and s.get("Torque_Enable") == 0 for s in servos)
        homed = any(s.get("Homing_Offset") != 0 for s in servos)
        if self.phase in ("idle", "done") and reset:
            self.phase = "middle"
            self.emu.plant.place(self.path[0])          # there before the host reads the pose
            self.emu.refresh()
            self.log("operator: holding the arm in the middle pose", flush=True)
        elif self.phase == "middle" and homed:
            self.phase, self.t0 = "sweep", time.monotonic()
            self.log("operator: sweeping every joint through its range", flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            if self.phase == "middle":
                self.emu.place(self.path[0])
            elif self.phase == "sweep":
                k, f = divmod((time.monotonic() - self.t0) / self.leg_s, 1.0)
                k = int(k)
                if k + 1 >= len(self.path):
                    self.emu.place(self.path[-1])
                    self.phase = "done"
                    self.log("operator: sweep done; the arm is back in the middle", flush=True)
                else:
                    a, b = self.path[k], self.path[k + 1]
                    self.emu.place([x + f * (y - x) for x, y in zip(a, b)])
