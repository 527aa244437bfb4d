"""The control tick on the real SDK through the emulator over a pty, and a fault campaign.

    python benchmarks/control_tick.py [runs/reach/latest/policy.onnx] [--ticks 10000]
        [--sustain 60] [--campaign 10000] [--parts latency,sustained,campaign,scenarios]

Latency and the sustained run talk to `soarm emulate` in a process of its own (as the real
arm is to the host); the campaign injects its faults into an in-process emulator.

1. Tick latency: sync read of 6 servos + observation + inference + safety + sync write,
   as fast as it goes, `--ticks` times: p50/p99/max.
2. Sustained: the loop at 100 Hz for `--sustain` seconds: overruns.
3. Fault campaign: `--campaign` ticks per fault type (dropped, late and corrupted replies,
   readings of random data with a valid checksum, a silent servo, error bits, an unplugged
   port), injected at the stated rate; counts faults, recovered ticks, commands outside the
   limits and goal changes above the cap (both must be 0), and the time from a persistent
   fault to torque off.
4. Bench scenarios through the driver (robot/driver.py, what the ROS node runs), `--repeat`
   times each: e-stop request to broadcast torque off (sent, and acted on by the emulated
   servos) with noise on the line; an adapter
   unplugged and replugged (the emulator killed and restarted behind the same path) to the
   arm enabled again (commands outside the limits and goal changes above the cap counted);
   enable with a joint resting outside its calibrated range (refused, torque stays off); a
   second Ctrl-C during `soarm run`'s park; a second driver opening the same port; targets
   at 1 kHz; the supply sagging mid-run (to 5.0 V, then below the servos' 4.0 V limit).
   Commands outside the limits and goal changes above the cap are counted where the driver
   runs in this process, and in the new scenarios also at the emulated servos (`GoalWatch`:
   whatever process wrote them).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm import REPO_ROOT  # noqa: E402
from soarm.calibration import calibration  # noqa: E402
from soarm.description import load_robot  # noqa: E402
from soarm.export.runtime import PolicyRuntime  # noqa: E402
from soarm.robot.bus import FeetechBus  # noqa: E402
from soarm.robot.emulator import FaultCfg, ServoBusEmulator  # noqa: E402
from soarm.robot.emulator_process import EmulatorProcess  # noqa: E402
from soarm.robot.loop import ControlLoop  # noqa: E402
from soarm.robot.safety import SafetyCfg, SafetyLayer  # noqa: E402
from tests.helpers import SoarmRun, wait_until  # noqa: E402

TARGET = np.array([0.22, 0.05, 0.15], dtype=np.float32)


class Checker:
    """Receives every tick as a recorder would, and counts goals sent outside the limits or
    changed by more than the per-tick cap. Enable holds a joint where it rests, which may be
    inside the limits' margin: a goal outside counts only if it moved further out."""

    def __init__(self, safety: SafetyLayer, q0: np.ndarray):
        self.lo, self.hi, self.cap = safety.lower, safety.upper, safety.cfg.max_step
        self.last = np.asarray(q0, dtype=float)
        self.outside = self.too_fast = 0

    def close(self) -> str:
        return "checker"                       # the driver closes its recorder like a log

    def write(self, tick) -> None:                      # a soarm.logs.TickRecord
        if tick.goal_sent is None:
            return
        goal = np.asarray(tick.goal_sent)
        out = ((goal < self.lo - 1e-6) & (goal < self.last - 1e-6)) | ((goal > self.hi + 1e-6) & (goal > self.last + 1e-6))
        self.outside += int(out.any())
        self.too_fast += int((np.abs(goal - self.last) > self.cap + 1e-6).any())
        self.last = goal


class GoalWatch:
    """Checker's two counts taken at the emulated servos, from the goals they were sent (a
    write hook of the emulator): a goal outside the safety limits that moved further out, and
    a goal change above the per-tick cap (plus a tick of rounding) while the servo's torque is
    on. Sees what any process wrote, `soarm run` in a subprocess included."""

    def __init__(self, emu: ServoBusEmulator, cal: dict, safety: SafetyLayer):
        self.emu, self.safety = emu, safety
        names = load_robot().names[:len(safety.lower)]
        self.joints = [(j, cal[n]) for j, n in enumerate(names)]
        self.cap = safety.cfg.max_step + calibration.RAD_PER_TICK
        self.last: dict[int, float] = {}
        self.outside = self.too_fast = 0
        emu.write_hooks.append(self)

    def __call__(self) -> None:                        # the emulator's lock is held
        for j, c in self.joints:
            s = self.emu.servos[c.id]
            if s.get("Torque_Enable") != 1:
                self.last.pop(j, None)
                continue
            goal, last = calibration.ticks_to_rad(c, s.get("Goal_Position")), self.last.get(j)
            self.last[j] = goal
            if last is None or goal == last:
                continue
            lo, hi = self.safety.lower[j], self.safety.upper[j]
            self.outside += int((goal < lo - 1e-6 and goal < last) or (goal > hi + 1e-6 and goal > last))
            self.too_fast += int(abs(goal - last) > self.cap + 1e-6)

    def close(self) -> dict:
        self.emu.write_hooks.remove(self)
        return {"commands_outside_limits_at_servos": self.outside, "changes_above_cap_at_servos": self.too_fast}


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
    "garbage_reading": (FaultCfg(garbage=0.02, seed=4), "2 % of position replies random, checksum valid"),
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
    return {"dropped_reply": c["dropped"], "late_reply": c["late"], "corrupted_checksum": c["corrupted"],
            "garbage_reading": c["garbage"]}.get(name, stats.read_failures or 1)


def _driver(port: str, policy: Path, cal: str, ready: bool = True):
    """A driver started on `port`; `ready`: wait until it is connected and disabled."""
    from soarm.robot.driver import DISABLED, DriverCfg, ReachDriver

    driver = ReachDriver(DriverCfg(port=port, policy=str(policy), calibration=cal)).start()
    if ready and not wait_until(lambda: driver.state == DISABLED, 60):
        raise RuntimeError(f"driver did not connect: {driver.reason}")
    return driver


def _enable_checked(driver) -> Checker:
    ok, msg = driver.enable()
    if not ok:
        raise RuntimeError(msg)
    check = Checker(driver.safety, driver.loop.step.goal)
    driver.loop.recorder = check
    driver.set_target(TARGET)
    return check


def estop_under_noise(policy: Path, repeat: int) -> dict:
    robot = load_robot()
    latencies, arrivals, outside, too_fast, torque_left_on = [], [], 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp, ServoBusEmulator(seed=1) as emu:
        bus = FeetechBus(emu.port, {n: i + 1 for i, n in enumerate(robot.names)})
        bus.connect()
        calibration.save(calibration.calibrate_emulated(emu, bus, robot), Path(tmp) / "cal.json")
        bus.close()
        driver = _driver(emu.port, policy, str(Path(tmp) / "cal.json"))
        for _ in range(repeat):
            emu.faults = FaultCfg()
            check = _enable_checked(driver)
            emu.wait(0.5)
            emu.faults = FaultCfg(noise=True)
            failures = driver.loop.stats.read_failures
            wait_until(lambda: driver.loop.stats.read_failures > failures, 5)
            t_request = time.monotonic()
            driver.estop()
            latencies.append(driver.estop_latency_ms)
            arrivals.append((emu.torque_dropped_at - t_request) * 1e3)
            torque_left_on += int(any(emu.torque_enabled()))
            outside, too_fast = outside + check.outside, too_fast + check.too_fast
        emu.faults = FaultCfg()
        driver.close()
    lat, arr = np.array(latencies), np.array(arrivals)
    return {"repeat": repeat, "estop_to_broadcast_sent_ms_p50": float(np.median(lat)),
            "estop_to_broadcast_sent_ms_max": float(lat.max()),
            "estop_to_servos_torque_off_ms_p50": float(np.median(arr)),
            "estop_to_servos_torque_off_ms_max": float(arr.max()), "rate_hz": driver.rate,
            "torque_left_on": torque_left_on, "commands_outside_limits": outside, "changes_above_cap": too_fast}


def replug(policy: Path, repeat: int) -> dict:
    times, outside, too_fast, reconnects = [], 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        link, cal = Path(tmp) / "so101", Path(tmp) / "cal.json"
        args = ("--no-compile", "--link", str(link))
        emu = EmulatorProcess(cal, seed=1, args=args)
        driver = _driver(str(link), policy, str(cal))
        for _ in range(repeat):
            check = _enable_checked(driver)
            time.sleep(0.5)
            emu.kill()                                     # unplugged ...
            wait_until(lambda: driver.state == "fault", 10)
            emu.stop()
            emu = EmulatorProcess(cal, seed=1, args=args, calibrate=False)   # ... and plugged in again
            t0 = time.perf_counter()
            while not driver.enable()[0] and time.perf_counter() - t0 < 30:
                time.sleep(0.05)
            times.append((time.perf_counter() - t0) * 1e3)
            outside, too_fast = outside + check.outside, too_fast + check.too_fast
            driver.disable()
            wait_until(lambda: driver.state == "disabled", 30)
        reconnects = driver.diagnostics()["reconnects"]
        driver.close()
        emu.stop()
    t = np.array(times)
    return {"repeat": repeat, "replug_to_enabled_ms_p50": float(np.median(t)), "replug_to_enabled_ms_max": float(t.max()),
            "reconnects": reconnects, "commands_outside_limits": outside, "changes_above_cap": too_fast}


class CalibratedArm:
    """An in-process emulator (eager physics) calibrated as LeRobot does, its file saved."""

    def __init__(self, tmp: str):
        self.robot = load_robot()
        self.emu = ServoBusEmulator(seed=1).start()
        bus = FeetechBus(self.emu.port, {n: i + 1 for i, n in enumerate(self.robot.names)})
        bus.connect()
        self.cal = calibration.calibrate_emulated(self.emu, bus, self.robot)
        bus.close()
        self.path = str(Path(tmp) / "cal.json")
        calibration.save(self.cal, Path(self.path))

    def watch(self) -> GoalWatch:
        return GoalWatch(self.emu, self.cal, SafetyLayer.for_arm(SafetyCfg(), self.robot, self.cal))


def double_ctrl_c(policy: Path, repeat: int) -> dict:
    """`soarm run` in its own process on the emulator's pty: Ctrl-C starts the park, a second
    one during it must still end with every servo's torque off, at once and without a traceback."""
    torque_left_on, clean, off_ms = 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        arm = CalibratedArm(tmp)
        watch = arm.watch()
        for _ in range(repeat):
            run = SoarmRun("--port", arm.emu.port, "--calibration", arm.path, "--policy", str(policy),
                           "--target", "0.22", "0.1", "0.15", "--hold", "120")
            if not wait_until(lambda: run.printed("fingertip error"), 120):
                raise RuntimeError("soarm run did not reach: " + "".join(run.seen))
            run.interrupt()
            wait_until(lambda: run.printed("moving to the park pose"), 30)
            t_second = time.monotonic()
            run.interrupt()
            run.proc.wait(30)
            torque_left_on += int(any(arm.emu.torque_enabled()))
            clean += int("Traceback" not in run.proc.stderr.read())
            off_ms.append((arm.emu.torque_dropped_at - t_second) * 1e3)
        counts = watch.close()
        arm.emu.stop()
    return {"repeat": repeat, "torque_left_on": torque_left_on, "exits_without_traceback": clean,
            "second_ctrl_c_to_torque_off_ms_max": float(max(off_ms)), **counts}


def two_openers(policy: Path, repeat: int) -> dict:
    """A second driver on the adapter a running one holds: refused in one line; the first
    keeps control."""
    refused, enabled_second, one_line = 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        arm = CalibratedArm(tmp)
        watch = arm.watch()
        driver = _driver(arm.emu.port, policy, arm.path)
        check = _enable_checked(driver)
        for _ in range(repeat):
            second = _driver(arm.emu.port, policy, arm.path, ready=False)
            wait_until(lambda: second.state == "fault", 30)
            refused += int("in use by another process" in second.reason)
            one_line += int("\n" not in second.reason)
            enabled_second += int(second.enable()[0])
            second.close()
        first_still = driver.state == "enabled"
        driver.close()
        counts = watch.close()
        arm.emu.stop()
    return {"repeat": repeat, "second_refused_naming_the_cause": refused, "one_line": one_line,
            "second_enabled": enabled_second, "first_still_enabled": first_still,
            "commands_outside_limits": check.outside, "changes_above_cap": check.too_fast, **counts}


def targets_1khz(policy: Path, seconds: float) -> dict:
    """New targets at 1 kHz into the driver (what the ROS node hands it; the node's own intake
    is measured by benchmarks/ros_node_tick.py): the control loop keeps its rate."""
    with tempfile.TemporaryDirectory() as tmp:
        arm = CalibratedArm(tmp)
        watch = arm.watch()
        driver = _driver(arm.emu.port, policy, arm.path)
        check = _enable_checked(driver)
        targets, sent, stop = ([0.22, 0.05, 0.15], [0.2, -0.05, 0.2]), 0, threading.Event()

        def flood() -> None:
            nonlocal sent
            t_next = time.perf_counter()
            while not stop.is_set():
                driver.set_target(targets[(sent // 2000) % 2])          # a new place every 2 s
                sent += 1
                t_next += 1e-3
                time.sleep(max(0.0, t_next - time.perf_counter()))
        ticks0 = driver.diagnostics()["tick"]["ticks"]
        t0 = time.monotonic()
        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        time.sleep(seconds)
        stop.set()
        thread.join()
        d = driver.diagnostics()
        elapsed = time.monotonic() - t0
        driver.close()
        counts = watch.close()
        arm.emu.stop()
    return {"seconds": seconds, "targets_per_s": round(sent / elapsed, 1), "rate_hz": d["rate_hz"],
            "ticks_per_s": round((d["tick"]["ticks"] - ticks0) / elapsed, 1), "overruns": d["tick"]["overruns"],
            "tick_ms_p99": d["tick"]["tick_ms_p99"], "state": d["state"],
            "commands_outside_limits": check.outside, "changes_above_cap": check.too_fast, **counts}


def supply_sag(policy: Path, repeat: int) -> dict:
    """The supply sags mid-reach to 5.0 V (weaker motors, no fault: the arm goes on), then to
    3.6 V, below the servos' Min_Voltage_Limit (their voltage bit: torque off), and recovers."""
    went_on, tripped, off_ms, reenabled = 0, 0, [], 0
    with tempfile.TemporaryDirectory() as tmp:
        arm = CalibratedArm(tmp)
        watch = arm.watch()
        driver = _driver(arm.emu.port, policy, arm.path)
        outside = too_fast = 0
        for _ in range(repeat):
            check = _enable_checked(driver)
            arm.emu.wait(1.0)
            arm.emu.supply(5.0)
            arm.emu.wait(2.0)
            went_on += int(driver.state == "enabled")
            t_sag = time.monotonic()
            arm.emu.supply(3.6)
            wait_until(lambda: driver.state == "fault", 10)
            tripped += int("error_0x01" in driver.reason and not any(arm.emu.torque_enabled()))   # voltage bit
            off_ms.append((arm.emu.torque_dropped_at - t_sag) * 1e3)
            arm.emu.supply(7.4)
            outside, too_fast = outside + check.outside, too_fast + check.too_fast
            reenabled += int(driver.enable()[0])                    # enable is the reset
            driver.disable()
            wait_until(lambda: driver.state == "disabled", 30)
        driver.close()
        counts = watch.close()
        arm.emu.stop()
    return {"repeat": repeat, "went_on_at_5v": went_on, "torque_off_below_4v": tripped,
            "sag_to_torque_off_ms_max": float(max(off_ms)), "enabled_again": reenabled,
            "commands_outside_limits": outside, "changes_above_cap": too_fast, **counts}


def enable_outside_range(policy: Path, repeat: int) -> dict:
    import dataclasses

    robot = load_robot()
    refused, moved, commands = 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp, ServoBusEmulator(seed=1) as emu:
        bus = FeetechBus(emu.port, {n: i + 1 for i, n in enumerate(robot.names)})
        bus.connect()
        cal = calibration.calibrate_emulated(emu, bus, robot)
        bus.close()
        lift = cal["shoulder_lift"]
        cal["shoulder_lift"] = dataclasses.replace(lift, range_min=lift.range_min + 300)
        emu.assemble_as(cal)
        calibration.save(cal, Path(tmp) / "narrow.json")
        driver = _driver(emu.port, policy, str(Path(tmp) / "narrow.json"))
        j = robot.names.index("shoulder_lift")
        for _ in range(repeat):
            q = emu.joint_positions()
            q[j] = calibration.ticks_to_rad(cal["shoulder_lift"], cal["shoulder_lift"].range_min) - 0.2
            emu.place(q)
            ok, msg = driver.enable()
            refused += int(not ok and "outside its calibrated range" in msg)
            moved += int(any(emu.torque_enabled()))
            commands += int(driver.loop.running)
        driver.close()
    return {"repeat": repeat, "refused_with_reason": refused, "torque_turned_on": moved,
            "control_loop_started": commands}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy", nargs="?", type=Path, default=REPO_ROOT / "runs" / "reach" / "latest" / "policy.onnx")
    ap.add_argument("--ticks", type=int, default=10000)
    ap.add_argument("--sustain", type=float, default=60.0)
    ap.add_argument("--campaign", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=10, help="runs of each bench scenario")
    ap.add_argument("--flood-seconds", type=float, default=20.0, help="the 1 kHz targets scenario's length")
    ap.add_argument("--parts", default="latency,sustained,campaign,scenarios", help="comma-separated")
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
    parts = {
        "latency": lambda: latency(args.policy, args.ticks),
        "sustained": lambda: sustained(args.policy, args.sustain),
        "campaign": lambda: campaign(args.policy, args.campaign),
        "scenarios": lambda: {"estop_under_noise": estop_under_noise(args.policy, args.repeat),
                              "replug": replug(args.policy, args.repeat),
                              "enable_outside_range": enable_outside_range(args.policy, args.repeat),
                              "double_ctrl_c": double_ctrl_c(args.policy, args.repeat),
                              "two_openers": two_openers(args.policy, args.repeat),
                              "targets_1khz": targets_1khz(args.policy, args.flood_seconds),
                              "supply_sag": supply_sag(args.policy, args.repeat)},
    }
    wanted = args.parts.split(",")
    if unknown := set(wanted) - set(parts):
        ap.error(f"--parts: unknown {sorted(unknown)}; known: {','.join(parts)}")
    for name in wanted:
        result[name] = parts[name]()
        print(f"{name}: done", file=sys.stderr)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
