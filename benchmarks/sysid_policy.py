"""A policy trained on the identified arm against one trained on the nominal model, both on an
emulated arm neither was told about.

    python benchmarks/sysid_policy.py [--seed 3] [--work runs/sysid_bench]
        [--log LOG.mcap] [--arm ARM.yaml] [--identified POLICY.onnx] [--nominal POLICY.onnx]

1. `soarm excite` (the full plan) on `soarm emulate --perturb SEED`, over the pty (--log: skip).
2. `soarm sysid` on that log (--arm: skip).
3. `soarm train --set task.arm=ARM` with the shipped policy's config and seed, exported
   (--identified: skip).
4. Both policies in the transfer suite's closed loop (`PolicyStep` and the safety layer at
   the contract's rate) on the emulator's perturbed plant (`perturbed:SEED`, the physics the
   emulator ran), on the identified plant and on the nominal one, 200 targets each.

Prints JSON: each policy's mean error per plant, and the ratio nominal-trained /
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
    from soarm.robot.excite import ExcitationCfg, excite_arm

    with EmulatorProcess(work / "cal.json", seed=seed,
                         args=("--perturb", str(seed), "--reveal", str(work / "truth.json"))) as emu:
        report = excite_arm(emu.port, emu.calibration, REPO_ROOT / "data" / "policies" / "reach.onnx",
                            ExcitationCfg(), None, work / "logs")
    if report.fault:
        raise SystemExit(f"sysid_policy: excitation failed: {report.fault}")
    return report.logs[-1]


def train_on(arm: Path, work: Path) -> Path:
    from soarm.export.exporter import export
    from soarm.training.train import DEFAULT_CONFIG, train

    out = train(DEFAULT_CONFIG, {"task.arm": str(arm.resolve()), "run.name": "sysid_bench",
                                 "run.out_dir": str(work.resolve())})
    policy = Path(out["run_dir"]) / "policy.onnx"
    export(Path(out["run_dir"]), policy)
    return policy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=3, help="the emulated arm's hidden perturbation")
    ap.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "sysid_bench")
    ap.add_argument("--log", type=Path, default=None)
    ap.add_argument("--arm", type=Path, default=None)
    ap.add_argument("--identified", type=Path, default=None, help="policy trained on the identified arm")
    ap.add_argument("--nominal", type=Path, default=REPO_ROOT / "data" / "policies" / "reach.onnx",
                    help="policy trained on the nominal model (default: the shipped one)")
    ap.add_argument("--targets", type=int, default=200)
    args = ap.parse_args()

    from soarm.robot.sysid import SysidCfg, sysid
    from soarm.robot.transfer import run_suite

    t0, work = time.time(), args.work
    work.mkdir(parents=True, exist_ok=True)
    log = args.log or record(args.seed, work)
    print(f"sysid_policy: excitation log {log} ({time.time() - t0:.0f} s)", flush=True)
    arm = args.arm or work / "fit" / "arm.yaml"
    if args.arm is None:
        sysid([log], work / "fit", SysidCfg())
    policy = args.identified or train_on(arm, work)
    print(f"sysid_policy: policy trained on the identified arm {policy} ({time.time() - t0:.0f} s)", flush=True)
    plants = ["nominal", f"perturbed:{args.seed}", f"identified:{arm.resolve()}"]
    rows = {}
    for name, path in (("nominal-trained", args.nominal), ("identified-trained", policy)):
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
