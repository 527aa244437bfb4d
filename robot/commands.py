"""The robot stage's commands: `soarm emulate`, `soarm run`, `soarm replay`."""

from __future__ import annotations

from pathlib import Path

from soarm import config
from soarm.robot.bus import BusError

ERRORS = (BusError,)            # besides ValueError: what the CLI reports as one line


def register(sub) -> None:
    from soarm.robot.emulate import EmulateCfg
    from soarm.robot.emulator import FaultCfg

    p = sub.add_parser("emulate", help="a simulated SO-101 servo bus on a pseudo-terminal",
                       description="A simulated SO-101 servo bus on a pseudo-terminal. Ctrl-C or SIGTERM "
                                   "stops it; SIGUSR1 pulls the adapter out (kill -USR1 PID: the port stops "
                                   "answering, as an unplugged arm).")
    config.add_flags(p, EmulateCfg, skip=("faults", "calibrate", "calibration"))
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", type=Path, default=None, metavar="FILE",
                     help="calibrate the emulated arm first (scripted LeRobot procedure) and save a new FILE")
    cal.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                     help="an existing (LeRobot) calibration file: the emulated arm is assembled to match it; "
                          "the file is only read")
    config.add_flags(p, FaultCfg, skip=("seed",))          # the faults draw from --seed
    p.set_defaults(fn=_emulate)

    p = sub.add_parser("run", help="a policy on the arm without ROS: enable, reach for targets, park")
    p.add_argument("--port", required=True, help="serial port of the servo adapter, e.g. /dev/ttyACM0")
    p.add_argument("--policy", type=Path, required=True, help="exported policy (.onnx)")
    p.add_argument("--calibration", type=Path, required=True, help="LeRobot calibration JSON")
    p.add_argument("--target", type=float, nargs=3, action="append", required=True, metavar=("X", "Y", "Z"),
                   help="fingertip target in the base frame, m; repeat for a sequence")
    p.add_argument("--hold", type=float, default=3.0, help="seconds per target")
    p.add_argument("--log-dir", type=Path, default=None, help="write an MCAP encoder log of the run here")
    p.set_defaults(fn=_run)

    p = sub.add_parser("replay", help="re-run an encoder log through observation, policy and safety")
    p.add_argument("log", type=Path, help="encoder log (.mcap) or a BAM servo log (.json)")
    p.add_argument("--policy", type=Path, required=True, help="exported policy (.onnx)")
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(fn=_replay)


def _emulate(args) -> int:
    import dataclasses
    import signal
    import threading

    from soarm.robot.emulate import EmulateCfg, serve
    from soarm.robot.emulator import FaultCfg

    stop = threading.Event()
    # SIGTERM (service managers, ROS launch) ends the emulator as Ctrl-C does; SIGUSR1 pulls
    # the adapter out (fault tests on a separate emulator process).
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cfg = config.from_flags(EmulateCfg, args)
    faults = dataclasses.replace(config.from_flags(FaultCfg, args), seed=cfg.seed)
    cfg = dataclasses.replace(cfg, faults=faults, calibrate=args.calibrate, calibration=args.calibration)
    serve(cfg, stop, started=lambda emu: signal.signal(signal.SIGUSR1, lambda *_: emu.unplug()))
    return 0


def _run(args) -> int:
    from soarm.robot.driver import DriverCfg
    from soarm.robot.run import run

    cfg = DriverCfg(port=args.port, policy=str(args.policy), calibration=str(args.calibration),
                    log_dir=str(args.log_dir or ""))
    report = run(cfg, args.target, args.hold)
    print(f"soarm run: {report.summary()}")
    return 1 if report.fault else 0


def _replay(args) -> int:
    from soarm.export.runtime import PolicyRuntime
    from soarm.robot import replay

    header, ticks = replay.load_any(args.log)
    report = replay.replay_decisions(header, ticks, PolicyRuntime(args.policy), where=str(args.log))
    if args.plot:
        replay.plot(report, args.plot)
    shown = {k: v for k, v in report.items() if not k.startswith("_")}
    print(f"replay of {args.log} ({shown['source']}) with {args.policy}: {shown['ticks_differing']} of "
          f"{shown['ticks']} ticks differ by more than {shown['tolerance_rad']:.0e} rad "
          f"(max {shown['max_abs_diff_rad']:.2e} rad, first at tick {shown['first_difference_tick']}); "
          f"clamp events differ on {shown['events_differing']} ticks (recomputed: {shown['events'] or 'none'})"
          + (f"; plot {args.plot}" if args.plot else ""))
    return 0
