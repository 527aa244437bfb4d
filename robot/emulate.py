"""`soarm emulate`: an emulated SO-101 served on a pseudo-terminal until told to stop.

    serve(EmulateCfg(calibrate=Path("cal.json"), link=Path("/tmp/so101")), stop=threading.Event())

It assembles the arm (at seeded offsets, or as an existing LeRobot calibration file describes
it), optionally calibrates it with the scripted LeRobot procedure, puts a simulated person at
it for `soarm calibrate`, announces the port (a line, a symlink, a ready file for scripts) and
prints the bus counters until `stop` is set.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from soarm.config import ConfigError
from soarm.files import atomic_write
from soarm.robot.emulator import FaultCfg, ServoBusEmulator


@dataclass
class EmulateCfg:
    seed: int = 0                          # assembly offsets, fault draws, the operator's pace
    faults: FaultCfg = field(default_factory=FaultCfg)
    plant: str = "armsim"                  # or "mujoco": the published MJCF
    compile: bool = True                   # torch.compile the plant's physics step
    calibrate: Path | None = None          # calibrate first and write this new file
    calibration: Path | None = None        # assemble the arm as this existing file says (only read)
    perturb: int | None = None             # an arm unlike the nominal one, drawn from this seed, hidden
    reveal: Path | None = None             # with perturb: write the arm drawn here (an arm YAML, soarm/arm_params.py)
    operator: bool = False                 # a simulated person at the arm
    link: Path | None = None               # a symlink to the pty
    ready_file: Path | None = None         # {"port", "pid"} written once serving
    quiet: bool = False                    # no counters every 5 s

    def validate(self) -> None:
        if self.calibrate and self.calibrate.exists():
            raise ConfigError(f"{self.calibrate} exists; --calibrate writes a new file and never overwrites one "
                              "(to run the emulated arm on an existing calibration: --calibration FILE)")
        if self.perturb is not None and self.plant != "armsim":
            raise ConfigError(f"--perturb: the perturbed plant is armsim, not {self.plant}")
        if self.reveal and self.perturb is None:
            raise ConfigError("--reveal: only with --perturb SEED")


def serve(cfg: EmulateCfg, stop: threading.Event,
          started: Callable[[ServoBusEmulator], None] = lambda emu: None) -> dict:
    """Serve until `stop` is set; the bus counters at the end. `started(emu)` runs once the
    arm is on the line (the CLI hooks its unplug signal there)."""
    from soarm.description import load_robot

    cfg.validate()
    robot = load_robot()
    arm = None
    if cfg.perturb is not None:
        from soarm import CONFIG_DIR, config
        from soarm.arm_params import ArmParams
        from soarm.reach import ReachCfg

        arm = ArmParams.random(cfg.perturb, robot, config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml").servo)
        if cfg.reveal:
            config.dump(arm, cfg.reveal)
    cal = None
    if cfg.calibration:
        from soarm.calibration import calibration

        cal = calibration.load(cfg.calibration, robot.names)
    with ServoBusEmulator(faults=cfg.faults, seed=cfg.seed, compile=cfg.compile, plant=cfg.plant,
                          arm=arm) as emu:
        started(emu)
        if cal is not None:
            emu.assemble_as(cal)
            print(f"emulated arm assembled as {cfg.calibration} describes (the file is only read)", flush=True)
        if cfg.calibrate:
            _self_calibrate(emu, cfg.calibrate)
            # The procedure leaves the arm let go at its middle pose; announced only once it
            # has fallen to rest, as a calibrated arm is found (a client must not meet it mid-fall).
            emu.settle()
        operator = None
        if cfg.operator:           # someone at the arm for `soarm calibrate`
            from soarm.robot.emulated_operator import Operator

            operator = Operator(emu, seed=cfg.seed).start()
        port = emu.port
        if cfg.link:
            atomic_write(cfg.link, lambda tmp: tmp.symlink_to(emu.port))
            port = f"{cfg.link} -> {emu.port}"
        if cfg.ready_file:          # the machine-readable handshake (EmulatorProcess reads it)
            atomic_write(cfg.ready_file, lambda tmp: tmp.write_text(json.dumps({"port": emu.port, "pid": os.getpid()})))
        physics = cfg.plant + (f", perturbed (seed {cfg.perturb}, hidden)" if arm else "")
        print(f"SO-101 servo bus (ids 1-6, STS3215, 1 Mbaud, {physics} physics) on {port}; Ctrl-C to stop",
              flush=True)
        try:
            while not stop.wait(5):
                if not cfg.quiet:
                    print(f"  {emu.counters}, physics {emu.plant.state().lag_s:.1f} s behind real time", flush=True)
            print(f"stopped; {emu.counters}, physics {emu.plant.state().lag_s:.2f} s behind real time", flush=True)
        finally:
            if operator is not None:
                operator.stop()
            if cfg.link:
                cfg.link.unlink(missing_ok=True)
        return dict(emu.counters)


def _self_calibrate(emu: ServoBusEmulator, out: Path) -> None:
    """The LeRobot procedure run against the emulated arm (operator's moves scripted), so
    its servos hold homing offsets and limits and `out` is their calibration file."""
    from soarm.calibration import calibration
    from soarm.robot.bus import FeetechBus

    bus = FeetechBus(emu.port, {n: i + 1 for i, n in enumerate(emu.robot.names)})
    bus.connect()
    try:
        cal = calibration.calibrate_emulated(emu, bus, emu.robot)
    finally:
        bus.close()
    calibration.save(cal, out)
    print(f"calibrated the emulated arm: {out}", flush=True)
