"""`soarm sysid`: the user's own arm identified from encoder logs (`soarm excite` records them).

The logs are cut into windows of commanded motion (torque on, a goal sent every tick). Every
candidate arm replays every window in one batched ArmSim: from the logged angles at the
window's start, the logged goals (held between ticks, `latency` late) drive it, and its
encoder readings are compared with the logged ones at the logged times.

The search is the cross-entropy method, one per joint in the same batch: a joint's loop
gain, Coulomb, viscous and load-dependent friction, armature, dead-band, link mass and
backlash (`PARAMS`) are ranked by that joint's own tracking error over every window (the one
where it moves, and the ones where it is held against the others' motion), which keeps five
8-parameter searches instead of one 40-parameter one; a link's mass, which loads every joint
before it, is ranked by their summed error. The latency, one for the arm, is scanned in whole
control ticks before, midway and after. `SysidCfg.fitted` names what is searched; the rest
stays at the servo model's values.

Held-out error: windows are split by the base pose nearest to them (the plan's `home` and
`park`, gravity-loaded and folded); each half is fitted alone and scored on the other.

    result = identify([log], robot, servo_cfg, SysidCfg())
    result.arm                       # IdentifiedArm: `soarm train --set task.arm=FILE`
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from soarm.description import RobotDescription
from soarm.identified import IdentifiedArm
from soarm.robot.enclog import LogError, read_log
from soarm.servo import TICK, ServoConfig, ServoParams
from soarm.sim import ArmSim

# Per-joint parameters, as soarm.identified.IdentifiedArm names them. Multipliers of the servo
# model and the robot description are searched in log space; the play and the dead-band as they are.
PARAMS = ("gain_scale", "friction_scale", "viscous_scale", "friction_load_scale", "armature_scale",
          "deadband_ticks", "mass_scale", "backlash_deg")
LINEAR = ("deadband_ticks", "backlash_deg")
CORE = ("gain_scale", "friction_scale", "mass_scale", "backlash_deg")   # fit's first stage
P = len(PARAMS)


@dataclass
class SysidCfg:
    substeps: int = 6                  # physics steps per control tick
    window_s: float = 10.0             # s: logs are cut into windows about this long (at the stillest tick)
    min_motion_s: float = 2.0          # s of commanded motion a log must hold
    population: int = 128              # candidate arms per search step (docs/sysid.md: why not 32)
    elites: int = 32
    iterations: int = 12               # cross-entropy steps of the first stage (`fit`)
    refine_iterations: int = 6         # ... and of the second
    polish_steps: int = 8              # pattern-search steps after the sampled search
    max_latency_ticks: int = 3         # the latency scan's range, control ticks
    # torch.compile the replay's physics once for every batch size: ~1 min to compile, then
    # each replay ~3x faster (a fit replays ~25 times; docs/sysid.md). Off for tiny fits.
    compile: bool = True
    # Search bounds (multipliers are searched in log space): wider than the spread users
    # report (gain x0.7-1.3, friction x0.5-2, mass +-20 %, backlash up to ~1.5 deg).
    gain_scale: tuple[float, float] = (0.3, 3.0)
    friction_scale: tuple[float, float] = (0.2, 5.0)         # x Coulomb friction
    viscous_scale: tuple[float, float] = (0.2, 5.0)
    friction_load_scale: tuple[float, float] = (0.2, 5.0)
    armature_scale: tuple[float, float] = (0.5, 2.0)
    deadband_ticks: tuple[float, float] = (0.0, 4.0)
    mass_scale: tuple[float, float] = (0.5, 2.0)
    backlash_deg: tuple[float, float] = (0.0, 3.0)
    fitted: tuple[str, ...] = PARAMS   # searched; the others stay at the servo model's values
    seed: int = 0

    def validate(self) -> None:
        if self.substeps < 1 or self.population < 2 or not 1 <= self.elites < self.population or self.iterations < 1 \
                or self.polish_steps < 0 or self.refine_iterations < 0:
            raise ValueError("substeps/population/elites/iterations: need substeps >= 1, 1 <= elites < population, "
                             "iterations >= 1")
        for name in PARAMS:
            lo, hi = getattr(self, name)
            if not 0 <= lo < hi or (name not in LINEAR and lo <= 0):
                raise ValueError(f"{name}: need 0 < low < high (backlash, dead-band: 0 <= low), got {[lo, hi]}")
        unknown = sorted(set(self.fitted) - set(PARAMS))
        if unknown:
            raise ValueError(f"fitted: unknown parameter {unknown[0]} (known: {', '.join(PARAMS)})")

    def bounds(self, servo: ServoParams) -> tuple[torch.Tensor, torch.Tensor]:
        """theta's bounds [P] each; an unfitted parameter's are its nominal value."""
        lo, hi = torch.tensor([_theta(n, v) for n in PARAMS for v in getattr(self, n)]).view(P, 2).T
        fixed = torch.tensor([n not in self.fitted for n in PARAMS])
        nom = nominal_theta(servo)
        return torch.where(fixed, nom, lo), torch.where(fixed, nom, hi)


def _theta(name: str, value: float) -> float:
    """A parameter's value as the search sees it."""
    return value if name in LINEAR else math.log(value)


def nominal_theta(servo: ServoParams) -> torch.Tensor:
    """[P]: the servo model as it is (no play)."""
    return torch.tensor([servo.deadband_ticks if n == "deadband_ticks" else 0.0 for n in PARAMS])


@dataclass
class Windows:
    """Logged motion on the physics grid, padded to one length; S windows, A arm joints."""
    q0: torch.Tensor              # [S, A] rad, measured at each window's start
    qd0: torch.Tensor             # [S, A] rad/s, estimated there
    goals: torch.Tensor           # [S, G, A] rad, the goal in force at each physics step
    at: torch.Tensor              # [S, K] long: the physics step of each logged reading
    measured: torch.Tensor        # [S, K, A] rad
    valid: torch.Tensor           # [S, K] bool (padding: False)
    pose: list[str]               # the base pose nearest each window
    source: list[str]             # "file:t0-t1 s" per window
    dt: float                     # s per physics step

    def take(self, idx: list[int]) -> "Windows":
        i = torch.tensor(idx, dtype=torch.long)
        return Windows(self.q0[i], self.qd0[i], self.goals[i], self.at[i], self.measured[i], self.valid[i],
                       [self.pose[k] for k in idx], [self.source[k] for k in idx], self.dt)


@dataclass
class Candidates:
    """B candidate arms: [B, A, P] parameters (`PARAMS`, as the search sees them: multipliers
    as logs) and [B] latencies in physics steps."""
    theta: torch.Tensor
    latency: torch.Tensor

    def values(self) -> dict[str, torch.Tensor]:
        return {n: self.theta[..., i] if n in LINEAR else self.theta[..., i].exp() for i, n in enumerate(PARAMS)}

    @classmethod
    def of(cls, arm: IdentifiedArm, substeps: int, servo: ServoParams) -> "Candidates":
        """One candidate: an arm already written down (identified, or the hidden one a test
        knows); what it leaves out is the servo model's (viscous: as its Coulomb friction)."""
        absent = {"viscous_scale": arm.friction_scale, "deadband_ticks": [servo.deadband_ticks] * len(arm.joints)}
        rows = [getattr(arm, n) if getattr(arm, n) is not None else absent.get(n, [1.0] * len(arm.joints))
                for n in PARAMS]
        theta = torch.tensor([[_theta(n, v) for v in row] for n, row in zip(PARAMS, rows)]).T
        return cls(theta[None].float(), torch.tensor([arm.latency_ticks * substeps]))


@dataclass
class JointFit:
    joint: str
    values: dict[str, float]
    rms_nominal_mrad: float        # the nominal model on every window
    rms_mrad: float                # the identified model on every window (in sample)
    rms_held_out_mrad: float | None   # fitted on one pose's windows, scored on the other's


@dataclass
class SysidResult:
    arm: IdentifiedArm
    joints: list[JointFit]
    windows: int
    wall_s: float
    traces: dict = field(default_factory=dict)    # for the plot: per joint, t, measured, nominal, identified

    def table(self) -> list[str]:
        heads = ("gain", "coul", "visc", "load", "armat", "dead", "mass", "play°")    # PARAMS' order
        lines = [f"{'joint':14s} " + " ".join(f"{h:>5s}" for h in heads) +
                 f"  {'RMS mrad: nominal':>17s} {'fit':>6s} {'held-out':>8s}"]
        for f in self.joints:
            held = "-" if f.rms_held_out_mrad is None else f"{f.rms_held_out_mrad:.2f}"
            lines.append(f"{f.joint:14s} " + " ".join(f"{f.values[n]:5.2f}" for n in PARAMS) +
                         f"  {f.rms_nominal_mrad:17.2f} {f.rms_mrad:6.2f} {held:>8s}")
        lines.append(f"latency {self.arm.latency_ticks} control ticks")
        return lines


# ---------------------------------------------------------------- logs -> windows
def load_windows(paths: list[Path], robot: RobotDescription, cfg: SysidCfg) -> Windows:
    """Every log's commanded motion as windows; LogError naming the file for a log that is
    too short, holds no motion, has torque off throughout or timestamps that go backwards."""
    arm = list(robot.arm_joints)
    poses = {"home": np.asarray(robot.home), "park": np.asarray(robot.park)}
    pieces: list[dict] = []
    for path in paths:
        header, ticks = read_log(path)
        if list(header.get("arm_joints", [])) != arm:
            raise LogError(f"{path}: logged arm joints {header.get('arm_joints')} are not this robot's {arm}")
        rate = float(header.get("rate_hz", 0) or 0)
        if not rate > 0:
            raise LogError(f"{path}: header has no control rate (rate_hz)")
        t = np.array([float(k["t"]) for k in ticks])
        back = np.flatnonzero(np.diff(t) <= 0)
        if back.size:
            raise LogError(f"{path}: timestamps go backwards at tick {back[0] + 1} (t = {t[back[0] + 1]:.3f} s)")
        on = np.array([k.get("goal_sent") is not None and k.get("q") is not None for k in ticks])
        if not on.any():
            raise LogError(f"{path}: torque is off throughout (no goal was sent); nothing to identify")
        runs = _runs(on)
        motion = sum(t[b - 1] - t[a] for a, b in runs)
        if motion < cfg.min_motion_s:
            raise LogError(f"{path}: too short: {motion:.1f} s of commanded motion, sysid needs {cfg.min_motion_s:.0f} s")
        q_all = np.array([k["q"] for k, o in zip(ticks, on) if o])
        if np.ptp(q_all, axis=0).max() < 5 * TICK:
            raise LogError(f"{path}: no motion: no joint moved more than 5 encoder ticks")
        dt = 1.0 / (rate * cfg.substeps)
        for a, b in runs:
            tr = t[a:b]
            for lo, hi in _cut(tr, np.array([k["q"] for k in ticks[a:b]]), cfg.window_s):
                sl = ticks[a + lo:a + hi]
                q = np.array([k["q"] for k in sl])
                goal = np.array([k["goal_sent"] for k in sl])
                tt = tr[lo:hi] - tr[lo]
                if tt[-1] < 1.0 or np.ptp(goal, axis=0).max() < 2 * TICK:
                    continue                                     # a hold: nothing moved here
                median = np.median(q, axis=0)
                pose = min(poses, key=lambda p: float(np.abs(poses[p] - median).sum()))
                pieces.append({"t": tt, "q": q, "goal": goal, "dt": dt, "pose": pose,
                               "source": f"{Path(path).name}:{tr[lo]:.1f}-{tr[hi - 1]:.1f} s",
                               "qd0": (q[min(2, len(q) - 1)] - q[0]) / max(tt[min(2, len(q) - 1)], 1e-6)})
    if not pieces:
        raise LogError(f"{paths[0]}: no window of commanded motion longer than 1 s")
    return _pack(pieces)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _cut(t: np.ndarray, q: np.ndarray, window_s: float) -> list[tuple[int, int]]:
    """Cut one run into windows of about window_s, each boundary at the stillest tick within
    a quarter window of where it would fall (a window starts nearly at rest)."""
    speed = np.r_[0.0, np.abs(np.diff(q, axis=0)).max(axis=1) / np.diff(t)]
    cuts, start = [0], 0
    while t[-1] - t[start] > 1.5 * window_s:
        near = np.flatnonzero(np.abs(t - (t[start] + window_s)) <= window_s / 4)
        cut = int(near[np.argmin(speed[near])])
        cuts.append(cut)
        start = cut
    return list(zip(cuts, cuts[1:] + [len(t)]))


def _pack(pieces: list[dict]) -> Windows:
    dt = pieces[0]["dt"]
    G = max(int(math.ceil(p["t"][-1] / dt)) + 1 for p in pieces)
    K = max(len(p["t"]) for p in pieces)
    S, A = len(pieces), pieces[0]["q"].shape[1]
    goals, at = np.zeros((S, G, A)), np.zeros((S, K), dtype=np.int64)
    measured, valid = np.zeros((S, K, A)), np.zeros((S, K), dtype=bool)
    for s, p in enumerate(pieces):
        grid = np.arange(G) * dt
        k = np.clip(np.searchsorted(p["t"], grid + 1e-9, side="right") - 1, 0, None)   # goal in force
        goals[s] = p["goal"][k]
        n = len(p["t"])
        at[s, :n] = np.minimum(np.round(p["t"] / dt).astype(np.int64), G - 1)
        measured[s, :n], valid[s, :n] = p["q"], True
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return Windows(f(np.array([p["q"][0] for p in pieces])), f(np.array([p["qd0"] for p in pieces])), f(goals),
                   torch.tensor(at), f(measured), torch.tensor(valid), [p["pose"] for p in pieces],
                   [p["source"] for p in pieces], dt)


# ---------------------------------------------------------------- replay
def replay(w: Windows, cand: Candidates, robot: RobotDescription, servo: ServoConfig,
           compile: bool = False) -> torch.Tensor:
    """Each candidate on each window from both ends of the gear play: its encoder readings at
    the logged times [B, 2, S, K, A] (side 0: play taken up negative, 1: positive).

    Where gravity outweighs friction the play starts at the end the load pushes into, on
    both sides; elsewhere the log cannot say where a held joint's play sits (it depends on how
    its last move settled), so both ends are replayed and `joint_sq_error` keeps the better."""
    B, S = cand.theta.shape[0], w.q0.shape[0]
    G = w.goals.shape[1]
    N, arm, sp = B * 2 * S, robot.arm_index, servo.params
    sim = ArmSim(robot, sp, servo.registers, N, w.dt, backlash=1e-9)   # gear play on
    if compile:
        sim.compile(dynamic=True)
    v = {k: x.repeat_interleave(2 * S, dim=0) for k, x in cand.values().items()}   # env = (b * 2 + side) * S + s
    ph = sim.physics
    ph.gain_scale[:, arm] = v["gain_scale"]
    ph.coulomb[:, arm] = sp.friction_coulomb * v["friction_scale"]
    ph.viscous[:, arm] = sp.friction_viscous * v["viscous_scale"]
    ph.friction_load[:, arm] = sp.friction_load * v["friction_load_scale"]
    ph.armature[:, arm] = sp.armature * v["armature_scale"]
    ph.deadband[:, arm] = v["deadband_ticks"]
    ph.mass_scale[:, arm] = v["mass_scale"]
    ph.backlash[:, arm] = torch.deg2rad(v["backlash_deg"])
    s_of = torch.arange(S).repeat(2 * B)
    side = torch.arange(2).repeat_interleave(S).repeat(B)[:, None] * 2.0 - 1.0
    full = torch.full((N, len(robot.names)), robot.gripper_hold)
    full[:, arm] = w.q0[s_of]
    sim.reset(torch.ones(N, dtype=torch.bool), full)
    sim.qd[:, arm] = w.qd0[s_of]
    sim.firmware.target[:, arm] = w.goals[s_of, 0]
    _, bias = sim.dyn.mass_and_bias(sim.q, sim.qd, ph.mass_scale, None)
    sim.slack = ph.backlash / 2 * torch.where(bias.abs() > ph.coulomb, torch.sign(bias), side)
    lat = cand.latency.repeat_interleave(2 * S)
    goal = full.clone()
    readings = torch.empty(G, N, len(arm))
    with torch.no_grad():
        for i in range(G):
            readings[i] = sim.measured()[:, arm]
            goal[:, arm] = w.goals[s_of, torch.clamp(i - lat, min=0)]
            sim.step(goal, 1)
    out = readings[w.at[s_of], torch.arange(N)[:, None]]          # [N, K, A]
    return out.reshape(B, 2, S, *out.shape[1:])


def side_sq_error(w: Windows, readings: torch.Tensor) -> torch.Tensor:
    """Summed squared error per candidate, end of the play, window and joint [B, 2, S, A]."""
    err = (readings - w.measured[None, None]) * w.valid[None, None, :, :, None]
    return (err ** 2).sum(dim=3)


def window_sq_error(w: Windows, readings: torch.Tensor) -> torch.Tensor:
    """Summed squared error per candidate, window and joint [B, S, A], from the better end
    of the play for each held joint."""
    return side_sq_error(w, readings).amin(dim=1)


def joint_sq_error(w: Windows, readings: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each candidate's joint over every window's readings [B, A]."""
    return window_sq_error(w, readings).sum(dim=1) / w.valid.sum()


# ---------------------------------------------------------------- search
def fit(w: Windows, robot: RobotDescription, servo: ServoConfig, cfg: SysidCfg,
        out: Callable[[str], None] = print, label: str = "fit") -> Candidates:
    """The identified arm as one candidate: per-joint cross-entropy search in two stages, a
    pattern search, the latency scanned. Stage 1 searches what the motion shows most (`CORE`:
    gain, friction with the viscous part tied to the Coulomb part, link mass, play); stage 2
    the rest (the friction split, load-dependent friction, armature, dead-band) from there;
    the pattern search then moves them all. Searched all at once, the 8-parameter space left
    the shoulder lift at twice the error its hidden values replay at (docs/sysid.md)."""
    A = w.q0.shape[1]
    gen = torch.Generator().manual_seed(cfg.seed)
    lo, hi = cfg.bounds(servo.params)                         # theta's bounds, [P] each
    mean = nominal_theta(servo.params).expand(A, P).clone()   # the nominal arm ...
    play = PARAMS.index("backlash_deg")
    mean[:, play] = (lo[play] + hi[play]) / 4                 # ... with a quarter of the play's range
    core = torch.tensor([n in CORE for n in PARAMS])
    tie = "friction_scale" in cfg.fitted and "viscous_scale" in cfg.fitted
    std = torch.where(core, (hi - lo) / 4, 0.0).expand(A, P).clone()
    latency = scan_latency(w, mean, robot, servo, cfg)
    mean, std, latency = _search(w, mean, std, latency, lo, hi, cfg.iterations, tie, gen, robot, servo, cfg, out,
                                 f"{label}, stage 1")
    rest = ~core & (hi > lo)
    if rest.any():
        found, rest_std = std, torch.where(rest, (hi - lo) / 8, 0.0).expand(A, P)
        mean, rest_std, latency = _search(w, mean, rest_std, latency, lo, hi, cfg.refine_iterations, False, gen,
                                          robot, servo, cfg, out, f"{label}, stage 2")
        std = torch.where(rest, rest_std, found)
    mean = polish(w, mean, latency, std, lo, hi, robot, servo, cfg, out, label)
    return Candidates(mean[None], scan_latency(w, mean, robot, servo, cfg))


def _search(w: Windows, mean: torch.Tensor, std: torch.Tensor, latency: torch.Tensor, lo: torch.Tensor,
            hi: torch.Tensor, steps: int, tie: bool, gen: torch.Generator, robot: RobotDescription,
            servo: ServoConfig, cfg: SysidCfg, out: Callable[[str], None],
            label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy steps over the parameters with std > 0 ([A, P] each) from `latency`
    (scanned for `mean`); `tie`: the viscous friction follows the Coulomb. The latency is
    scanned again midway and after.
    Returns (each joint's best-scored mean, the last std, the latency for that best)."""
    free = std > 0
    coulomb, viscous = PARAMS.index("friction_scale"), PARAMS.index("viscous_scale")
    best, best_err = mean.clone(), torch.full((mean.shape[0],), math.inf)
    for it in range(steps):
        if it == steps // 2 and it > 0:
            latency = scan_latency(w, mean, robot, servo, cfg)
            best_err[:] = math.inf                  # scored at another latency: not comparable
        theta = mean + std * torch.randn(cfg.population, *mean.shape, generator=gen)
        theta[0] = mean
        if tie:
            theta[..., viscous] = theta[..., coulomb]
        theta = torch.maximum(torch.minimum(theta, hi), lo)
        err = joint_sq_error(w, replay(w, Candidates(theta, latency.expand(cfg.population)), robot, servo,
                                       cfg.compile))
        # Each joint's best mean so far (the mean is candidate 0): a step of the search in many
        # coupled parameters can leave a joint worse than the step before.
        better = err[0] < best_err
        best, best_err = torch.where(better[:, None], theta[0], best), torch.where(better, err[0], best_err)
        elite = torch.topk(_score(err), cfg.elites, dim=0, largest=False).indices   # [elites, A, P]
        picked = torch.gather(theta, 0, elite)
        mean, std = picked.mean(0), (picked.std(0) + 0.01 * (hi - lo)) * free
        out(f"sysid {label}: step {it + 1}/{steps}, RMS per joint {_mrad(err.amin(dim=0))} mrad (best of the step)")
    return best, std, scan_latency(w, best, robot, servo, cfg)


def _score(err: torch.Tensor) -> torch.Tensor:
    """[B, A] joint errors -> [B, A, P]: what each parameter is ranked by. A joint's servo
    parameters and play by its own error; a link's mass by the summed error of every joint
    that carries it (its own and those before it)."""
    carried = err.cumsum(dim=1)
    return torch.stack([carried if n == "mass_scale" else err for n in PARAMS], dim=2)


def _mrad(sq: torch.Tensor) -> str:
    return " ".join(f"{1000 * math.sqrt(float(e)):.1f}" for e in sq)


def polish(w: Windows, mean: torch.Tensor, latency: torch.Tensor, step: torch.Tensor, lo: torch.Tensor,
           hi: torch.Tensor, robot: RobotDescription, servo: ServoConfig, cfg: SysidCfg,
           out: Callable[[str], None], label: str) -> torch.Tensor:
    """A pattern search from the cross-entropy mean: each parameter of every joint moved one
    step up and down at once (1 + 2P candidates); each (joint, parameter) keeps the best of its
    three, and halves its step where staying put was best. Correlated valleys (gain against
    friction) that the sampled search leaves short of their floor are followed down.
    The moves each (joint, parameter) chose alone are taken together; where together they
    left a joint worse than its best so far (coupled parameters: the frictions and the
    dead-band), that joint goes back to its best and halves its steps."""
    A = mean.shape[0]
    step, best = step.clone(), mean.clone()
    best_err = torch.full((A,), math.inf)
    steps = cfg.polish_steps
    for k in range(steps + 1):
        n = 1 if k == steps else 1 + 2 * P                     # the last round only scores the last move
        theta = mean.expand(n, A, P).clone()
        for p in range(P if n > 1 else 0):
            theta[1 + 2 * p, :, p] += step[:, p]
            theta[2 + 2 * p, :, p] -= step[:, p]
        theta = torch.maximum(torch.minimum(theta, hi), lo)
        err = joint_sq_error(w, replay(w, Candidates(theta, latency.expand(n)), robot, servo, cfg.compile))
        worse = err[0] > best_err
        best = torch.where(worse[:, None], best, theta[0])
        best_err = torch.where(worse, best_err, err[0])
        if k == steps:
            break
        mean = best.clone()
        step = torch.where(worse[:, None], step / 2, step)
        score = _score(err)                                                    # [1 + 2P, A, P]
        for p in range(P):
            options = score[[0, 1 + 2 * p, 2 + 2 * p], :, p]                   # [3, A]: stay, up, down
            pick = options.argmin(dim=0).masked_fill(worse, 0)
            mean[:, p] = theta[[0, 1 + 2 * p, 2 + 2 * p], :, p][pick, torch.arange(A)]
            step[:, p] = torch.where((pick == 0) & ~worse, step[:, p] / 2, step[:, p])
        out(f"sysid {label}: polish {k + 1}/{steps}, RMS per joint {_mrad(best_err)} mrad (best so far)")
    return best


def scan_latency(w: Windows, theta: torch.Tensor, robot: RobotDescription, servo: ServoConfig,
                 cfg: SysidCfg) -> torch.Tensor:
    """The latency (physics steps, [1]) that fits the arm `theta` [A, P] best, in whole control
    ticks as training draws it: a finer grid trades a few ms of latency against loop gain."""
    steps = torch.arange(0, cfg.max_latency_ticks + 1) * cfg.substeps
    err = joint_sq_error(w, replay(w, Candidates(theta.expand(len(steps), *theta.shape), steps), robot, servo,
                                   cfg.compile))
    return steps[err.sum(dim=1).argmin()][None]


def rms_per_joint(w: Windows, cand: Candidates, robot: RobotDescription, servo: ServoConfig,
                  compile: bool = False) -> torch.Tensor:
    """[A] mrad of one candidate over windows `w`."""
    return 1000 * joint_sq_error(w, replay(w, cand, robot, servo, compile))[0].sqrt()


def nominal(A: int, servo: ServoParams) -> Candidates:
    return Candidates(nominal_theta(servo).expand(1, A, P).clone(), torch.tensor([0]))


def identify(paths: list[Path], robot: RobotDescription, servo: ServoConfig, servo_file: str, cfg: SysidCfg,
             out: Callable[[str], None] = print) -> SysidResult:
    """Fit the arm on every window, and each pose's windows alone for the held-out error."""
    import time

    t0 = time.time()
    cfg.validate()
    w = load_windows(paths, robot, cfg)
    arm = list(robot.arm_joints)
    A = len(arm)
    out(f"sysid: {w.q0.shape[0]} windows of motion from {len(paths)} log(s), "
        f"{int(w.valid.sum()) * w.dt * cfg.substeps:.0f} s in all")
    best = fit(w, robot, servo, cfg, out, "all windows")
    held = None
    by_pose = {p: [i for i, q in enumerate(w.pose) if q == p] for p in dict.fromkeys(w.pose)}
    if len(by_pose) == 2:                       # each pose fitted alone, scored on the other's windows
        sq = torch.zeros(A)
        for pose, idx in by_pose.items():
            scored = w.take([i for i in range(len(w.pose)) if i not in idx])
            fold = fit(w.take(idx), robot, servo, cfg, out, f"{pose} windows only")
            sq += joint_sq_error(scored, replay(scored, fold, robot, servo, cfg.compile))[0] * scored.valid.sum()
        held = 1000 * (sq / w.valid.sum()).sqrt()
    start = nominal(A, servo.params)
    both = Candidates(torch.cat([start.theta, best.theta]), torch.cat([start.latency, best.latency]))
    readings = replay(w, both, robot, servo, cfg.compile)              # [2: nominal, fit; 2 sides, S, K, A]
    rms_nom, rms_fit = 1000 * joint_sq_error(w, readings).sqrt()
    values = {k: v[0] for k, v in best.values().items()}
    identified = IdentifiedArm(
        servo=servo_file, joints=arm, **{k: [round(float(x), 4) for x in v] for k, v in values.items()},
        latency_ticks=int(round(float(best.latency[0]) / cfg.substeps)),
        source={"logs": [str(p) for p in paths],
                "rms_mrad": {"nominal": _per(arm, rms_nom), "fit": _per(arm, rms_fit),
                             "held_out": None if held is None else _per(arm, held)}})
    joints = [JointFit(n, {k: float(values[k][j]) for k in PARAMS}, float(rms_nom[j]), float(rms_fit[j]),
                       None if held is None else float(held[j])) for j, n in enumerate(arm)]
    return SysidResult(identified, joints, w.q0.shape[0], time.time() - t0, _traces(w, readings, robot))


def _per(names: list[str], x: torch.Tensor) -> dict[str, float]:
    return {n: round(float(v), 2) for n, v in zip(names, x)}


def _traces(w: Windows, readings: torch.Tensor, robot: RobotDescription) -> dict:
    """Per arm joint, the window where its goal moves most: measured, nominal, identified
    (`readings` of the nominal and the fitted arm, as `replay` returns them)."""
    side = side_sq_error(w, readings).argmin(dim=1)                    # [2, S, A]
    traces = {}
    for j, name in enumerate(robot.arm_joints):
        s = int(torch.argmax(w.goals[:, :, j].amax(1) - w.goals[:, :, j].amin(1)))
        k = w.valid[s]
        nom, ident = (readings[b, side[b, s, j], s, k, j].tolist() for b in (0, 1))
        traces[name] = {"t": (w.at[s][k] * w.dt).tolist(), "measured": w.measured[s, k, j].tolist(),
                        "nominal": nom, "identified": ident, "window": w.source[s]}
    return traces


def plot(result: SysidResult, path: Path) -> Path:
    """One panel per arm joint: both models' replay minus the logged angle (mrad), over the
    window where that joint's goal moves most, the logged angle on the right axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from soarm.files import atomic_write

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


def sysid(logs: list[Path], out_dir: Path, cfg: SysidCfg, out: Callable[[str], None] = print) -> SysidResult:
    """`soarm sysid`: fit the logs; write arm.yaml (for training), sysid.json and sysid.png."""
    import json

    from soarm import CONFIG_DIR, config
    from soarm.description import load_robot
    from soarm.files import atomic_write
    from soarm.reach import ReachCfg

    task = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")
    servo = config.load(ServoConfig, CONFIG_DIR / task.servo)
    result = identify([Path(p) for p in logs], load_robot(), servo, task.servo, cfg, out)
    out_dir = Path(out_dir)
    arm_file = config.dump(result.arm, out_dir / "arm.yaml")
    report = {"arm": str(arm_file), "windows": result.windows, "latency_ticks": result.arm.latency_ticks,
              "wall_s": round(result.wall_s, 1), "joints": [vars(j) for j in result.joints]}
    atomic_write(out_dir / "sysid.json", lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    png = plot(result, out_dir / "sysid.png")
    for line in result.table():
        out(line)
    out(f"soarm sysid: {result.windows} windows fitted in {result.wall_s:.0f} s; train on it with "
        f"`soarm train --set task.arm={arm_file.resolve()}`; report {out_dir / 'sysid.json'}, plot {png}")
    return result
