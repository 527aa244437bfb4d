"""A policy trained on the identified arm against one trained on the nominal model, both on an
emulated arm neither was told about.

    python benchmarks/sysid_policy.py [--seed 3] [--work runs/sysid_bench]
        [--log LOG.mcap] [--arm ARM.yaml] [--identified POLICY.onnx] [--nominal POLICY.onnx]
        [--recovery-only]

1. `soarm excite` (the full plan) on `soarm emulate --perturb SEED`, over the pty (--log: skip).
2. `soarm sysid` on that log (--arm: skip).
3. Two policies trained with the shipped config and seed, but the randomization narrowed to
   one arm's spread (ARM_RANDOMIZATION: what a user trains for the arm they identified), one
   centred on the identified arm (`--set task.arm=ARM`), one on the nominal model; exported
   (--identified / --nominal: skip).
4. Those and the shipped policy (the wide randomization) in the transfer suite's closed loop
   (`PolicyStep` and the safety layer at the contract's rate) on the emulator's perturbed
   plant (`perturbed:SEED`, the physics the emulator ran), on the identified plant and on the
   nominal one, 200 targets each.

Prints the identified arm beside what the emulator hid (`--perturb SEED` draws it again),
then JSON: each policy's mean error per plant, and the ratio nominal-trained /
identified-trained on the perturbed arm (above 1: identification helped).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm import REPO_ROOT  # noqa: E402


def record(seed: int, work: Path) -> Path:
    from soarm.robot.emulator_process import EmulatorProcess
    from soarm.calibration.excite import ExcitationCfg, excite_arm

    with EmulatorProcess(work / "cal.json", seed=seed,
                         args=("--perturb", str(seed), "--reveal", str(work / "truth.yaml"))) as emu:
        report = excite_arm(emu.port, emu.calibration, REPO_ROOT / "data" / "policies" / "reach.onnx",
                            ExcitationCfg(), None, work / "logs")
    if report.fault:
        raise SystemExit(f"sysid_policy: excitation failed: {report.fault}")
    return report.logs[-1]


# One arm's spread, not every arm's: the unit-to-unit and wear spread left once the arm's own
# gain, friction, masses, play and latency are known; no PD-driven arms (the drive is the
# identified servo).
ARM_RANDOMIZATION = {"task.randomization.gain_scale": [0.85, 1.15], "task.randomization.friction_scale": [0.7, 1.4],
                     "task.randomization.backlash_deg": [0.0, 1.0], "task.randomization.pd_share": 0.0}


def train_on(arm: Path | None, work: Path, name: str) -> Path:
    from soarm.export.exporter import export
    from soarm.training.train import DEFAULT_CONFIG, train

    centre = {} if arm is None else {"task.arm": str(arm.resolve())}
    out = train(DEFAULT_CONFIG, {**ARM_RANDOMIZATION, **centre, "run.name": name, "run.out_dir": str(work.resolve())})
    policy = Path(out["run_dir"]) / "policy.onnx"
    export(Path(out["run_dir"]), policy)
    return policy


def recovery_table(arm_file: Path, seed: int) -> list[str]:
    """Identified / hidden, per arm joint and parameter (soarm.arm_params.JOINT_FIELDS; the
    multipliers shown as x the servo model's, the play in degrees)."""
    import math

    from soarm import CONFIG_DIR, config
    from soarm.arm_params import JOINT_FIELDS, ArmParams, load_arm
    from soarm.description import load_robot
    from soarm.servo import ServoConfig

    robot = load_robot()
    arm = load_arm(arm_file, robot)
    servo = config.load(ServoConfig, CONFIG_DIR / arm.servo).params
    hidden = ArmParams.random(seed, robot, arm.servo).resolved(robot)

    def shown(name: str, value: float) -> float:
        spec = JOINT_FIELDS[name]
        return math.degrees(value) if name == "backlash" else value / spec.nominal(servo) if spec.multiplier else value
    heads = ("gain", "Coulomb", "viscous", "load fr.", "armature", "dead-band", "mass", "backlash°")
    lines = [f"{'joint':14s} " + " ".join(f"{h:>11s}" for h in heads) + "   (identified / hidden)"]
    for name in robot.arm_joints:
        got, want = arm.joints[name], hidden.joints[name]
        lines.append(f"{name:14s} " + " ".join(f"{shown(p, getattr(got, p)):5.2f}/{shown(p, getattr(want, p)):<5.2f}"
                                               for p in JOINT_FIELDS))
    lines.append(f"latency ticks {arm.latency_ticks}/{hidden.latency_ticks}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=3, help="the emulated arm's hidden perturbation")
    ap.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "sysid_bench")
    ap.add_argument("--log", type=Path, default=None)
    ap.add_argument("--arm", type=Path, default=None)
    ap.add_argument("--identified", type=Path, default=None, help="policy trained on the identified arm")
    ap.add_argument("--nominal", type=Path, default=None, help="policy trained on the nominal model, narrowed")
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--recovery-only", action="store_true", help="stop after steps 1-2 and the recovery table")
    args = ap.parse_args()

    from soarm.calibration.sysid import SysidCfg, sysid
    from soarm.calibration.transfer import run_suite

    t0, work = time.time(), args.work
    work.mkdir(parents=True, exist_ok=True)
    log = args.log or record(args.seed, work)
    print(f"sysid_policy: excitation log {log} ({time.time() - t0:.0f} s)", flush=True)
    arm = (args.arm or work / "fit" / "arm.yaml").resolve()
    if args.arm is None:
        sysid([log], work / "fit", SysidCfg())
    print("\n".join(recovery_table(arm, args.seed)), flush=True)
    if args.recovery_only:
        return 0
    policy = args.identified or train_on(arm, work, "on_identified")
    print(f"sysid_policy: policy trained on the identified arm {policy} ({time.time() - t0:.0f} s)", flush=True)
    nominal = args.nominal or train_on(None, work, "on_nominal")
    print(f"sysid_policy: policy trained on the nominal model {nominal} ({time.time() - t0:.0f} s)", flush=True)
    plants = ["nominal", f"perturbed:{args.seed}", f"identified:{arm.resolve()}"]
    rows = {}
    for name, path in (("nominal-trained", nominal), ("identified-trained", policy),
                       ("shipped (wide randomization)", REPO_ROOT / "data" / "policies" / "reach.onnx")):
        result = run_suite(path, plants, targets=args.targets)
        rows[name] = {"policy": str(path), **{p: round(r["mean_error_m"] * 1000, 2) for p, r in result["plants"].items()}}
    perturbed = f"perturbed:{args.seed}"
    print(json.dumps({"seed": args.seed, "arm": str(arm), "mean_error_mm": rows,
                      "perturbed_ratio_nominal_to_identified":
                          round(rows["nominal-trained"][perturbed] / rows["identified-trained"][perturbed], 3),
                      "wall_s": round(time.time() - t0)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
