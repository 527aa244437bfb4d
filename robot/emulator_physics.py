"""The emulated arm's physics, in a process of its own, so that the servo bus never waits for it.

The plant (soarm/plant.py) is ours (SimPlant: ArmSim with the task's servo model, at the task's
physics step) or the published SO-101 MJCF in MuJoCo (soarm/mujoco_arm.py, an independent
one). The bus side (robot/emulator.py) answers every packet from the latest published state
and hands goals and torque switches over as commands; this process steps the plant toward
real time in slices of one physics step and publishes the state after each. A plant whose
steps take at most half their simulated time in CPU time replays a stall (its process kept
off the CPU by a busy machine) up to CATCH_UP_S, so the arm's clock stays the host's: a
dropped stall is a moment the arm froze, which no real arm does, and a log recorded across it
is one that no replay explains. When the plant cannot keep real time (eager physics on a slow
or busy machine), the simulated clock runs slow instead: the backlog beyond MAX_BEHIND_S is
dropped and counted in `PlantState.lag_s` (a larger one would reach the host as latency), and
the bus keeps answering from the newest state. Nothing about the replies' timing depends on
the physics.

    plant = PlantProcess(robot, q0=None)      # None: the pose the unpowered arm settles in
    PlantProcess(robot, arm=ArmParams.random(seed, robot, servo))   # an arm unlike the nominal one
    plant.command_goal(j, rad); plant.command_torque(j, True); plant.place(q)
    plant.command_registers(j, ServoRegisters(p=16, d=32, i=0, acceleration=254, torque_limit=1000))
    plant.state().q ...; plant.close()

The registers a host writes to each servo (P, D, I, Acceleration, Torque_Limit) drive our
plant's servo model joint by joint, and the firmware's overload and overcurrent cut-out
(robot/servo_protection.py) watches its duty and current; the MJCF's actuators are its own
and ignore both (it reports no load or current).

Shared memory (float64), laid out by `Shared`: the state the physics publishes and the
commands the bus side writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from soarm import CONFIG_DIR, config
from soarm.arm_params import ArmParams
from soarm.description import RobotDescription
from soarm.files import atomic_write
from soarm.reach import ReachCfg
from soarm.robot.control_table import DEFAULTS
from soarm.robot.servo_protection import REGISTERS as PROTECTION
from soarm.robot.servo_protection import Protection

TASK_FILE = CONFIG_DIR / "task" / "reach.yaml"     # the physics step, servo model and control rate
MAX_BEHIND_S = 0.05          # s: a larger backlog of a slow plant is dropped (the simulated clock slows)
CATCH_UP_S = 0.3             # s: the longest stall a plant running twice real time replays
START_TIMEOUT_S = 300.0      # torch import, first rest-pose settle (cached after), compile
PLANTS = ("armsim", "mujoco")
REGISTERS = ("p", "d", "i", "acceleration", "torque_limit")     # ServoRegisters' per-joint fields


class Shared:
    """Named views of one flat float64 array shared by the two processes, in a fixed order."""

    def __init__(self, flat: np.ndarray, fields: list[tuple[str, tuple[int, ...]]]):
        at = 0
        for name, shape in fields:
            n = int(np.prod(shape))
            setattr(self, name, flat[at:at + n].reshape(shape))
            at += n

    @staticmethod
    def size(fields: list[tuple[str, tuple[int, ...]]]) -> int:
        return sum(int(np.prod(shape)) for _, shape in fields)


def state_fields(J: int) -> list[tuple[str, tuple[int, ...]]]:
    """What the physics publishes after every step."""
    return [("seq", (1,)), ("time_s", (1,)), ("lag_s", (1,)), ("q", (J,)), ("qd", (J,)), ("duty", (J,)),
            ("current", (J,)), ("status", (J,)), ("cut", (J,))]


def command_fields(J: int) -> list[tuple[str, tuple[int, ...]]]:
    """What the bus side asks of the physics (supply_v 0: the servo model's own voltage)."""
    return [("place_seq", (1,)), ("goal", (J,)), ("torque", (J,)), ("place_q", (J,)),
            ("registers", (len(REGISTERS), J)), ("protection", (len(PROTECTION), J)), ("supply_v", (1,))]


@dataclass(frozen=True)
class PlantState:
    q: list[float]           # rad, every joint
    qd: list[float]          # rad/s
    time_s: float            # simulated time since start
    lag_s: float             # simulated time dropped because the physics fell behind real time
    duty: list[float]        # PWM last step, signed fraction of full (0: torque off, or the MJCF)
    current_a: list[float]   # motor current, A
    status: list[int]        # Status bits the firmware's cut-out latched
    cut: list[bool]          # the drive turned off by an overcurrent


class PlantProcess:
    """Parent side: starts the physics process, reads its state, sends it commands."""

    def __init__(self, robot: RobotDescription, q0: list[float] | None = None, compile: bool = False,
                 kind: str = "armsim", arm: ArmParams | None = None):
        """kind: 'armsim' (our training plant; `compile` and `arm`, an arm unlike the nominal
        one, apply) or 'mujoco' (the published MJCF, at its own time step)."""
        if kind not in PLANTS:
            raise ValueError(f"unknown plant '{kind}'; known: {', '.join(PLANTS)}")
        if arm is not None and kind != "armsim":
            raise ValueError(f"a perturbed plant is ours (armsim), not '{kind}'")
        # Forked from a clean server process that has torch imported but never ran it: a plant
        # starts in a fraction of a second, and nothing forks a process holding torch threads.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "soarm.plant", "soarm.mujoco_arm", "soarm.robot.emulator_physics"])
        J = self.J = len(robot.joints)
        self._state = ctx.RawArray("d", Shared.size(state_fields(J)))
        self._cmd = ctx.RawArray("d", Shared.size(command_fields(J)))
        self._s = Shared(np.frombuffer(self._state, dtype=np.float64), state_fields(J))
        self._c = Shared(np.frombuffer(self._cmd, dtype=np.float64), command_fields(J))
        self._lock = ctx.Lock()
        self._stop = ctx.Event()
        ready = ctx.Event()
        self._proc = ctx.Process(target=_serve, name="soarm-plant", daemon=True,
                                 args=(robot, q0, compile, kind, arm, self._state, self._cmd, self._lock, self._stop,
                                       ready))
        self._proc.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.05):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"emulator physics did not start (exit code {self._proc.exitcode})")
        self._place_seq = 0

    # ------------------------------------------------------------ bus side
    def state(self) -> PlantState:
        with self._lock:
            s = Shared(np.frombuffer(self._state, dtype=np.float64).copy(), state_fields(self.J))
        return PlantState(s.q.tolist(), s.qd.tolist(), float(s.time_s[0]), float(s.lag_s[0]), s.duty.tolist(),
                          s.current.tolist(), s.status.astype(int).tolist(), (s.cut > 0.5).tolist())

    def command_goal(self, joint: int, rad: float) -> None:
        with self._lock:
            self._c.goal[joint] = rad

    def command_torque(self, joint: int, on: bool) -> None:
        with self._lock:
            self._c.torque[joint] = 1.0 if on else 0.0

    def command_registers(self, joint: int, registers) -> None:
        """One servo's control registers (a ServoRegisters), as its host wrote them."""
        with self._lock:
            self._c.registers[:, joint] = [getattr(registers, name) for name in REGISTERS]

    def command_protection(self, joint: int, values: list[int]) -> None:
        """One servo's cut-out registers (servo_protection.REGISTERS, in that order), as written."""
        with self._lock:
            self._c.protection[:, joint] = values

    def command_supply(self, volts: float) -> None:
        """The arm's supply voltage from now on (a sagging supply drives every motor weaker).
        With compiled physics the first change recompiles the step (seconds of frozen arm)."""
        with self._lock:
            self._c.supply_v[0] = volts

    def place(self, q: list[float]) -> None:
        """Put the arm at q (rad), at rest; the published state says so at once."""
        with self._lock:
            self._place_seq += 1
            self._c.place_seq[0] = self._place_seq
            self._c.place_q[:] = q
            self._s.q[:] = q
            self._s.qd[:] = 0.0

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
def build_plant(robot: RobotDescription, q0, compile: bool, kind: str, arm: ArmParams | None):
    """One arm of the plant `kind`, at rest at q0 (None: where the unpowered arm settles), torque
    off as servos power up. Our plant is `arm`, or the task's model of the arm."""
    from soarm.arm_params import load_arm
    from soarm.mujoco_arm import MujocoArm
    from soarm.plant import SimPlant
    from soarm.servo import ServoConfig

    task = config.load(ReachCfg, TASK_FILE)
    if arm is None and task.arm is not None and kind == "armsim":
        arm = load_arm(task.arm, robot, task.servo)
    if kind == "mujoco":
        plant = MujocoArm(robot, 1)
    else:
        servo = config.load(ServoConfig, CONFIG_DIR / task.servo)
        plant = SimPlant.build(robot, servo, 1, task.physics_dt, arm=arm, compile=compile, reports_drive=True)
    q = np.asarray(q0 if q0 is not None else rest_pose(plant, robot, kind), dtype=float)
    plant.reset(q[None])
    plant.torque(np.zeros((1, len(q)), dtype=bool))
    if arm is not None:
        plant.latency_s = arm.latency_s(task.control_hz)
    return plant


def _serve(robot, q0, compile, kind, arm, state_arr, cmd_arr, lock, stop, ready) -> None:
    import torch

    torch.set_num_threads(1)
    plant = build_plant(robot, q0, compile, kind, arm)
    dt = plant.dt
    J = len(robot.names)
    s = Shared(np.frombuffer(state_arr, dtype=np.float64), state_fields(J))
    shared_cmd = np.frombuffer(cmd_arr, dtype=np.float64)
    c = Shared(shared_cmd, command_fields(J))
    t_sim, lag, seq, place_seen = 0.0, 0.0, 0, 0.0
    drives = kind == "armsim"                 # our servo model: registers, duty, current, cut-out
    protection = Protection(J)
    servo_volts = plant.sim.servo.voltage if drives else 0.0
    duty = current = np.zeros(J)
    on_before = np.zeros(J, dtype=bool)

    def publish() -> None:
        s.seq[0], s.time_s[0], s.lag_s[0] = seq, t_sim, lag
        s.q[:], s.qd[:], s.duty[:], s.current[:] = plant.q[0], plant.qd[0], duty, current
        s.status[:], s.cut[:] = protection.status, protection.cut()

    with lock:
        publish()
        c.goal[:] = s.q
        if drives:
            c.registers[:] = [[getattr(plant.sim.registers, name)] * J for name in REGISTERS]
        c.protection[:] = [[DEFAULTS[name]] * J for name in PROTECTION]
    registers_seen = c.registers.copy()
    supply_seen = 0.0
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
            cmd = Shared(shared_cmd.copy(), command_fields(J))
        if cmd.place_seq[0] != place_seen:
            place_seen = cmd.place_seq[0]
            plant.reset(cmd.place_q[None])
        on = cmd.torque > 0.5
        protection.clear(on & ~on_before)                    # torque on again: the firmware starts afresh
        on_before = on
        if drives and cmd.supply_v[0] != supply_seen:
            supply_seen = cmd.supply_v[0]
            plant.supply(supply_seen or servo_volts)
        written = cmd.registers                              # a copy: the in-force torque limit goes in
        limit = REGISTERS.index("torque_limit")
        written[limit] = protection.torque_limit(written[limit], cmd.protection)
        if drives and (written != registers_seen).any():
            registers_seen = written.copy()
            plant.sim.registers = dataclasses.replace(
                plant.sim.registers, **{name: torch.tensor(row, dtype=plant.sim.q.dtype)[None]
                                        for name, row in zip(REGISTERS, written)})
        # CPU time, not wall time: a stall that lands inside a step (SIGSTOP, a quota's throttle)
        # is not the physics' cost, and counted as such it made the plant drop that very stall.
        t_step = time.thread_time()
        plant.torque((on & ~protection.cut())[None])
        plant.step(cmd.goal[None], dt)
        if drives:
            duty, current = (x[0] for x in plant.load_and_current())
            protection.update(t_sim + dt, duty, current, on, cmd.protection)
        cost += 0.05 * (time.thread_time() - t_step - cost)
        t_sim += dt
        seq += 1
        with lock:
            if c.place_seq[0] == place_seen:                 # else placed meanwhile: this step is void
                publish()


def rest_pose(plant, robot: RobotDescription, kind: str) -> list[float]:
    """Where the unpowered arm comes to rest when let go at home (soarm.plant.rest_pose); for our
    plant settled once per robot, servo model, physics and step, then read from ~/.cache/soarm
    (the settling takes seconds eagerly)."""
    from soarm.plant import rest_pose as settle

    q = robot.home_pose
    if kind != "armsim":
        return settle(plant, q).tolist()
    sim = plant.sim
    physics = {k: v.tolist() for k, v in dataclasses.asdict(sim.physics).items()}
    key = hashlib.sha256(repr((robot, sim.servo, sim.registers, sim.dt, q.tolist(), physics)).encode()).hexdigest()[:16]
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "soarm" / f"rest-pose-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    rest = settle(plant, q).tolist()
    try:
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(rest)))
    except OSError:
        pass                                                 # a read-only home: settle again next time
    return rest
