"""`soarm sysid`: the user's own arm identified from logs of its motion (`soarm excite` records them).

The logs (soarm.logs.MotionLog, any reader) are cut into windows of commanded motion (torque
on, a goal sent every tick). Every candidate arm replays every window in one batched plant
(soarm.plant.SimPlant, the training plant): from the logged angles at the window's start, the
logged goals (held between ticks, `latency` late) drive it, and its encoder readings are
compared with the logged ones at the logged times.

The search is the one of identification (calibration/search.py), one group per joint in the
same batch: a joint's parameters (soarm.arm_params.JOINT_FIELDS: loop gain, Coulomb, viscous and
load-dependent friction, armature, dead-band, link mass, backlash, stiction) are ranked by that
joint's own tracking error over every window (the one where it moves, and the ones where it is
held against the others' motion), which keeps five 9-parameter searches instead of one
45-parameter one; a link's mass, which loads every joint before it, is ranked by their summed
error. The latency, one for the arm, is scanned in whole control ticks before, midway and
after. `SysidCfg.fitted` names what is searched; the rest stays at the servo model's values.

Held-out error: with several logs, whole logs are left out (`folds` groups of them, each
fitted on the others) and replayed whole, from their first pose to their end, as `soarm
arm-check` replays them; from one log, its windows are split by the base pose nearest to them
(the plan's `home` and `park`, gravity-loaded and folded), each half fitted alone and scored
on the other. The servo model replays the same motions beside it. A fit that replays its
held-out motion no better than the servo model says so, with the figures, and writes no arm
file unless `keep_worse`.

    result = identify(read_motions(p), robot, task, SysidCfg())
    result.arm                       # ArmParams: `soarm train --set task.arm=FILE`
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from soarm import CONFIG_DIR, REPO_ROOT, config
from soarm.arm_params import JOINT_FIELDS, ArmParams, JointParams
from soarm.calibration.calibration import range_mode
from soarm.calibration.search import Scored, SearchCfg, cross_entropy, polish
from soarm.calibration.windows import Windows, as_recorded, cut_windows, whole_logs
from soarm.description import RobotDescription, load_robot
from soarm.files import atomic_write
from soarm.logs import LogError, MotionLog, read_motions
from soarm.plant import Drive, SimPlant, play
from soarm.reach import ReachCfg, full_pose
from soarm.servo import ServoConfig, ServoParams

DEFAULT_OUT = REPO_ROOT / "runs" / "sysid"          # + <time>/ per fit
PARAMS = tuple(JOINT_FIELDS)                        # theta's last axis, in this order
CORE = ("gain_scale", "coulomb", "mass_scale", "backlash")   # the first stage's
P = len(PARAMS)


@dataclass
class SysidCfg:
    window_s: float = 10.0             # s: logs are cut into windows about this long (at the stillest tick)
    min_motion_s: float = 2.0          # s of commanded motion a log must hold
    windows_per_log: int = 0           # > 0: at most this many of each log's windows, evenly spread
    folds: int = 5                     # leave-motions-out groups for the held-out error (several logs)
    keep_worse: bool = False           # write the arm file even when it replays held-out motion worse
    # A LeRobot dataset recorded with use_degrees off (-100..100 per joint): the calibration
    # file it was recorded with. Default: LeRobot 0.6's degrees.
    lerobot_calibration: Path | None = None
    search: SearchCfg = field(default_factory=SearchCfg)   # its iterations: the first stage's
    refine_iterations: int = 6         # cross-entropy steps of the second stage
    max_latency_ticks: int = 3         # the latency scan's range, control ticks
    # torch.compile the replay's physics once for every batch size: ~1 min to compile, then
    # each replay ~3x faster (a fit replays ~25 times; docs/sysid.md). Off for tiny fits.
    compile: bool = True
    # Search bounds, per joint: multipliers of the servo model's value (searched in log space),
    # the dead-band (ticks) and the play (rad) as they are. Wider than the spread users report
    # (gain x0.7-1.3, friction x0.5-2, mass +-20 %, backlash up to ~1.5 deg).
    gain_scale: tuple[float, float] = (0.3, 3.0)
    coulomb: tuple[float, float] = (0.2, 5.0)
    viscous: tuple[float, float] = (0.2, 5.0)
    friction_load: tuple[float, float] = (0.2, 5.0)
    armature: tuple[float, float] = (0.5, 2.0)
    deadband: tuple[float, float] = (0.0, 4.0)
    mass_scale: tuple[float, float] = (0.5, 2.0)
    backlash: tuple[float, float] = (0.0, 0.0524)           # rad (3 deg)
    stiction: tuple[float, float] = (0.0, 1.0)              # N m
    fitted: tuple[str, ...] = PARAMS   # searched; the others stay at the servo model's values

    def validate(self) -> None:
        if self.refine_iterations < 0 or self.max_latency_ticks < 0 or self.windows_per_log < 0 or self.folds < 1:
            raise ValueError("refine_iterations/max_latency_ticks/windows_per_log: must not be negative; folds >= 1")
        for name, spec in JOINT_FIELDS.items():
            lo, hi = getattr(self, name)
            if not 0 <= lo < hi or (spec.multiplier and lo <= 0):
                raise ValueError(f"{name}: need 0 < low < high (backlash, dead-band: 0 <= low), got {[lo, hi]}")
        unknown = sorted(set(self.fitted) - set(PARAMS))
        if unknown:
            raise ValueError(f"fitted: unknown parameter {unknown[0]} (known: {', '.join(PARAMS)})")

    def bounds(self, servo: ServoParams) -> tuple[torch.Tensor, torch.Tensor]:
        """theta's bounds [P] each; an unfitted parameter's are its value on the servo model."""
        lo, hi = torch.tensor([_theta(n, v) for n in PARAMS for v in getattr(self, n)]).view(P, 2).T
        fixed = torch.tensor([n not in self.fitted for n in PARAMS])
        nom = nominal_theta(servo)
        return torch.where(fixed, nom, lo), torch.where(fixed, nom, hi)


def _theta(name: str, value: float) -> float:
    """A parameter's value as the search sees it: a multiplier's log, an amount as it is."""
    return math.log(value) if JOINT_FIELDS[name].multiplier else value


def nominal_values(servo: ServoParams) -> torch.Tensor:
    """[P] each parameter's value on the servo model."""
    return torch.tensor([spec.nominal(servo) for spec in JOINT_FIELDS.values()])


def nominal_theta(servo: ServoParams) -> torch.Tensor:
    """[P]: the servo model as it is (no play)."""
    return torch.tensor([0.0 if JOINT_FIELDS[n].multiplier else v for n, v in zip(PARAMS, nominal_values(servo))])


@dataclass
class Candidates:
    """B candidate arms: [B, A, P] parameters (PARAMS, as the search sees them: multipliers of
    the servo model as logs) and [B] latencies in physics steps."""
    theta: torch.Tensor
    latency: torch.Tensor

    def values(self, servo: ServoParams) -> dict[str, torch.Tensor]:
        """Each parameter [B, A] in its own units (soarm.arm_params.JointParams)."""
        nominal = nominal_values(servo)
        return {n: self.theta[..., i].exp() * nominal[i] if JOINT_FIELDS[n].multiplier else self.theta[..., i]
                for i, n in enumerate(PARAMS)}

    @classmethod
    def of(cls, arm: ArmParams, robot: RobotDescription, servo: ServoParams, substeps: int) -> Candidates:
        """One candidate: an arm already written down (identified, or the hidden one a test knows)."""
        arm = arm.resolved(robot)
        nominal = nominal_values(servo)
        theta = torch.tensor([[math.log(getattr(arm.joints[j], n) / float(nominal[i])) if JOINT_FIELDS[n].multiplier
                               else getattr(arm.joints[j], n) for i, n in enumerate(PARAMS)] for j in robot.arm_joints])
        return cls(theta[None].float(), torch.tensor([arm.latency_ticks * substeps]))


@dataclass
class JointFit:
    joint: str
    values: dict[str, float]       # JointParams' fields, their units
    rms_nominal_mrad: float        # the nominal model on every window
    rms_mrad: float                # the identified model on every window (in sample)
    rms_held_out_mrad: float | None   # mean RMS over the held-out motions, each by the fit without it
    rms_held_out_nominal_mrad: float | None = None   # the servo model on the same motions


@dataclass
class SysidResult:
    arm: ArmParams
    joints: list[JointFit]
    windows: int
    wall_s: float
    servo: ServoParams
    traces: dict = field(default_factory=dict)    # for the plot: per joint, t, measured, nominal, identified
    by_log: dict = field(default_factory=dict)    # {"held_out" | "nominal": {motion: {joint: RMS mrad}}}

    def table(self) -> list[str]:
        """Multipliers as x the servo model's, the dead-band in ticks, the play in degrees, the
        stiction in N m."""
        nominal = dict(zip(PARAMS, nominal_values(self.servo).tolist()))
        shown = lambda n, v: math.degrees(v) if n == "backlash" else (          # noqa: E731
            v / nominal[n] if JOINT_FIELDS[n].multiplier else v)
        heads = ("gain", "coul", "visc", "load", "armat", "dead", "mass", "play°", "stic")    # PARAMS' order
        lines = [f"{'joint':14s} " + " ".join(f"{h:>5s}" for h in heads) +
                 f"  {'RMS mrad: windows nominal':>25s} {'fit':>6s}  {'held out: nominal':>17s} {'fit':>6s}"]
        shown_rms = lambda x: "-" if x is None else f"{x:.2f}"    # noqa: E731
        for f in self.joints:
            lines.append(f"{f.joint:14s} " + " ".join(f"{shown(n, f.values[n]):5.2f}" for n in PARAMS) +
                         f"  {f.rms_nominal_mrad:25.2f} {f.rms_mrad:6.2f}  "
                         f"{shown_rms(f.rms_held_out_nominal_mrad):>17s} {shown_rms(f.rms_held_out_mrad):>6s}")
        held = self.held_out()
        if held is not None:
            lines.append(f"held out, mean over joints: fit {held[1]:.2f} mrad, servo model {held[0]:.2f} mrad "
                         f"({held[1] / held[0]:.2f}x)")
        lines.append(f"latency {self.arm.latency_ticks} control ticks (multipliers: x the servo model's)")
        return lines

    def held_out(self) -> tuple[float, float] | None:
        """(servo model, fit): mean RMS over joints of the held-out replay; None without one."""
        if any(f.rms_held_out_mrad is None for f in self.joints):
            return None
        return (float(np.mean([f.rms_held_out_nominal_mrad for f in self.joints])),
                float(np.mean([f.rms_held_out_mrad for f in self.joints])))

    def worse_than_nominal(self) -> str:
        """'' when the held-out replay beats the servo model's on average; else the two figures."""
        held = self.held_out()
        if held is None or held[1] < held[0]:
            return ""
        return f"held out {held[1]:.2f} mrad, servo model {held[0]:.2f} mrad"


# ---------------------------------------------------------------- windows through the plant
def play_windows(w: Windows, cand: Candidates, robot: RobotDescription, servo: ServoConfig,
           compile: bool = False) -> torch.Tensor:
    """Each candidate on each window from both ends of the gear play: its encoder readings at
    the logged times [B, 2, S, K, A] (side 0: play taken up negative, 1: positive).

    Where gravity outweighs friction the play starts at the end the load pushes into, on
    both sides; elsewhere the log cannot say where a held joint's play sits (it depends on how
    its last move settled), so both ends are played and `joint_sq_error` keeps the better."""
    B, S = cand.theta.shape[0], w.q0.shape[0]
    G = w.goals.shape[1]
    N, arm = B * 2 * S, robot.arm_index
    plant = SimPlant.build(robot, servo, N, w.dt, backlash=1e-9)         # gear play on
    sim = plant.sim
    if compile:
        sim.compile(dynamic=True)
    for name, v in cand.values(servo.params).items():                      # env = (b * 2 + side) * S + s
        getattr(sim.physics, name)[:, arm] = v.repeat_interleave(2 * S, dim=0)
    s_of = torch.arange(S).repeat(2 * B)
    side = torch.arange(2).repeat_interleave(S).repeat(B)[:, None] * 2.0 - 1.0
    full = full_pose(sim.dyn, w.q0[s_of])
    plant.latency_s = cand.latency.repeat_interleave(2 * S).numpy() * w.dt
    plant.reset(full)
    held, qd = torch.as_tensor(plant.measured(), dtype=torch.float32), torch.zeros_like(full)
    held[:, arm], qd[:, arm] = w.goals[s_of, 0], w.qd0[s_of]
    plant.reset(full, goal=held, qd=qd)
    ph = sim.physics
    _, bias = sim.dyn.mass_and_bias(sim.q, sim.qd, ph.mass_scale, None)
    sim.slack = ph.backlash / 2 * torch.where(bias.abs() > ph.coulomb + ph.stiction, torch.sign(bias), side)

    def goal(step: int) -> torch.Tensor:
        held[:, arm] = w.goals[s_of, step]
        return held
    read = np.zeros(G + 1, dtype=bool)
    read[w.at.unique().numpy()] = True
    readings = torch.from_numpy(play(plant, Drive(goal, np.full(G, w.dt), read=read))[..., arm]).float()
    row = torch.from_numpy(np.cumsum(read) - 1)                           # step -> its row of `readings`
    A = len(arm)
    out = readings[row[w.at[s_of]], torch.arange(N)[:, None, None], torch.arange(A)]   # [N, K, A]
    return out.reshape(B, 2, S, *out.shape[1:])


def side_sq_error(w: Windows, readings: torch.Tensor) -> torch.Tensor:
    """Summed squared error per candidate, end of the play, window and joint [B, 2, S, A]."""
    err = (readings - w.measured[None, None]) * w.valid[None, None, :, :, None]
    return (err ** 2).sum(dim=3)


def window_sq_error(w: Windows, readings: torch.Tensor) -> torch.Tensor:
    """Summed squared error per candidate, window and joint [B, S, A], from the better end
    of the play for each held joint."""
    return side_sq_error(w, readings).amin(dim=1)


def replay_rms(w: Windows, cand: Candidates, robot: RobotDescription, servo: ServoConfig,
               compile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One candidate on each window, as `soarm arm-check` scores it: (RMS [S, A] mrad, the
    readings [S, K, A] from the better end of the play per joint)."""
    readings = play_windows(w, cand, robot, servo, compile)[0]              # [2 sides, S, K, A]
    side = side_sq_error(w, readings[None])[0].argmin(dim=0)                # [S, A]
    best = torch.gather(readings, 0, side[None, :, None, :].expand(1, *readings.shape[1:]))[0]
    err = (best - w.measured) * w.valid[..., None]
    return 1000 * (err.square().sum(dim=1) / w.valid.sum(dim=1, keepdim=True)).sqrt(), best


def joint_sq_error(w: Windows, readings: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each candidate's joint over every window's readings [B, A]."""
    return window_sq_error(w, readings).sum(dim=1) / w.valid.sum()


# ---------------------------------------------------------------- search
@dataclass
class Fitting:
    """One fit's inputs: the windows, the arm and its servo model, the physics steps per
    control tick (the latency's unit), the config; and the arm's latency as last scanned."""
    w: Windows
    robot: RobotDescription
    servo: ServoConfig
    substeps: int
    cfg: SysidCfg
    latency: torch.Tensor = field(default_factory=lambda: torch.tensor([0]))   # [1] physics steps

    def errors(self, cand: Candidates, w: Windows | None = None) -> torch.Tensor:
        """Mean squared error [B, A] of each candidate's joints over windows `w` (default: the fit's)."""
        w = self.w if w is None else w
        return joint_sq_error(w, play_windows(w, cand, self.robot, self.servo, self.cfg.compile))

    def objective(self, theta: torch.Tensor) -> Scored:
        """The search's objective at the latency scanned last: a joint's parameters ranked by its
        own error, a link's mass by the summed error of every joint that carries it."""
        err = self.errors(Candidates(theta, self.latency.expand(theta.shape[0])))
        carried = err.cumsum(dim=1)
        return Scored(err, torch.stack([carried if n == "mass_scale" else err for n in PARAMS], dim=2))

    def scan_latency(self, theta: torch.Tensor) -> torch.Tensor:
        """The latency (physics steps, [1]) that fits the arm `theta` [A, P] best, in whole control
        ticks as training draws it: a finer grid trades a few ms of latency against loop gain."""
        steps = torch.arange(0, self.cfg.max_latency_ticks + 1) * self.substeps
        err = self.errors(Candidates(theta.expand(len(steps), *theta.shape), steps))
        return steps[err.sum(dim=1).argmin()][None]

    def rescan(self, theta: torch.Tensor) -> None:
        self.latency = self.scan_latency(theta)


def _mrad(sq: torch.Tensor) -> str:
    return "RMS per joint " + " ".join(f"{1000 * math.sqrt(float(e)):.1f}" for e in sq) + " mrad"


def fit(fitting: Fitting, out: Callable[[str], None] = print, label: str = "fit") -> Candidates:
    """The identified arm as one candidate: per-joint cross-entropy search in two stages, a
    pattern search, the latency scanned before, midway and after each stage. Stage 1 searches
    what the motion shows most (`CORE`: gain, friction with the viscous part tied to the Coulomb
    part, link mass, play); stage 2 the rest (the friction split, load-dependent friction,
    armature, dead-band) from there; the pattern search then moves them all. Searched all at
    once, the 8-parameter space left the shoulder lift at twice the error its hidden values
    replay at (docs/sysid.md)."""
    cfg, A = fitting.cfg, fitting.w.q0.shape[1]
    gen = torch.Generator().manual_seed(cfg.search.seed)
    lo, hi = cfg.bounds(fitting.servo.params)                 # theta's bounds, [P] each
    mean = nominal_theta(fitting.servo.params).expand(A, P).clone()   # the nominal arm ...
    play_at = PARAMS.index("backlash")
    mean[:, play_at] = (lo[play_at] + hi[play_at]) / 4        # ... with a quarter of the play's range
    core = torch.tensor([n in CORE for n in PARAMS])
    tie = (PARAMS.index("viscous"), PARAMS.index("coulomb")) \
        if "coulomb" in cfg.fitted and "viscous" in cfg.fitted else None
    std = torch.where(core, (hi - lo) / 4, 0.0).expand(A, P).clone()
    fitting.rescan(mean)
    stage = lambda mean, std, steps, tie, name: cross_entropy(                 # noqa: E731
        fitting.objective, mean, std, lo, hi, steps, cfg.search, gen, out, f"sysid {label}, {name}", tie=tie,
        midway=fitting.rescan, show=_mrad)
    mean, std = stage(mean, std, cfg.search.iterations, tie, "stage 1")
    fitting.rescan(mean)
    rest = ~core & (hi > lo)
    if rest.any():
        found = std
        mean, rest_std = stage(mean, torch.where(rest, (hi - lo) / 8, 0.0).expand(A, P), cfg.refine_iterations,
                               None, "stage 2")
        fitting.rescan(mean)
        std = torch.where(rest, rest_std, found)
    mean = polish(fitting.objective, mean, std, lo, hi, cfg.search.polish_steps, out, f"sysid {label}", show=_mrad)
    return Candidates(mean[None], fitting.scan_latency(mean))


def rms_per_joint(fitting: Fitting, cand: Candidates, w: Windows | None = None) -> torch.Tensor:
    """[A] mrad of one candidate over windows `w` (default: the fit's)."""
    return 1000 * fitting.errors(cand, w)[0].sqrt()


def nominal(A: int, servo: ServoParams) -> Candidates:
    return Candidates(nominal_theta(servo).expand(1, A, P).clone(), torch.tensor([0]))


def identify(logs: list[MotionLog], robot: RobotDescription, task: ReachCfg, cfg: SysidCfg,
             out: Callable[[str], None] = print) -> SysidResult:
    """Fit the arm on every window; the held-out error from folds fitted without some of them."""
    t0 = time.time()
    cfg.validate()
    servo = as_recorded(config.load(ServoConfig, CONFIG_DIR / task.servo), logs)
    w = cut_windows(logs, robot, cfg.window_s, cfg.min_motion_s, task.physics_dt, cfg.windows_per_log)
    fitting = Fitting(w, robot, servo, task.substeps, cfg)
    arm = list(robot.arm_joints)
    A = len(arm)
    out(f"sysid: {w.q0.shape[0]} windows of motion from {len(logs)} log(s), "
        f"{float(w.at.amax(dim=(1, 2)).sum()) * w.dt:.0f} s in all")
    best = fit(fitting, out, "all windows")
    start = nominal(A, servo.params)
    held, held_nominal, by_log = None, None, {}
    folds = held_out_folds(w, cfg.folds, logs, robot, task.physics_dt)
    if folds:                                   # each fold's motions replayed by a fit without them
        rms = {"held_out": [], "nominal": []}                              # [motions, A] per fold
        for fold in folds:
            cand = fit(Fitting(w.take(fold.fitted), robot, servo, task.substeps, cfg), out, f"without {fold.name}")
            for key, c in (("held_out", cand), ("nominal", start)):
                r = replay_rms(fold.scored, c, robot, servo, cfg.compile)[0]
                rms[key].append(r)
                by_log.setdefault(key, {}).update({s: _per(arm, x) for s, x in zip(fold.scored.source, r)})
        held, held_nominal = (torch.cat(rms[key]).mean(dim=0) for key in ("held_out", "nominal"))
        out("sysid held out, RMS per joint (mrad): fit " + " ".join(f"{x:.2f}" for x in held) +
            ", servo model " + " ".join(f"{x:.2f}" for x in held_nominal))
    both = Candidates(torch.cat([start.theta, best.theta]), torch.cat([start.latency, best.latency]))
    readings = play_windows(w, both, robot, servo, cfg.compile)              # [2: nominal, fit; 2 sides, S, K, A]
    rms_nom, rms_fit = 1000 * joint_sq_error(w, readings).sqrt()
    values = {k: v[0] for k, v in best.values(servo.params).items()}
    identified = ArmParams(
        servo=task.servo, latency_ticks=int(round(float(best.latency[0]) / task.substeps)),
        joints={n: JointParams(**{k: round(float(values[k][j]), 6) for k in PARAMS}) for j, n in enumerate(arm)},
        source={"logs": [log.source for log in logs], "registers": dataclasses.asdict(servo.registers),
                "rms_mrad": {"windows": {"nominal": _per(arm, rms_nom), "fit": _per(arm, rms_fit)},
                             "held_out": None if held is None else
                             {"nominal": _per(arm, held_nominal), "fit": _per(arm, held)}}})
    joints = [JointFit(n, {k: float(values[k][j]) for k in PARAMS}, float(rms_nom[j]), float(rms_fit[j]),
                       None if held is None else float(held[j]), None if held is None else float(held_nominal[j]))
              for j, n in enumerate(arm)]
    return SysidResult(identified, joints, w.q0.shape[0], time.time() - t0, servo.params, _traces(w, readings, robot),
                       by_log)


@dataclass
class Fold:
    name: str
    fitted: list[int]              # the windows its fit sees
    scored: Windows                # the motion it is scored on, which that fit never saw


def held_out_folds(w: Windows, folds: int, logs: list[MotionLog], robot: RobotDescription,
                   dt: float) -> list[Fold]:
    """Whole logs left out in `folds` groups, each scored whole, when the windows come from
    several logs; from one, the windows nearest each base pose; [] when neither splits."""
    names = list(dict.fromkeys(w.log))
    if len(names) >= 2 and folds >= 2:
        k = min(folds, len(names))
        by_name = {Path(log.source).name: log for log in logs}
        return [Fold("+".join(group), [i for i, n in enumerate(w.log) if n not in group],
                     _motions(w, [by_name[n] for n in group], robot, dt))
                for group in (names[g::k] for g in range(k))]
    by_pose = {p: [i for i, q in enumerate(w.pose) if q == p] for p in dict.fromkeys(w.pose)}
    if len(by_pose) != 2:
        return []
    return [Fold(f"the {p} windows", [i for i in range(len(w.pose)) if i not in idx], w.take(idx))
            for p, idx in by_pose.items()]


def _motions(w: Windows, logs: list[MotionLog], robot: RobotDescription, dt: float) -> Windows:
    """`logs` replayed whole where they can be (torque on throughout), else their windows."""
    try:
        return whole_logs(logs, robot, dt)
    except LogError:
        names = {Path(log.source).name for log in logs}
        return w.take([i for i, n in enumerate(w.log) if n in names])


def _per(names: list[str], x: torch.Tensor) -> dict[str, float]:
    return {n: round(float(v), 2) for n, v in zip(names, x)}


def _traces(w: Windows, readings: torch.Tensor, robot: RobotDescription) -> dict:
    """Per arm joint, the window where its goal moves most: measured, nominal, identified
    (`readings` of the nominal and the fitted arm, as `play_windows` returns them)."""
    side = side_sq_error(w, readings).argmin(dim=1)                    # [2, S, A]
    traces = {}
    for j, name in enumerate(robot.arm_joints):
        s = int(torch.argmax(w.goals[:, :, j].amax(1) - w.goals[:, :, j].amin(1)))
        k = w.valid[s]
        nom, ident = (readings[b, side[b, s, j], s, k, j].tolist() for b in (0, 1))
        traces[name] = {"t": (w.at[s][k, j] * w.dt).tolist(), "measured": w.measured[s, k, j].tolist(),
                        "nominal": nom, "identified": ident, "window": w.source[s]}
    return traces


def plot(result: SysidResult, path: Path) -> Path:
    """One panel per arm joint: both models' replay minus the logged angle (mrad), over the
    window where that joint's goal moves most, the logged angle on the right axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result.traces)
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.2 * len(names)), squeeze=False)
    for ax, name, f in zip(axes[:, 0], names, result.joints):
        tr = result.traces[name]
        logged = np.asarray(tr["measured"])
        for key, colour, rms in (("nominal", "tab:red", f.rms_nominal_mrad), ("identified", "tab:blue", f.rms_mrad)):
            ax.plot(tr["t"], 1000 * (np.asarray(tr[key]) - logged), colour, lw=0.9,
                    label=f"{key} model ({rms:.1f} mrad RMS, all windows)")
        ax.set_ylabel(f"{name}\nmodel - log (mrad)", fontsize=8)
        ax.set_title(tr["window"], fontsize=8, loc="right")
        ax.legend(fontsize=7, loc="upper left")
        angle = ax.twinx()
        angle.plot(tr["t"], logged, "k", lw=0.6, alpha=0.4)
        angle.set_ylabel("logged (rad)", fontsize=7)
    axes[-1, 0].set_xlabel("s from the window's start")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    return path


def sysid(logs: list[Path], out_dir: Path, cfg: SysidCfg, out: Callable[[str], None] = print,
          task_file: Path = CONFIG_DIR / "task" / "reach.yaml") -> SysidResult:
    """`soarm sysid`: fit the logs; write arm.yaml (for training), sysid.json and sysid.png."""
    task = config.load(ReachCfg, task_file)
    to_rad = None if cfg.lerobot_calibration is None else range_mode(cfg.lerobot_calibration)
    result = identify([m for p in logs for m in read_motions(p, to_rad)], load_robot(), task, cfg, out)
    out_dir = Path(out_dir)
    worse = result.worse_than_nominal()
    if worse and not cfg.keep_worse:
        for line in result.table():
            out(line)
        raise ValueError(f"sysid: the fit replays its held-out motion worse than the servo model ({worse}); "
                         "no arm file written (--keep-worse writes it anyway)")
    arm_file = config.dump(result.arm, out_dir / "arm.yaml")
    report = {"arm": str(arm_file), "windows": result.windows, "latency_ticks": result.arm.latency_ticks,
              "wall_s": round(result.wall_s, 1), "joints": [vars(j) for j in result.joints], "by_log": result.by_log}
    atomic_write(out_dir / "sysid.json", lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    png = plot(result, out_dir / "sysid.png")
    for line in result.table():
        out(line)
    out(f"soarm sysid: {result.windows} windows fitted in {result.wall_s:.0f} s; train on it with "
        f"`soarm train --set task.arm={arm_file.resolve()}`; report {out_dir / 'sysid.json'}, plot {png}")
    return result

