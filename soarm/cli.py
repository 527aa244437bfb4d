"""`soarm`: the project's one command line.

    soarm train        train a reach policy with PPO on the embedded sim
    soarm export       checkpoint -> self-describing ONNX policy (verified against torch)
    soarm evaluate     accuracy of a reach policy (ONNX, checkpoint or scripted) in the embedded sim
    soarm emulate      a simulated SO-101 servo bus on a pseudo-terminal, for the Feetech SDK
    soarm calibrate    LeRobot's SO-101 calibration on the arm (writes the servos' EEPROM and a JSON file)
    soarm run          a policy on the arm without ROS: enable, reach for targets, park
    soarm excite       the identification excitation on the arm (chirps and steps), logged
    soarm sysid        identify the arm from those logs: a YAML `soarm train` centres on
    soarm replay       an encoder log through observation + policy + safety, against what was sent
    soarm transfer     a policy as on the arm, on plants other than its training plant (MuJoCo included)
    soarm servo-fit    fit the servo model and the PD baseline on real bench logs
    soarm servo-check  compare both fitted models on (new) bench logs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from soarm import CONFIG_DIR, REPO_ROOT
from soarm.config import ConfigError
from soarm.robot.bus import BusError

DEFAULT_LOGS = sorted((REPO_ROOT / "data" / "real_servo_logs").glob("*.json"))
DEFAULT_FIT = CONFIG_DIR / "servo" / "sts3250_bench_fit.yaml"


def _train(args) -> int:
    import yaml

    from soarm.training.runner import TrainingDiverged
    from soarm.training.train import train

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    for key, value in (("run.num_envs", args.num_envs), ("run.iterations", args.iterations),
                       ("run.device", args.device), ("run.seed", args.seed), ("run.name", args.name),
                       ("run.sim", args.sim)):
        if value is not None:
            overrides[key] = value
    if args.no_compile:
        overrides["run.compile"] = False
    try:
        train(args.config, overrides, args.resume)
    except TrainingDiverged as e:
        print(f"soarm train: error: {e}", file=sys.stderr)
        return 3
    return 0


def _evaluate(args) -> int:
    import torch

    from soarm.export import policies
    from soarm.training.evaluate import evaluate, summary, write_report

    torch.set_num_threads(args.threads)
    policy = policies.load(args.policy, args.task)
    print(f"evaluating {policy.name} on {args.targets} targets")
    t0 = time.time()
    with torch.no_grad():
        result = evaluate(policy.act, policy.task, targets=args.targets, seed=args.seed)
    result["policy"] = str(args.policy)
    write_report(result, args.out)
    print(f"{summary(result)}  [{time.time() - t0:.1f} s, report {args.out}]")
    return 0


def _export(args) -> int:
    from soarm.export.exporter import TOLERANCE, export
    from soarm.training import checkpoint

    out = args.out or checkpoint.resolve(args.source).parent / "policy.onnx"
    print(f"exporting {args.source} -> {out}")
    r = export(args.source, out, verify_count=args.verify)
    print(f"verified on {r['observations']} observations: max |torch - onnxruntime| = {r['parity_max_abs']:.2e} "
          f"(tolerance {TOLERANCE:.0e})")
    print(f"wrote {r['path']} ({r['bytes'] / 1024:.0f} KiB, iteration {r['iteration']} of {r['checkpoint']})")
    return 0


def _emulate(args) -> int:
    import signal
    import threading

    from soarm.robot.emulate import EmulateCfg, serve
    from soarm.robot.emulator import FaultCfg

    stop = threading.Event()
    # SIGTERM (service managers, ROS launch) ends the emulator as Ctrl-C does; SIGUSR1 pulls
    # the adapter out (fault tests on a separate emulator process).
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    faults = FaultCfg(drop=args.drop, late=args.late, corrupt=args.corrupt, error_bits=args.error_bits,
                      silent_ids=tuple(args.silent), seed=args.seed)
    cfg = EmulateCfg(seed=args.seed, faults=faults, plant=args.plant, compile=not args.no_compile,
                     calibrate=args.calibrate, calibration=args.calibration, perturb=args.perturb, reveal=args.reveal,
                     operator=args.operator, link=args.link, ready_file=args.ready_file, quiet=args.quiet)
    serve(cfg, stop, started=lambda emu: signal.signal(signal.SIGUSR1, lambda *_: emu.unplug()))
    return 0


def _calibrate(args) -> int:
    from soarm.calibration import calibration

    cal = calibration.calibrate_on_port(str(args.port), args.out)
    for n, c in cal.items():
        print(f"  {n:14s} id {c.id}  homing_offset {c.homing_offset:5d}  range {c.range_min}..{c.range_max}")
    print(f"wrote {args.out} (LeRobot format)")
    return 0


def _transfer(args) -> int:
    from soarm.robot.transfer import transfer

    transfer(args.policy, args.plants, args.targets, args.seed, args.out, args.task)
    return 0


def _replay(args) -> int:
    from soarm.export.runtime import PolicyRuntime
    from soarm.robot import replay

    header, ticks = replay.load_any(args.log)
    report = replay.replay(header, ticks, PolicyRuntime(args.policy), where=str(args.log))
    if args.plot:
        replay.plot(report, args.plot)
    shown = {k: v for k, v in report.items() if not k.startswith("_")}
    print(f"replay of {args.log} ({shown['source']}) with {args.policy}: {shown['ticks_differing']} of "
          f"{shown['ticks']} ticks differ by more than {shown['tolerance_rad']:.0e} rad "
          f"(max {shown['max_abs_diff_rad']:.2e} rad, first at tick {shown['first_difference_tick']}); "
          f"clamp events differ on {shown['events_differing']} ticks (recomputed: {shown['events'] or 'none'})"
          + (f"; plot {args.plot}" if args.plot else ""))
    return 0


def _servo_fit(args) -> int:
    from soarm.training import servo_id

    return servo_id.servo_fit(args.logs, args.out, args.plot, iterations=args.iterations,
                              population=args.population, seed=args.seed)


def _servo_check(args) -> int:
    from soarm.training import servo_id

    return servo_id.servo_check(args.logs, args.fit, args.plot)


def _run(args) -> int:
    from soarm.robot.driver import DriverCfg
    from soarm.robot.run import run

    cfg = DriverCfg(port=args.port, policy=str(args.policy), calibration=str(args.calibration),
                    log_dir=str(args.log_dir or ""))
    report = run(cfg, args.target, args.hold)
    print(f"soarm run: {report.summary()}")
    return 1 if report.fault else 0


def _excitation(args):
    from soarm.robot.excite import ExcitationCfg

    return ExcitationCfg(max_speed=args.max_speed, chirp_s=args.chirp_s, dwell_s=args.dwell_s)


def _excite(args) -> int:
    from soarm.robot.excite import excite_arm

    report = excite_arm(args.port, args.calibration, args.policy, _excitation(args),
                        args.joints.split(",") if args.joints else None,
                        args.log_dir or REPO_ROOT / "runs" / "excite", args.dry_run)
    return 1 if report.fault else 0


def _sysid(args) -> int:
    from soarm.robot.excite import excite_arm
    from soarm.robot.sysid import PARAMS, SysidCfg, sysid

    cfg = SysidCfg(iterations=args.iterations, seed=args.seed,
                   fitted=tuple(args.fit.split(",")) if args.fit else PARAMS)
    try:
        cfg.validate()                                  # before any motion or minute of fitting
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out = args.out or REPO_ROOT / "runs" / "sysid" / time.strftime("%Y-%m-%d_%H-%M-%S")
    logs = list(args.logs)
    if not logs:
        if args.port is None or args.calibration is None:
            raise ConfigError("give encoder logs to fit, or --port and --calibration to record them first")
        report = excite_arm(args.port, args.calibration, args.policy, _excitation(args),
                            args.joints.split(",") if args.joints else None, out / "logs", args.dry_run)
        if report.fault or args.dry_run:
            return 1 if report.fault else 0
        logs = report.logs
    sysid(logs, out, cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soarm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("train", help="train a reach policy with PPO on the embedded sim")
    p.add_argument("--config", type=Path, default=CONFIG_DIR / "train" / "reach.yaml")
    p.add_argument("--resume", type=Path, default=None, help="checkpoint file or run directory to continue")
    p.add_argument("--num-envs", type=int, default=None)
    p.add_argument("--iterations", type=int, default=None, help="total iterations (a resumed run continues to it)")
    p.add_argument("--device", default=None)
    p.add_argument("--sim", choices=["embedded", "isaaclab"], default=None,
                   help="simulator: the embedded one (default) or Isaac Lab 3 + Newton (its own venv)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--name", default=None)
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no torch.compile)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. ppo.epochs=4")
    p.set_defaults(fn=_train)

    p = sub.add_parser("export", help="export a checkpoint to a self-describing ONNX policy")
    p.add_argument("source", type=Path, help="checkpoint model_N.pt or run directory (its newest checkpoint)")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="the ONNX file to write (default: policy.onnx beside the checkpoint)")
    p.add_argument("--verify", type=int, default=10_000, help="observations for the torch/onnxruntime check")
    p.set_defaults(fn=_export)

    p = sub.add_parser("evaluate", help="accuracy of a reach policy in the embedded sim")
    p.add_argument("policy", nargs="?", default="scripted",
                   help="'scripted', an exported .onnx, a checkpoint model_N.pt or a run directory")
    p.add_argument("--task", default=None, type=Path, help="task config (default: the policy's own)")
    p.add_argument("--targets", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "eval.json")
    p.set_defaults(fn=_evaluate)

    p = sub.add_parser("emulate", help="a simulated SO-101 servo bus on a pseudo-terminal")
    p.add_argument("--seed", type=int, default=0, help="assembly offsets and fault draws")
    p.add_argument("--drop", type=float, default=0.0, help="probability of a dropped reply")
    p.add_argument("--late", type=float, default=0.0, help="probability of a reply after the SDK timeout")
    p.add_argument("--corrupt", type=float, default=0.0, help="probability of a bad checksum")
    p.add_argument("--error-bits", type=lambda x: int(x, 0), default=0, help="e.g. 0x20 (overload)")
    p.add_argument("--silent", type=int, nargs="*", default=[], help="servo ids that never answer")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", type=Path, default=None, metavar="FILE",
                     help="calibrate the emulated arm first (scripted LeRobot procedure) and save a new FILE")
    cal.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                     help="an existing (LeRobot) calibration file: the emulated arm is assembled to match it; "
                          "the file is only read")
    p.add_argument("--link", type=Path, default=None, help="symlink to the pty, e.g. /tmp/so101 (like socat)")
    p.add_argument("--operator", action="store_true",
                   help="a simulated person at the arm, so `soarm calibrate` can be tried end to end: holds the "
                        "middle pose, then sweeps every joint when the procedure asks (pace seeded by --seed)")
    p.add_argument("--quiet", action="store_true", help="no packet counters every 5 s")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="once serving, write {\"port\": ..., \"pid\": ...} to this JSON file (for scripts)")
    p.add_argument("--plant", choices=("armsim", "mujoco"), default="armsim",
                   help="the arm's physics: our training plant, or the published MJCF in MuJoCo (independent)")
    p.add_argument("--no-compile", action="store_true",
                   help="step the physics eagerly: starts ~10 s sooner, each step slower")
    p.add_argument("--perturb", type=int, default=None, metavar="SEED",
                   help="an arm unlike the nominal one (armsim): friction, gain, link masses, backlash and "
                        "latency drawn from SEED and not shown")
    p.add_argument("--reveal", type=Path, default=None, metavar="FILE",
                   help="with --perturb: write what was drawn to this JSON file (to check identification)")
    p.set_defaults(fn=_emulate)

    p = sub.add_parser("calibrate", help="LeRobot's SO-101 calibration on the arm")
    p.add_argument("--port", required=True, help="serial port of the servo adapter, e.g. /dev/ttyACM0")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "configs" / "calibration" / "so101.json")
    p.set_defaults(fn=_calibrate)

    p = sub.add_parser("run", help="a policy on the arm without ROS: enable, reach for targets, park")
    p.add_argument("--port", required=True, help="serial port of the servo adapter, e.g. /dev/ttyACM0")
    p.add_argument("--policy", type=Path, required=True, help="exported policy (.onnx)")
    p.add_argument("--calibration", type=Path, required=True, help="LeRobot calibration JSON")
    p.add_argument("--target", type=float, nargs=3, action="append", required=True, metavar=("X", "Y", "Z"),
                   help="fingertip target in the base frame, m; repeat for a sequence")
    p.add_argument("--hold", type=float, default=3.0, help="seconds per target")
    p.add_argument("--log-dir", type=Path, default=None, help="write an MCAP encoder log of the run here")
    p.set_defaults(fn=_run)

    def excitation_flags(p, needed: bool) -> None:
        p.add_argument("--port", required=needed, default=None,
                       help="serial port of the servo adapter, e.g. /dev/ttyACM0")
        p.add_argument("--calibration", type=Path, required=needed, default=None, help="LeRobot calibration JSON")
        p.add_argument("--policy", type=Path, default=REPO_ROOT / "data" / "policies" / "reach.onnx",
                       help="the policy whose contract names the joints and the control rate (it does not act)")
        p.add_argument("--joints", default=None, help="comma-separated arm joints (default: all)")
        from soarm.robot.excite import ExcitationCfg

        p.add_argument("--max-speed", type=float, default=ExcitationCfg.max_speed,
                       help="rad/s, the fastest any joint is asked to move")
        p.add_argument("--chirp-s", type=float, default=ExcitationCfg.chirp_s, help="seconds per chirp")
        p.add_argument("--dwell-s", type=float, default=ExcitationCfg.dwell_s, help="seconds at each step level")
        p.add_argument("--dry-run", action="store_true", help="print the plan; open no port, move nothing")

    p = sub.add_parser("excite", help="the identification excitation on the arm: chirps and steps, logged")
    excitation_flags(p, needed=True)
    p.add_argument("--log-dir", type=Path, default=None, help="where the MCAP encoder log goes (runs/excite)")
    p.set_defaults(fn=_excite)

    p = sub.add_parser("sysid", help="identify the arm (gain, friction, armature, dead-band, mass, backlash, "
                                     "latency) for training")
    p.add_argument("logs", nargs="*", type=Path, help="encoder logs to fit (none: --port/--calibration "
                                                      "run `soarm excite` first and fit its log)")
    excitation_flags(p, needed=False)
    p.add_argument("--out", type=Path, default=None,
                   help="directory for arm.yaml, sysid.json, sysid.png (runs/sysid/<time>)")
    p.add_argument("--iterations", type=int, default=12, help="sampled search steps per fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit", default=None, help="comma-separated per-joint parameters to fit, the rest kept at "
                                               "the servo model's (default: all of gain_scale, friction_scale, "
                                               "viscous_scale, friction_load_scale, armature_scale, "
                                               "deadband_ticks, mass_scale, backlash_deg)")
    p.set_defaults(fn=_sysid)

    p = sub.add_parser("replay", help="re-run an encoder log through observation, policy and safety")
    p.add_argument("log", type=Path, help="encoder log (.mcap) or a BAM servo log (.json)")
    p.add_argument("--policy", type=Path, required=True, help="exported policy (.onnx)")
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(fn=_replay)

    p = sub.add_parser("transfer", help="a policy as on the arm, on other plants than its training plant")
    p.add_argument("policy", type=Path, help="exported policy (.onnx)")
    p.add_argument("--targets", type=int, default=200, help="per plant, a multiple of 4 (one arm per 4 targets)")
    p.add_argument("--plants", default=None, help="comma-separated names (default: all; a wrong one lists them)")
    p.add_argument("--seed", type=int, default=7, help="targets and perturbation draws")
    p.add_argument("--task", type=Path, default=None,
                   help="task YAML whose targets and randomization the suite uses (default configs/task/reach.yaml;"
                        " a run's task.yaml judges its policy on the spread it trained on)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "transfer" / "transfer.json",
                   help="JSON report; the plot goes beside it (.png)")
    p.set_defaults(fn=_transfer)

    p = sub.add_parser("servo-fit", help="fit the servo model and a PD baseline on bench logs")
    p.add_argument("logs", nargs="*", type=Path, default=DEFAULT_LOGS)
    p.add_argument("--out", type=Path, default=DEFAULT_FIT)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--population", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=REPO_ROOT / "runs" / "servo_fit.png")
    p.set_defaults(fn=_servo_fit)

    p = sub.add_parser("servo-check", help="RMS of both fitted models on bench logs (e.g. unseen ones)")
    p.add_argument("logs", nargs="*", type=Path, default=DEFAULT_LOGS)
    p.add_argument("--fit", type=Path, default=DEFAULT_FIT)
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(fn=_servo_check)

    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, ValueError, BusError) as e:
        print(f"soarm {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
