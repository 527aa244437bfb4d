"""`soarm`: the project's one command line. Each stage registers its own commands
(`register(subparsers)` in its `commands` module, flags derived from its config dataclasses);
this module only parses and dispatches.

    soarm train        train a reach policy with PPO on the embedded sim
    soarm evaluate     accuracy of a reach policy (ONNX, checkpoint or scripted) in the embedded sim
    soarm export       checkpoint -> self-describing ONNX policy (verified against torch)
    soarm emulate      a simulated SO-101 servo bus on a pseudo-terminal, for the Feetech SDK
    soarm run          a policy on the arm without ROS: enable, reach for targets, park
    soarm replay       an encoder log through observation + policy + safety, against what was sent
    soarm calibrate    LeRobot's SO-101 calibration on the arm (writes the servos' EEPROM and a JSON file)
    soarm excite       the identification excitation on the arm (chirps and steps), logged
    soarm sysid        identify the arm from logs of its motion: an arm file `soarm train` centres on
    soarm arm-check    how far a model of the arm is from the arm, on logs of its motion (per joint, mrad)
    soarm servo-fit    fit the servo model and the PD baseline on real bench logs
    soarm servo-check  compare both fitted models on (new) bench logs
    soarm transfer     a policy as on the arm, on plants other than its training plant (MuJoCo included)
"""

from __future__ import annotations

import argparse
import importlib
import sys

STAGES = ("soarm.training.commands", "soarm.export.commands", "soarm.robot.commands", "soarm.calibration.commands")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soarm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    errors: tuple[type[BaseException], ...] = (ValueError,)      # ConfigError, LogError, PolicyError ...
    for name in STAGES:
        stage = importlib.import_module(name)
        stage.register(sub)
        errors += getattr(stage, "ERRORS", ())
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except errors as e:
        print(f"soarm {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
