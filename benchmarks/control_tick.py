"""The control tick on the real SDK through the emulator over a pty, and a fault campaign.

    python benchmarks/control_tick.py [runs/reach/latest/policy.onnx] [--ticks 10000]
        [--sustain 60] [--campaign 10000]

Latency and the sustained run talk to `soarm emulate` in a process of its own (as the real
arm is to the host); the campaign injects its faults into an in-process emulator.

1. Tick latency: sync read of 6 servos + observation + inference + safety + sync write,
   as fast as it goes, `--ticks` times: p50/p99/max.
2. Sustained: the loop at 100 Hz for `--sustain` seconds: overruns.
3. Fault campaign: `--campaign` ticks per fault type (dropped, late and corrupted replies,
   a silent servo, error bits, an unplugged port), injected at the stated rate; counts
   faults, recovered ticks, commands outside the limits and goal changes above the cap
   (both must be 0), and the time from a persistent fault to torque off.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm import REPO_ROOT  # noqa: E402
from soarm.calibration import calibration  # noqa: E402
from soarm.description import load_robot  # noqa: E402
from soarm.export.runtime import PolicyRuntime  # noqa: E402
from soarm.robot.bus import FeetechBus  # noqa: E402
from soarm.robot.emulator import EmulatorProcess, FaultCfg, ServoBusEmulator  # noqa: E402
from soarm.robot.loop import ControlLoop  # noqa: E402
from soarm.robot.safety import SafetyCfg, SafetyLayer  # noqa: E402

TARGET = np.array([0.22, 0.05, 0.15], dtype=np.float32)


class Checker:
    """Receives every tick as a recorder would, and counts goals sent outside the limits or
    changed by more than the per-tick cap."""

    def __init__(self, safety: SafetyLayer, q0: np.ndarray):
        self.lo, self.hi, self.cap = safety.lower, safety.upper, safety.cfg.max_step
        self.last = np.asarray(q0, dtype=float)
        self.outside = self.too_fast = 0

    def write(self, tick: dict) -> None:
        if tick["goal_sent"] is None:
            return
        goal = np.asarray(tick["goal_sent"])
        self.outside += int(((goal < self.lo - 1e-6) | (goal > self.hi + 1e-6)).any())
        self.too_fast += int((np.abs(goal - self.last) > self.cap + 1e-6).any())
        self.last = goal


class Rig:
    """Emulator + bus + calibration + loop. `process=True` runs the emulator as a process of
    its own (`soarm emulate`), as the arm is to the host: for timing. In-process (the
    default) it can inject faults at run time: for the campaign."""

    def __init__(self, policy: Path, faults: FaultCfg | None = None, rate: float = 100.0, process: bool = False):
        self.robot = load_robot()
        ids = {n: i + 1 for i, n in enumerate(self.robot.names)}
        if process:
            self.tmp = tempfile.TemporaryDirectory()
            self.emu = EmulatorProcess(Path(self.tmp.name) / "calibration.json", seed=1)
        else:
            self.emu = ServoBusEmulator(seed=1, compile=True).start()
        self.bus = FeetechBus(self.emu.port, ids)
        self.bus.connect()
        self.cal = (calibration.load(self.emu.calibration) if process
                    else calibration.calibrate_emulated(self.emu, self.bus, self.robot))
        self.safety = SafetyLayer.for_arm(SafetyCfg(), self.robot, self.cal)
        self.loop = ControlLoop(self.bus, PolicyRuntime(policy), self.cal, self.safety, lambda: TARGET,
                                rate_hz=rate)
        self.loop.start()
        self.check = self.loop.recorder = Checker(self.safety, self.loop.step.goal)
        if faults is not None:
            self.emu.faults = faults

    def close(self):
        self.loop.shutdown()
        self.bus.close()
        self.emu.stop()


def latency(policy: Path, ticks: int) -> dict:
    rig = Rig(policy, process=True)
    d = []
    for _ in range(ticks):
        t0 = time.perf_counter()
        rig.loop.tick()
        d.append((time.perf_counter() - t0) * 1e3)
    rig.close()
    d = np.array(d)
    return {"ticks": ticks, "p50_ms": float(np.percentile(d, 50)), "p99_ms": float(np.percentile(d, 99)),
            "max_ms": float(d.max()), "read_failures": rig.loop.stats.read_failures}


def sustained(policy: Path, seconds: float) -> dict:
    rig = Rig(policy, rate=100.0, process=True)
    stats = rig.loop.run(seconds=seconds)
    rig.close()
    return {"rate_hz": 100.0, "seconds": seconds, **stats}


CAMPAIGN = {
    "dropped_reply": (FaultCfg(drop=0.02, seed=1), "2 % of replies"),
    "late_reply": (FaultCfg(late=0.02, seed=2), "2 % of replies, 60 ms late"),
    "corrupted_checksum": (FaultCfg(corrupt=0.02, seed=3), "2 % of replies"),
    "error_bits": (FaultCfg(error_bits=0x20), "overload bit on every reply (persistent)"),
    "silent_servo": (FaultCfg(silent_ids=(3,)), "servo 3 stops answering (persistent)"),
    "unplugged": (None, "port unplugged at tick 100 (persistent)"),
}


def campaign(policy: Path, ticks: int) -> dict:
    out = {}
    for name, (faults, rate) in CAMPAIGN.items():
        rig = Rig(policy, faults=faults)                  # ticks back to back, dt nominal 10 ms
        t_fault = time.perf_counter() if faults is not None and name in ("error_bits", "silent_servo") else None
        t_off = None
        k = recovered = 0
        failed_before = False
        for k in range(ticks):
            if name == "unplugged" and k == 100:
                rig.emu.unplug()
                t_fault = time.perf_counter()
            before = rig.loop.stats.read_failures + rig.loop.stats.policy_errors
            if rig.loop.tick() == "torque_off":
                t_off = time.perf_counter()
                break
            failed = rig.loop.stats.read_failures + rig.loop.stats.policy_errors > before
            recovered += int(failed_before and not failed)
            failed_before = failed
        s = rig.loop.stats
        out[name] = {
            "rate": rate, "ticks": k + 1, "faults_injected": _injected(rig, name, s),
            "failed_ticks_recovered_from": recovered,
            "read_failures": s.read_failures, "commands_outside_limits": rig.check.outside,
            "changes_above_cap": rig.check.too_fast, "tripped": rig.safety.tripped,
            "fault_to_torque_off_ms": None if t_off is None or t_fault is None else (t_off - t_fault) * 1e3,
        }
        rig.close()
    return out


def _injected(rig, name, stats) -> int:
    c = rig.emu.counters
    return {"dropped_reply": c["dropped"], "late_reply": c["late"], "corrupted_checksum": c["corrupted"]}.get(
        name, stats.read_failures or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy", nargs="?", type=Path, default=REPO_ROOT / "runs" / "reach" / "latest" / "policy.onnx")
    ap.add_argument("--ticks", type=int, default=10000)
    ap.add_argument("--sustain", type=float, default=60.0)
    ap.add_argument("--campaign", type=int, default=10000)
    ap.add_argument("--switch-interval", type=float, default=1e-4, help="sys.setswitchinterval, seconds")
    args = ap.parse_args()
    if not args.policy.is_file():
        sys.exit(f"{args.policy}: no policy; run `make` first or pass an exported .onnx")
    import torch

    torch.set_num_threads(1)
    # In the fault campaign the emulator is a thread of this process and the SDK busy-polls
    # the port, so the two hand the GIL back and forth on every reply: a short switch
    # interval keeps that handoff from dominating. Latency and the sustained run use an
    # emulator process, as the arm is a device of its own.
    sys.setswitchinterval(args.switch_interval)
    result = {"policy": str(args.policy), "switch_interval_s": args.switch_interval}
    result["latency"] = latency(args.policy, args.ticks)
    print(f"latency: {result['latency']}", file=sys.stderr)
    result["sustained"] = sustained(args.policy, args.sustain)
    print(f"sustained: {result['sustained']}", file=sys.stderr)
    result["campaign"] = campaign(args.policy, args.campaign)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
