"""Commands of the "fit the model to my arm" room: `soarm calibrate`, `excite`, `sysid`,
`arm-check`, `servo-fit`, `servo-check`, `transfer`."""

from __future__ import annotations

import time
from pathlib import Path

from soarm import REPO_ROOT, config


def register(sub) -> None:
    from soarm.calibration.arm_check import ArmCheckCfg
    from soarm.calibration.excite import ExcitationCfg
    from soarm.calibration.servo_fit import ServoFitCfg
    from soarm.calibration.sysid import SysidCfg
    from soarm.calibration.transfer import TransferCfg

    p = sub.add_parser("calibrate", help="LeRobot's SO-101 calibration on the arm")
    p.add_argument("--port", required=True, help="serial port of the servo adapter, e.g. /dev/ttyACM0")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "configs" / "calibration" / "so101.json")
    p.set_defaults(fn=_calibrate)

    def excitation_flags(p, needed: bool) -> None:
        p.add_argument("--port", required=needed, default=None,
                       help="serial port of the servo adapter, e.g. /dev/ttyACM0")
        p.add_argument("--calibration", type=Path, required=needed, default=None, help="LeRobot calibration JSON")
        p.add_argument("--policy", type=Path, default=REPO_ROOT / "data" / "policies" / "reach.onnx",
                       help="the policy whose contract names the joints and the control rate (it does not act)")
        p.add_argument("--joints", default=None, help="comma-separated arm joints (default: all)")
        config.add_flags(p, ExcitationCfg)
        p.add_argument("--dry-run", action="store_true", help="print the plan; open no port, move nothing")

    p = sub.add_parser("excite", help="the identification excitation on the arm: chirps and steps, logged")
    excitation_flags(p, needed=True)
    p.add_argument("--log-dir", type=Path, default=None, help="where the MCAP encoder log goes (runs/excite)")
    p.set_defaults(fn=_excite)

    p = sub.add_parser("sysid", help="identify the arm (gain, friction, stiction, armature, dead-band, mass, "
                                     "backlash, latency) for training")
    p.add_argument("logs", nargs="*", type=Path, help="logs to fit (none: --port/--calibration run `soarm excite` "
                                                      "first and fit its log)")
    excitation_flags(p, needed=False)
    p.add_argument("--out", type=Path, default=None,
                   help="directory for arm.yaml, sysid.json, sysid.png (runs/sysid/<time>)")
    config.add_flags(p, SysidCfg)
    p.set_defaults(fn=_sysid)

    p = sub.add_parser("arm-check", help="how far a model of the arm is from the arm, on logs of its motion")
    p.add_argument("logs", nargs="+", type=Path,
                   help="SAGE motion folders, LeRobot datasets (each episode), encoder logs (.mcap)")
    config.add_flags(p, ArmCheckCfg)
    p.set_defaults(fn=_arm_check)

    p = sub.add_parser("servo-fit", help="fit the servo model and a PD baseline on bench logs")
    config.add_flags(p, ServoFitCfg)
    p.set_defaults(fn=_servo_fit)

    p = sub.add_parser("servo-check", help="RMS of both fitted models on bench logs (e.g. unseen ones)")
    p.add_argument("logs", nargs="*", type=Path, default=ServoFitCfg().logs)
    p.add_argument("--fit", type=Path, default=ServoFitCfg().out)
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(fn=_servo_check)

    p = sub.add_parser("transfer", help="a policy as on the arm, on other plants than its training plant")
    p.add_argument("policy", type=Path, help="exported policy (.onnx), or 'scripted': the scripted controller")
    config.add_flags(p, TransferCfg)
    p.set_defaults(fn=_transfer)


def _calibrate(args) -> int:
    from soarm.calibration import calibration

    cal = calibration.calibrate_on_port(str(args.port), args.out)
    for n, c in cal.items():
        print(f"  {n:14s} id {c.id}  homing_offset {c.homing_offset:5d}  range {c.range_min}..{c.range_max}")
    print(f"wrote {args.out} (LeRobot format)")
    return 0


def _excite(args) -> int:
    from soarm.calibration.excite import ExcitationCfg, excite_arm

    report = excite_arm(args.port, args.calibration, args.policy, config.from_flags(ExcitationCfg, args),
                        args.joints.split(",") if args.joints else None,
                        args.log_dir or REPO_ROOT / "runs" / "excite", args.dry_run)
    return 1 if report.fault else 0


def _sysid(args) -> int:
    from soarm.calibration.excite import ExcitationCfg, excite_arm
    from soarm.calibration.sysid import DEFAULT_OUT, SysidCfg, sysid

    cfg = config.from_flags(SysidCfg, args)              # checked before any motion or minute of fitting
    out = args.out or DEFAULT_OUT / time.strftime("%Y-%m-%d_%H-%M-%S")
    logs = list(args.logs)
    if not logs:
        if args.port is None or args.calibration is None:
            raise config.ConfigError("give logs to fit, or --port and --calibration to record them first")
        report = excite_arm(args.port, args.calibration, args.policy, config.from_flags(ExcitationCfg, args),
                            args.joints.split(",") if args.joints else None, out / "logs", args.dry_run)
        if report.fault or args.dry_run:
            return 1 if report.fault else 0
        logs = report.logs
    sysid(logs, out, cfg)
    return 0


def _arm_check(args) -> int:
    import sys

    from soarm.calibration.arm_check import ArmCheckCfg, arm_check

    arm_check(args.logs, config.from_flags(ArmCheckCfg, args), progress=lambda line: print(line, file=sys.stderr))
    return 0


def _servo_fit(args) -> int:
    from soarm.calibration.servo_fit import ServoFitCfg, servo_fit

    return servo_fit(config.from_flags(ServoFitCfg, args))


def _servo_check(args) -> int:
    from soarm.calibration.servo_fit import servo_check

    return servo_check(args.logs, args.fit, args.plot)


def _transfer(args) -> int:
    from soarm.calibration.transfer import TransferCfg, transfer

    transfer(args.policy, config.from_flags(TransferCfg, args))
    return 0
