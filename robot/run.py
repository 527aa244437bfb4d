"""`soarm run`: a policy on the arm without ROS, through the driver the ROS node runs.

Checks every target first, connects, enables (the arm holds where it is), reaches for each
target in turn for `hold_s` seconds, printing the fingertip error once a second, then parks
and turns torque off. Ctrl-C at any point parks and turns torque off as `disable` does (Ctrl-C
again while it parks: torque off at once, where the arm is); a fault ends the run with torque
off and the reason.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from soarm.dynamics import ArmDynamics
from soarm.robot.bus import BusError
from soarm.robot.driver import FAULT, DriverCfg, JointSample, ReachDriver

CONNECT_TIMEOUT_S = 15.0


@dataclass
class RunReport:
    targets: list[list[float]]
    start_errors_m: list[float] = field(default_factory=list)   # fingertip error as each target was given
    errors_m: list[float] = field(default_factory=list)          # ... and at the end of its hold
    fault: str = ""                                          # why the run ended early; "" if it did not

    def summary(self) -> str:
        if not self.errors_m:
            return f"no target reached{': ' + self.fault if self.fault else ''}"
        mm = np.array(self.errors_m) * 1000
        done = f"{len(mm)}/{len(self.targets)} targets, fingertip error mean {mm.mean():.1f} mm, max {mm.max():.1f} mm"
        return done + (f"; stopped: {self.fault}" if self.fault else "; parked, torque off")


class _Fingertip:
    """The latest joint reading from the bus thread, as a fingertip position."""

    def __init__(self, driver: ReachDriver):
        self.dyn = ArmDynamics(driver.robot, dtype=torch.float64)
        self._q: list[float] | None = None
        self._lock = threading.Lock()

    def on_state(self, sample: JointSample) -> None:
        with self._lock:
            self._q = sample.positions

    def error(self, xyz: np.ndarray) -> float | None:
        with self._lock:
            q = self._q
        if q is None:
            return None
        tip = self.dyn.fingertip(torch.tensor([q], dtype=torch.float64))[0].numpy()
        return float(np.linalg.norm(tip - xyz))


def run(cfg: DriverCfg, targets: list[list[float]], hold_s: float,
        out: Callable[[str], None] = print) -> RunReport:
    """Raises a one-line ValueError (a bad target or file) or BusError (no arm) before the
    arm is enabled; afterwards every outcome is in the report."""
    driver = ReachDriver(cfg, on_event=lambda level, msg: out(f"{level}: {msg}"))
    checked = [driver.runtime.check_target(t, None) for t in targets]          # all, before anything moves
    tip = _Fingertip(driver)
    driver.on_state = tip.on_state
    report = RunReport([list(map(float, t)) for t in checked])
    try:
        start_enabled(driver)
        _reach(driver, tip, checked, hold_s, report, out)
    except KeyboardInterrupt:
        report.fault = "interrupted (Ctrl-C); parked, torque off"
    finally:
        driver.close()                          # parks when enabled, then torque off
    if driver.park_cut_short:
        report.fault = "interrupted again while parking (Ctrl-C twice): torque off where the arm was"
    return report


def start_enabled(driver: ReachDriver) -> None:
    """Start the bus thread, wait for the arm, enable (it holds where it is); BusError if not."""
    driver.start()
    if not driver.wait_ready(CONNECT_TIMEOUT_S):
        raise BusError(f"{driver.cfg.port}: no answer from the bus thread within {CONNECT_TIMEOUT_S:.0f} s")
    if not driver.connected:
        raise BusError(driver.reason)
    ok, msg = driver.enable()
    if not ok:
        raise BusError(msg)


def _reach(driver: ReachDriver, tip: _Fingertip, targets: list[np.ndarray], hold_s: float,
           report: RunReport, out: Callable[[str], None]) -> None:
    pace = threading.Event()                    # never set: a wait that Ctrl-C interrupts
    for i, xyz in enumerate(targets):
        report.start_errors_m.append(tip.error(xyz))
        driver.set_target(xyz)
        t0 = time.monotonic()
        while (left := hold_s - (time.monotonic() - t0)) > 0 and driver.state != FAULT:
            pace.wait(min(1.0, left))
            err = tip.error(xyz)
            out(f"target {i + 1}/{len(targets)} {np.round(xyz, 3).tolist()}: "
                f"{time.monotonic() - t0:4.1f} s, fingertip error " + ("-" if err is None else f"{err * 1000:.1f} mm"))
        if driver.state == FAULT:
            report.fault = driver.reason
            return
        report.errors_m.append(tip.error(xyz))
