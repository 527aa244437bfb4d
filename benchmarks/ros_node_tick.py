"""Tick timing inside the ROS 2 node at its default rate, through the SDK and the emulator.

    python benchmarks/ros_node_tick.py [data/policies/reach.onnx] [--seconds 60] [--target-hz 0.5]

Starts `soarm emulate` (compiled physics) and the reach node as separate processes, enables
the arm through the service, sends a new target every 2 s (with --target-hz above 0.5, the
same target again at that rate between them: a flood of target messages), and after
`--seconds` reads the node's own tick statistics from /diagnostics: ticks, the rate they
came at, p50/p99/max tick duration, overruns. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ros_harness import Client, NodeProcess, diag_with  # noqa: E402  (sets the ROS environment first)

from soarm import REPO_ROOT  # noqa: E402
from soarm.description import load_robot  # noqa: E402
from soarm.dynamics import ArmDynamics  # noqa: E402
from soarm.reach import CommandCfg, sample_targets  # noqa: E402
from soarm.robot.emulator_process import EmulatorProcess  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy", nargs="?", type=Path, default=REPO_ROOT / "data" / "policies" / "reach.onnx")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--target-hz", type=float, default=0.5, help="target messages per second")
    args = ap.parse_args()
    dyn = ArmDynamics(load_robot(), dtype=torch.float64)
    targets = sample_targets(dyn, CommandCfg(), 64, torch.Generator().manual_seed(3)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("starting the emulator (compiling its physics) ...", file=sys.stderr)
        emu = EmulatorProcess(tmp / "calibration.json", seed=1)
        node = NodeProcess(tmp, {"port": emu.port, "policy": str(args.policy), "calibration": str(emu.calibration)})
        client = Client()
        try:
            client.wait_for(diag_with(client, "state", "disabled"))
            r = client.call("enable")
            if not r.success:
                sys.exit(f"enable failed: {r.message}")
            print(f"enabled; running {args.seconds:.0f} s ...", file=sys.stderr)
            client.wait_for(lambda: client.diag and client.diag[-1].get("state") == "enabled")
            ticks0, t0 = int(client.diag[-1]["ticks"]), time.monotonic()
            t_end, k, period = t0 + args.seconds, 0, 1.0 / max(args.target_hz, 0.5)
            while (now := time.monotonic()) < t_end:
                client.send(targets[int((now - t0) / 2.0) % len(targets)])
                k += 1
                time.sleep(min(period, max(0.0, t_end - time.monotonic())))
            time.sleep(1.2)                              # one more diagnostics message
            d = client.diag[-1]
            achieved = (int(d["ticks"]) - ticks0) / (time.monotonic() - 1.2 - t0)
            client.call("disable")
        finally:
            client.close()
            node.stop()
            emu.stop()
    keys = ("state", "rate_hz", "ticks", "overruns", "tick_ms_p50", "tick_ms_p99", "tick_ms_max", "read_failures",
            "write_failures", "policy_errors")
    result = {"policy": str(args.policy), "seconds": args.seconds, "targets_sent": k,
              "target_hz_sent": round(k / args.seconds, 1), "ticks_per_s": round(achieved, 1),
              **{key: d.get(key) for key in keys},
              "clamps": {key[6:]: v for key, v in d.items() if key.startswith("clamp.")}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
