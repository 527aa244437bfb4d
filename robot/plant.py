"""The emulated arm's physics, in a process of its own, so that the servo bus never waits for it.

The plant is ArmSim (our training plant, the STS3215 model) or the published SO-101 MJCF in
MuJoCo (soarm/mujoco_arm.py, an independent one). The bus side (robot/emulator.py) answers
every packet from the latest published state and hands goals and torque switches over as
commands; this process steps the plant toward real
time in slices of one physics step and publishes the state after each. A plant whose steps
take at most half their simulated time in CPU time replays a stall (its process kept off the CPU by a busy machine) up to
CATCH_UP_S, so the arm's clock stays the host's: a dropped stall is a moment the arm froze,
which no real arm does, and a log recorded across it is one that no replay explains. When the
plant cannot keep real time (eager physics on a slow or busy machine), the simulated clock
runs slow instead: the backlog beyond MAX_BEHIND_S is dropped and counted in
`PlantState.lag_s` (a larger one would reach the host as latency), and the bus keeps
answering from the newest state. Nothing about the replies' timing depends on the physics.

    plant = PlantProcess(robot, q0=None)      # None: the pose the unpowered arm settles in
    PlantProcess(robot, perturbation=Perturbation.draw(seed, J))    # an arm unlike the nominal one
    plant.command_goal(j, rad); plant.command_torque(j, True); plant.place(q)
    plant.state().q ...; plant.close()

Shared memory layout (float64): state = [seq, time_s, lag_s, q[J], qd[J]];
commands = [place_seq, goal[J], torque[J], place_q[J]].
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from soarm import CONFIG_DIR
from soarm.description import RobotDescription
from soarm.files import atomic_write

SERVO_FILE = CONFIG_DIR / "servo" / "sts3215_7v4.yaml"
MAX_BEHIND_S = 0.05          # s: a larger backlog of a slow plant is dropped (the simulated clock slows)
CATCH_UP_S = 0.3             # s: the longest stall a plant running twice real time replays
START_TIMEOUT_S = 300.0      # torch import, first rest-pose settle (cached after), compile
CONTROL_HZ = 30.0            # the control rate latency is counted in (ReachCfg.control_hz)


@dataclass(frozen=True)
class Perturbation:
    """How an emulated arm differs, unannounced, from the nominal plant: an arm that
    identification and transfer have not seen. Per joint, drawn from a seed within the spread
    users report of real SO-101s (unit-to-unit gain, worn or greased gearboxes, ~1 deg of
    backlash, printed links and payloads, a slow USB adapter)."""
    friction_scale: tuple[float, ...]   # x Coulomb friction (log-uniform 0.5-2; and viscous where that is None)
    gain_scale: tuple[float, ...]       # x the firmware's loop gain (0.7-1.3)
    mass_scale: tuple[float, ...]       # x each link's mass and inertia (0.8-1.2)
    backlash: tuple[float, ...]         # rad of gear play (0-1.5 deg)
    latency_s: float                    # goals reach the servos this late (0, 1 or 2 control ticks)
    # Drawn after the above (a seed's earlier values are those it drew before these existed);
    # None: the servo model's (a --reveal file written before them).
    viscous_scale: tuple[float, ...] | None = None        # x viscous friction (log-uniform 0.5-2)
    friction_load_scale: tuple[float, ...] | None = None  # x load-dependent friction (log-uniform 0.5-2)
    armature_scale: tuple[float, ...] | None = None       # x rotor inertia (0.8-1.25: motor spread)
    deadband_ticks: tuple[float, ...] | None = None       # firmware dead-band (0-2 whole ticks)

    @classmethod
    def draw(cls, seed: int, joints: int) -> "Perturbation":
        g = np.random.default_rng(seed)

        def uniform(lo: float, hi: float) -> tuple[float, ...]:
            return tuple(float(x) for x in g.uniform(lo, hi, joints))

        def log_uniform(lo: float, hi: float) -> tuple[float, ...]:
            return tuple(math.exp(x) for x in uniform(math.log(lo), math.log(hi)))
        friction = log_uniform(0.5, 2.0)
        first = dict(friction_scale=friction, gain_scale=uniform(0.7, 1.3), mass_scale=uniform(0.8, 1.2),
                     backlash=uniform(0.0, math.radians(1.5)), latency_s=int(g.integers(0, 3)) / CONTROL_HZ)
        return cls(**first, viscous_scale=log_uniform(0.5, 2.0), friction_load_scale=log_uniform(0.5, 2.0),
                   armature_scale=log_uniform(0.8, 1.25),
                   deadband_ticks=tuple(float(x) for x in g.integers(0, 3, joints)))

    def identified(self, robot: RobotDescription, servo: str):
        """This arm as `soarm sysid` would write it (soarm.identified.IdentifiedArm)."""
        from soarm.identified import IdentifiedArm

        arm = lambda x: None if x is None else [float(x[i]) for i in robot.arm_index]  # noqa: E731
        return IdentifiedArm(servo=servo, joints=list(robot.arm_joints), gain_scale=arm(self.gain_scale),
                             friction_scale=arm(self.friction_scale), mass_scale=arm(self.mass_scale),
                             backlash_deg=[math.degrees(b) for b in arm(self.backlash)],
                             latency_ticks=round(self.latency_s * CONTROL_HZ),
                             viscous_scale=arm(self.viscous_scale), friction_load_scale=arm(self.friction_load_scale),
                             armature_scale=arm(self.armature_scale), deadband_ticks=arm(self.deadband_ticks))

    def centre(self):
        """This arm as an identified one would be written (soarm.identified.Centre)."""
        import torch

        from soarm.identified import Centre

        row = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
        return Centre(row(self.gain_scale), row(self.friction_scale), row(self.mass_scale), row(self.backlash),
                      round(self.latency_s * CONTROL_HZ), row(self.viscous_scale), row(self.friction_load_scale),
                      row(self.armature_scale), row(self.deadband_ticks))


@dataclass(frozen=True)
class PlantState:
    q: list[float]           # rad, every joint
    qd: list[float]          # rad/s
    time_s: float            # simulated time since start
    lag_s: float             # simulated time dropped because the physics fell behind real time


class PlantProcess:
    """Parent side: starts the physics process, reads its state, sends it commands."""

    def __init__(self, robot: RobotDescription, dt: float = 0.0056, q0: list[float] | None = None,
                 compile: bool = False, kind: str = "armsim", perturbation: Perturbation | None = None):
        """kind: 'armsim' (our training plant; `dt`, `compile`, `perturbation` apply) or
        'mujoco' (the published MJCF, at its own time step)."""
        if kind not in PLANTS:
            raise ValueError(f"unknown plant '{kind}'; known: {', '.join(PLANTS)}")
        if perturbation is not None and kind != "armsim":
            raise ValueError(f"a perturbed plant is ours (armsim), not '{kind}'")
        # Forked from a clean server process that has torch imported but never ran it: a plant
        # starts in a fraction of a second, and nothing forks a process holding torch threads.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "soarm.sim", "soarm.mujoco_arm", "soarm.robot.plant"])
        J = self.J = len(robot.joints)
        self._state = ctx.RawArray("d", 3 + 2 * J)
        self._cmd = ctx.RawArray("d", 1 + 3 * J)
        self._lock = ctx.Lock()
        self._stop = ctx.Event()
        ready = ctx.Event()
        self._proc = ctx.Process(target=_serve, name="soarm-plant", daemon=True,
                                 args=(robot, dt, q0, compile, kind, perturbation, self._state, self._cmd, self._lock,
                                       self._stop, ready))
        self._proc.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.05):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"emulator physics did not start (exit code {self._proc.exitcode})")
        self._place_seq = 0

    # ------------------------------------------------------------ views on shared memory
    def _s(self) -> np.ndarray:
        return np.frombuffer(self._state, dtype=np.float64)

    def _c(self) -> np.ndarray:
        return np.frombuffer(self._cmd, dtype=np.float64)

    def _goal_view(self) -> np.ndarray:
        return self._c()[1:1 + self.J]

    # ------------------------------------------------------------ bus side
    def state(self) -> PlantState:
        with self._lock:
            s = self._s().copy()
        J = self.J
        return PlantState(s[3:3 + J].tolist(), s[3 + J:3 + 2 * J].tolist(), float(s[1]), float(s[2]))

    def command_goal(self, joint: int, rad: float) -> None:
        with self._lock:
            self._goal_view()[joint] = rad

    def command_torque(self, joint: int, on: bool) -> None:
        with self._lock:
            self._c()[1 + self.J + joint] = 1.0 if on else 0.0

    def place(self, q: list[float]) -> None:
        """Put the arm at q (rad), at rest; the published state says so at once."""
        J = self.J
        with self._lock:
            self._place_seq += 1
            c, s = self._c(), self._s()
            c[0] = self._place_seq
            c[1 + 2 * J:1 + 3 * J] = q
            s[3:3 + J] = q
            s[3 + J:3 + 2 * J] = 0.0

    def wait(self, sim_seconds: float, timeout: float = 120.0) -> bool:
        """Block until the simulated clock has advanced by sim_seconds (tests, scripted
        operators: 'let the arm move for 1 s' holds on any machine speed)."""
        end = self.state().time_s + sim_seconds
        deadline = time.monotonic() + timeout
        while self.state().time_s < end:
            if time.monotonic() > deadline or not self._proc.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self._stop.set()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# ---------------------------------------------------------------- the physics process
PLANTS = ("armsim", "mujoco")


class _ArmSimStepper:
    """Our training plant, one arm: ArmSim with the STS3215 model, perturbed where asked."""

    def __init__(self, robot, dt: float, q0, compile: bool, perturbation: Perturbation | None = None):
        import torch

        from soarm import config
        from soarm.servo import ServoConfig
        from soarm.sim import ArmSim

        self.torch = torch
        servo_cfg = config.load(ServoConfig, SERVO_FILE)
        play = max(perturbation.backlash) if perturbation else 0.0
        self.sim = sim = ArmSim(robot, servo_cfg.params, servo_cfg.registers, 1, dt, backlash=play)
        self.dt = dt
        self.latency_s = perturbation.latency_s if perturbation else 0.0
        if perturbation:
            sim.physics = perturbation.centre().apply(sim.physics)
        q_start = q0 if q0 is not None else rest_pose(sim)
        sim.reset(torch.ones(1, dtype=torch.bool), torch.tensor([q_start], dtype=torch.float32))
        sim.enabled[:] = False                               # servos power up with torque off
        self.t = 0.0                                         # s, this plant's clock
        self.sent = collections.deque([(0.0, sim.goal[0].numpy().copy())])   # goals on their way: (due, goal)
        if compile:
            sim.compile()

    def _row(self, x: np.ndarray):
        """[J] -> a [1, J] tensor with the strides ArmSim's own tensors have: a numpy x[None]
        has stride 0 on its new axis, and the compiled step would recompile for it (seconds
        each, the arm frozen meanwhile)."""
        return self.torch.from_numpy(np.array(x)).reshape(1, -1)

    def place(self, q: np.ndarray) -> None:
        self.sim.q = self._row(q).float()
        self.sim.qd = self.torch.zeros_like(self.sim.q)

    def step(self, goal: np.ndarray, torque: np.ndarray) -> None:
        torch, sim = self.torch, self.sim
        self.t += self.dt
        self.sent.append((self.t + self.latency_s, np.array(goal)))
        while len(self.sent) > 1 and self.sent[1][0] <= self.t + 1e-9:   # the newest goal that has arrived
            self.sent.popleft()
        goal = self.sent[0][1]
        on = self._row(torque)
        rising = on & ~sim.enabled
        if bool(rising.any()):
            # Torque on: the firmware starts from where the joint is, then drives to the goal.
            sim.firmware.target = torch.where(rising, sim.q, sim.firmware.target)
            sim.firmware.target_vel = torch.where(rising, 0.0, sim.firmware.target_vel)
        sim.enabled = on
        with torch.no_grad():
            sim.step(self._row(goal).float(), 1)

    def state(self) -> tuple[list[float], list[float]]:
        return self.sim.q[0].tolist(), self.sim.qd[0].tolist()


class _MujocoStepper:
    """The independent plant, one arm: the published MJCF in MuJoCo (soarm/mujoco_arm.py).
    Torque off: the position actuator's setpoint follows the joint, so it exerts nothing."""

    def __init__(self, robot, q0):
        from soarm.mujoco_arm import MujocoArm

        self.arm = MujocoArm(robot, 1)
        self.dt = self.arm.dt
        self.torque = np.zeros(len(robot.names), dtype=bool)
        if q0 is None:                                       # let the unpowered arm settle from home
            home = dict(zip(robot.arm_joints, robot.home))
            self.place(np.array([float(home.get(n, robot.gripper_hold)) for n in robot.names]))
            for _ in range(round(10.0 / self.dt)):
                self.step(self.arm.q[0], self.torque)
        else:
            self.place(np.asarray(q0, dtype=float))

    def place(self, q: np.ndarray) -> None:
        self.arm.reset(q[None])

    def step(self, goal: np.ndarray, torque: np.ndarray) -> None:
        self.arm.step(np.where(torque, goal, self.arm.q[0])[None], self.dt)

    def state(self) -> tuple[list[float], list[float]]:
        d = self.arm.data[0]
        return d.qpos[self.arm.qadr].tolist(), d.qvel[self.arm.vadr].tolist()


def _serve(robot, dt, q0, compile, kind, perturbation, state_arr, cmd_arr, lock, stop, ready) -> None:
    import torch

    torch.set_num_threads(1)
    plant = _MujocoStepper(robot, q0) if kind == "mujoco" else _ArmSimStepper(robot, dt, q0, compile, perturbation)
    dt = plant.dt
    J = len(robot.names)
    s = np.frombuffer(state_arr, dtype=np.float64)
    c = np.frombuffer(cmd_arr, dtype=np.float64)
    t_sim, lag, seq, place_seen = 0.0, 0.0, 0, 0.0

    def publish() -> None:
        q, qd = plant.state()
        s[0], s[1], s[2] = seq, t_sim, lag
        s[3:3 + J] = q
        s[3 + J:3 + 2 * J] = qd

    with lock:
        publish()
        c[1:1 + J] = s[3:3 + J]
    ready.set()
    t0, last_warn, last_alive = time.monotonic(), -1e9, time.monotonic()
    cost = dt                                                # s of wall time per step, smoothed
    parent = mp.parent_process()
    while not stop.is_set():
        if time.monotonic() - last_alive > 0.5:
            if not parent.is_alive():                        # the emulator died: so does its physics
                return
            last_alive = time.monotonic()
        behind = time.monotonic() - t0 - lag - t_sim
        if behind < dt:
            time.sleep(dt - behind)
            continue
        if behind > (CATCH_UP_S if cost < dt / 2 else MAX_BEHIND_S):
            lag += behind - dt
            if lag > 1.0 and time.monotonic() - last_warn > 30:
                last_warn = time.monotonic()
                print(f"emulator: the physics cannot keep real time; the simulated clock runs slow "
                      f"({lag:.1f} s behind so far); replies are not delayed", file=sys.stderr, flush=True)
        with lock:
            cmd = c.copy()
        if cmd[0] != place_seen:
            place_seen = cmd[0]
            plant.place(cmd[1 + 2 * J:1 + 3 * J])
        # CPU time, not wall time: a stall that lands inside a step (SIGSTOP, a quota's throttle)
        # is not the physics' cost, and counted as such it made the plant drop that very stall.
        t_step = time.thread_time()
        plant.step(cmd[1:1 + J], cmd[1 + J:1 + 2 * J] > 0.5)
        cost += 0.05 * (time.thread_time() - t_step - cost)
        t_sim += dt
        seq += 1
        with lock:
            if c[0] == place_seen:                           # else placed meanwhile: this step is void
                publish()


def rest_pose(sim) -> list[float]:
    """Where the unpowered arm comes to rest when let go at home; settled once per robot,
    servo model, physics and step, then read from ~/.cache/soarm (the settling takes seconds
    eagerly)."""
    import torch

    robot = sim.robot
    home = dict(zip(robot.arm_joints, robot.home))
    q = [float(home.get(n, robot.gripper_hold)) for n in robot.names]
    physics = {k: v.tolist() for k, v in dataclasses.asdict(sim.physics).items()}
    key = hashlib.sha256(repr((robot, sim.servo, sim.registers, sim.dt, q, physics)).encode()).hexdigest()[:16]
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "soarm" / f"rest-pose-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    sim.reset(torch.ones(1, dtype=torch.bool), torch.tensor([q], dtype=torch.float32))
    sim.enabled[:] = False
    chunk = round(0.5 / sim.dt)
    with torch.no_grad():
        for _ in range(20):                                  # at most 10 s; it settles in about 4.5 s
            sim.step(sim.goal, chunk)
            if float(sim.qd.abs().max()) < 1e-3:
                break
    rest = sim.q[0].tolist()
    try:
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(rest)))
    except OSError:
        pass                                                 # a read-only home: settle again next time
    return rest
