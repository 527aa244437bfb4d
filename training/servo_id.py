"""Identify the servo model on real logs, and compare it with a fitted PD actuator.

A log is a pendulum test bench (BAM's format, see data/real_servo_logs/README.md): one
servo swinging a point mass under gravity, the goal sequence it was sent and the encoder
positions it reported. `replay` runs a batch of K candidate parameter sets through that
bench at once; `fit` searches parameters by the cross-entropy method in log space, the
same search for both models so that neither gets a better optimizer than the other.

    our model  ServoParams (soarm.servo) + the bench's angle offset; the motor's kt and R
               are searched as its no-load speed and stall torque relative to the servo
               type's datasheet (configs/servo/datasheets.yaml), within RATIO_BOUNDS
    baseline   Isaac Lab's implicit actuator: tau = clip(kp (goal - q) - kd qd, +-effort)
               while torque is on, with joint armature and joint friction (viscous and
               Coulomb, in both torque states, as Isaac Lab's joint friction acts), + the
               bench's angle offset
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from soarm import CONFIG_DIR, config
from soarm.config import ConfigError
from soarm.dynamics import GRAVITY
from soarm.servo import (Datasheet, Datasheets, ServoParams, ServoRegisters, ServoState, integrate, quantize,
                         servo_torque)
from soarm.files import atomic_write

SUBSTEP = 0.002   # s, integration step inside each logged interval
DATASHEETS = CONFIG_DIR / "servo" / "datasheets.yaml"


MIN_SAMPLES = 20           # a log shorter than this cannot pin a step response
MIN_SPAN = 0.05            # rad: the positions must span at least this (motion to fit)
VIN_TOLERANCE = 0.15       # the header's supply voltage and the servo's median reading agree within 15 %


@dataclass
class BenchLog:
    name: str
    motor: str             # servo type, e.g. "sts3250": a fit holds for one type
    kp: int
    mass: float
    length: float
    vin: float
    t: np.ndarray          # [T] s
    goal: np.ndarray       # [T] rad
    position: np.ndarray   # [T] rad (encoder)
    volts: np.ndarray      # [T] V
    enabled: np.ndarray    # [T] bool


def load_bench_log(path: str | Path) -> BenchLog:
    path = Path(path)
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    try:
        entries = raw["entries"]
        cols = {k: np.array([e[k] for e in entries], dtype=float)
                for k in ("timestamp", "goal_position", "position", "input_volts")}
        enabled = np.array([bool(e["torque_enable"]) for e in entries])
        log = BenchLog(path.stem, str(raw["motor"]), int(raw["kp"]), float(raw["mass"]), float(raw["length"]),
                       float(raw["vin"]), cols["timestamp"], cols["goal_position"], cols["position"],
                       cols["input_volts"], enabled)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a servo bench log ({type(e).__name__}: {e})") from None
    _check(path, log, cols)
    return log


def _check(path: Path, log: BenchLog, cols: dict[str, np.ndarray]) -> None:
    """What a fit needs of a log and of its header: one line naming the problem."""
    if not all(np.isfinite(v).all() for v in cols.values()):
        raise ConfigError(f"{path}: a value is not finite")
    if len(log.t) < MIN_SAMPLES:
        raise ConfigError(f"{path}: too short ({len(log.t)} samples; need at least {MIN_SAMPLES})")
    back = np.flatnonzero(np.diff(log.t) <= 0)
    if len(back):
        k = int(back[0])
        raise ConfigError(f"{path}: timestamps go backwards at entry {k + 1} ({log.t[k]:.4f} -> {log.t[k + 1]:.4f} s)")
    if not log.enabled.any():
        raise ConfigError(f"{path}: torque is off throughout (nothing drives the servo to fit)")
    span = float(np.ptp(log.position))
    if span < MIN_SPAN:
        raise ConfigError(f"{path}: no motion (positions span {span:.4f} rad; need {MIN_SPAN})")
    if not (1 <= log.kp <= 254 and log.mass > 0 and log.length > 0 and log.vin > 0):
        raise ConfigError(f"{path}: header kp {log.kp}, mass {log.mass} kg, length {log.length} m, vin {log.vin} V: "
                          f"need kp in 1..254 and positive mass, length and vin")
    measured = float(np.median(log.volts))
    if abs(measured - log.vin) > VIN_TOLERANCE * log.vin:
        raise ConfigError(f"{path}: header vin {log.vin:g} V but the servo reported a median of {measured:.2f} V")


def check_same_motor(logs: list[BenchLog], motor: str | None = None) -> str:
    """The one servo type of `logs` (and of a fit, where given); ConfigError naming the odd log."""
    motor = motor or logs[0].motor
    for log in logs:
        if log.motor != motor:
            raise ConfigError(f"{log.name}: motor '{log.motor}', but the fit is of '{motor}'")
    return motor


def load_datasheet(motor: str, path: str | Path = DATASHEETS) -> Datasheet:
    sheets = config.load(Datasheets, path).motors
    if motor not in sheets:
        raise ConfigError(f"{path}: no datasheet for motor '{motor}' (known: {', '.join(sorted(sheets))})")
    return sheets[motor]


# ------------------------------------------------------------------ the two models
# Each model is a vector of named parameters searched in log space within bounds.

@dataclass(frozen=True)
class Model:
    name: str
    bounds: dict[str, tuple[float, float]]

    def initial(self) -> dict[str, float]:
        return {k: math.sqrt(lo * hi) if lo > 0 else 0.5 * (lo + hi) for k, (lo, hi) in self.bounds.items()}


# The motor's no-load speed and stall torque as multiples of the datasheet's. Wide enough for
# unit spread and optimistic ratings (BAM's independently identified STS3215 set is 1.09x the
# rated speed and 1.70x the rated torque), narrow enough that back-EMF is pinned by physics.
# The firmware's speed limit with Goal_Speed 0 ("as fast as it goes") is about the motor's
# rated no-load speed (BAM measured 0.95x on the STS3215): slow logs cannot tell, and a lower
# one would cap fast moves.
RATIO_BOUNDS = {"speed_ratio": (0.8, 1.6), "torque_ratio": (0.7, 1.8), "profile_ratio": (0.9, 3.0)}
OURS = Model("sts_servo", {
    **RATIO_BOUNDS, "armature": (0.001, 0.1),
    "friction_coulomb": (0.005, 0.6), "friction_viscous": (0.001, 0.5), "friction_load": (0.005, 0.5),
    "error_gain": (0.03, 1.0), "d_gain": (1e-5, 0.01),
    "offset": (-0.2, 0.2),
})
BASELINE = Model("implicit_pd", {
    "stiffness": (1.0, 300.0), "damping": (0.01, 10.0), "effort": (0.3, 15.0),
    "armature": (0.001, 0.1), "friction": (0.005, 0.6), "viscous": (0.001, 0.5), "offset": (-0.2, 0.2),
})
LINEAR = {"offset"}     # searched linearly (can be negative); the rest in log space


def physical(model: Model, values: dict, datasheet: Datasheet) -> dict:
    """The model's parameters in physical units: our motor's ratios become kt and R."""
    if model is not OURS:
        return dict(values)
    out = {k: v for k, v in values.items() if k not in RATIO_BOUNDS}
    out["kt"], out["resistance"] = datasheet.motor_constants(values["speed_ratio"], values["torque_ratio"],
                                                             ServoParams.max_pwm)
    out["max_velocity"] = values["profile_ratio"] * datasheet.no_load_speed
    return out


def physical_keys(model: Model) -> set[str]:
    return set(physical(model, dict.fromkeys(model.bounds, 1.0), Datasheet(1.0, 1.0, 1.0, 1.0)))


def servo_params(values: dict, voltage: float = 12.0) -> ServoParams:
    keys = {f.name for f in dataclasses.fields(ServoParams)}
    return ServoParams(**{k: v for k, v in values.items() if k in keys}, voltage=voltage)


def replay(model: Model, values: dict[str, torch.Tensor], log: BenchLog) -> torch.Tensor:
    """Simulated encoder positions [K, T] of the bench for K candidate parameter sets (in
    physical units)."""
    K = next(iter(values.values())).shape[0]
    col = {k: v.reshape(K, 1).double() for k, v in values.items()}
    # The bench logs record only kp; D is taken as the factory 32 and no profile ramp.
    reg = ServoRegisters(p=log.kp, d=32, i=0, acceleration=0)
    inertia = log.mass * log.length ** 2 + col["armature"]            # [K,1]
    M = inertia[..., None]                                              # [K,1,1]
    q = torch.full((K, 1), float(log.position[0]), dtype=torch.float64)
    qd = torch.zeros_like(q)
    state = ServoState(q)
    params = servo_params(col) if model is OURS else None
    out = torch.empty(K, len(log.t), dtype=torch.float64)
    out[:, 0] = q[:, 0]
    for k in range(len(log.t) - 1):
        n = max(1, math.ceil((log.t[k + 1] - log.t[k]) / SUBSTEP - 1e-9))
        dt = (log.t[k + 1] - log.t[k]) / n
        goal = torch.full_like(q, float(log.goal[k]))
        on = bool(log.enabled[k])
        for _ in range(n):
            g = -log.mass * GRAVITY * log.length * torch.sin(q + col["offset"])
            if model is OURS:
                tau, coulomb = servo_torque(state, quantize(goal), quantize(q), qd, params, reg, dt,
                                            voltage=float(log.volts[k]), enabled=on)
            else:
                drive = torch.clamp(col["stiffness"] * (goal - q) - col["damping"] * qd, -col["effort"], col["effort"])
                tau = (drive if on else torch.zeros_like(q)) - col["viscous"] * qd
                coulomb = col["friction"]
            q, qd = integrate(q, qd, M, tau + g, coulomb, dt)
        out[:, k + 1] = q[:, 0]
    return out


def rms(model: Model, values: dict[str, torch.Tensor], log: BenchLog) -> torch.Tensor:
    """RMS position error [K] (rad) against the recorded encoder positions."""
    sim = replay(model, values, log)
    ref = torch.as_tensor(log.position, dtype=torch.float64)
    return torch.sqrt(((sim - ref) ** 2).mean(-1))


def fit(model: Model, logs: list[BenchLog], datasheet: Datasheet, iterations: int = 25, population: int = 192,
        seed: int = 0, progress=None) -> dict[str, float]:
    """Cross-entropy search minimizing the mean RMS over `logs`; the best parameters in
    physical units."""
    g = torch.Generator().manual_seed(seed)
    names = list(model.bounds)
    lo = torch.tensor([model.bounds[k][0] for k in names], dtype=torch.float64)
    hi = torch.tensor([model.bounds[k][1] for k in names], dtype=torch.float64)
    log_space = torch.tensor([k not in LINEAR for k in names])
    to_x = lambda v: torch.where(log_space, torch.log(v.clamp_min(1e-12)), v)       # noqa: E731
    from_x = lambda x: torch.where(log_space, torch.exp(x), x)                        # noqa: E731
    x_lo, x_hi = to_x(lo), to_x(hi)
    mean = to_x(torch.tensor([model.initial()[k] for k in names], dtype=torch.float64))
    std = (x_hi - x_lo) / 4
    best, best_cost = mean.clone(), float("inf")
    n_elite = max(4, population // 8)
    for it in range(iterations):
        x = mean + std * torch.randn(population, len(names), generator=g, dtype=torch.float64)
        x[0] = best if math.isfinite(best_cost) else mean
        x = torch.max(torch.min(x, x_hi), x_lo)
        values = physical(model, {k: from_x(x)[:, i] for i, k in enumerate(names)}, datasheet)
        cost = torch.stack([rms(model, values, log) for log in logs]).mean(0)
        cost = torch.nan_to_num(cost, nan=1e9)
        order = torch.argsort(cost)
        if cost[order[0]] < best_cost:
            best_cost, best = float(cost[order[0]]), x[order[0]].clone()
        elite = x[order[:n_elite]]
        mean = elite.mean(0)
        std = 0.7 * elite.std(0) + 0.3 * std * 0.5
        if progress:
            progress(it, best_cost)
    return {k: float(v) for k, v in physical(model, {k: from_x(best)[i] for i, k in enumerate(names)},
                                             datasheet).items()}


def evaluate(model: Model, values: dict[str, float], log: BenchLog) -> float:
    return float(rms(model, {k: torch.tensor([v]) for k, v in values.items()}, log)[0])


def cross_validate(logs: list[BenchLog], datasheet: Datasheet, iterations: int, population: int, seed: int = 0,
                   progress=None) -> list[dict]:
    """Each model fitted on each log alone and scored on every other log (held out): what a
    fit says about motion it was not fitted on. One row per (fitted on, held out) pair."""
    rows = []
    for i, train in enumerate(logs):
        fits = {m.name: fit(m, [train], datasheet, iterations, population, seed) for m in (OURS, BASELINE)}
        for j, test in enumerate(logs):
            if j != i:
                rows.append({"fitted_on": train.name, "held_out": test.name,
                             **{m.name: evaluate(m, fits[m.name], test) for m in (OURS, BASELINE)}})
        if progress:
            progress(i)
    return rows


# ------------------------------------------------------------------ reports
def compare(logs: list[BenchLog], fits: dict[str, dict[str, float]]) -> list[dict]:
    return [{"log": log.name, "servo_model": evaluate(OURS, fits[OURS.name], log),
             "pd_baseline": evaluate(BASELINE, fits[BASELINE.name], log)} for log in logs]


def save_fit(fits: dict[str, dict[str, float]], logs: list[str], path: str | Path, motor: str,
             datasheet: Datasheet) -> None:
    import yaml

    doc = {"motor": motor, "fitted_on": logs, "substep_s": SUBSTEP,
           "datasheet": dataclasses.asdict(datasheet), "ratio_bounds": {k: list(v) for k, v in RATIO_BOUNDS.items()},
           **{k: {n: float(f"{v:.6g}") for n, v in fit.items()} for k, fit in fits.items()}}
    text = "# Written by `soarm servo-fit`: the servo model and the fitted PD baseline.\n" + yaml.safe_dump(
        doc, sort_keys=False)
    atomic_write(path, lambda tmp: tmp.write_text(text))


def load_fit(path: str | Path) -> tuple[dict[str, dict[str, float]], str]:
    """(the two models' parameters, the servo type they were fitted on)."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot load fit ({e})") from None
    out = {}
    for model in (OURS, BASELINE):
        part = doc.get(model.name) if isinstance(doc, dict) else None
        if not isinstance(part, dict) or set(part) != physical_keys(model):
            raise ConfigError(f"{path}: '{model.name}' must give exactly {sorted(physical_keys(model))}")
        out[model.name] = {k: float(v) for k, v in part.items()}
    if not isinstance(doc.get("motor"), str):
        raise ConfigError(f"{path}: 'motor' must name the servo type the fit was made on")
    return out, doc["motor"]


def plot(logs: list[BenchLog], fits: dict[str, dict[str, float]], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(logs), 1, figsize=(10, 3.2 * len(logs)), squeeze=False)
    for ax, log in zip(axes[:, 0], logs):
        ax.plot(log.t, log.goal, "k:", lw=1, label="goal")
        ax.plot(log.t, log.position, "k", lw=1.5, label="recorded")
        for model, style in ((OURS, "C0"), (BASELINE, "C3")):
            sim = replay(model, {k: torch.tensor([v]) for k, v in fits[model.name].items()}, log)[0]
            rms = evaluate(model, fits[model.name], log)
            ax.plot(log.t, sim.numpy(), style, lw=1, label=f"{model.name} (RMS {rms * 1000:.1f} mrad)")
        ax.set_title(log.name)
        ax.set_ylabel("rad")
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("s")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------- the two commands
def _say(line: str) -> None:
    print(line, flush=True)


def servo_fit(paths: list[Path], out: Path, plot_path: Path | None, iterations: int, population: int, seed: int,
              say: Callable[[str], None] = _say) -> int:
    """`soarm servo-fit`: both models fitted on every log and saved; their RMS in sample and,
    with more than one log, held out. 0 when ours beats the PD on every log."""
    import time

    logs = [load_bench_log(p) for p in paths]
    motor = check_same_motor(logs)
    sheet = load_datasheet(motor)
    fits = {}
    for model in (OURS, BASELINE):
        t0 = time.time()
        fits[model.name] = fit(model, logs, sheet, iterations=iterations, population=population, seed=seed,
                               progress=lambda i, c, m=model: say(f"  {m.name}: iteration {i + 1}/{iterations}, "
                                                                  f"mean RMS {c * 1000:.2f} mrad"))
        say(f"fitted {model.name} in {time.time() - t0:.0f} s")
    save_fit(fits, [str(Path(p).name) for p in paths], out, motor, sheet)
    say(f"wrote {out}")
    say("in sample (fitted on every log):")
    rc = report(logs, fits, plot_path, say)
    if len(logs) > 1:
        say("held out (fitted on one log, scored on another):")
        rows = cross_validate(logs, sheet, iterations, population, seed,
                              progress=lambda i: say(f"  fold {i + 1}/{len(logs)} fitted"))
        say(f"{'held out':55s} {'servo model':>12s} {'fitted PD':>12s}  (RMS, mrad; fitted on the other log)")
        for r in rows:
            say(f"{r['held_out']:55s} {r['sts_servo'] * 1000:12.2f} {r['implicit_pd'] * 1000:12.2f}")
    return rc


def servo_check(paths: list[Path], fit_path: Path, plot_path: Path | None, say: Callable[[str], None] = _say) -> int:
    """`soarm servo-check`: both fitted models' RMS on (new) logs of the fitted motor."""
    fits, motor = load_fit(fit_path)
    logs = [load_bench_log(p) for p in paths]
    check_same_motor(logs, motor)
    return report(logs, fits, plot_path, say)


def report(logs: list[BenchLog], fits: dict[str, dict[str, float]], plot_path: Path | None,
           say: Callable[[str], None] = _say) -> int:
    """Each log's RMS under both models (and a plot); 0 when ours is better on every log."""
    rows = compare(logs, fits)
    say(f"{'log':55s} {'servo model':>12s} {'fitted PD':>12s}  (RMS position error, mrad)")
    for r in rows:
        mark = "better" if r["servo_model"] < r["pd_baseline"] else "WORSE"
        say(f"{r['log']:55s} {r['servo_model'] * 1000:12.2f} {r['pd_baseline'] * 1000:12.2f}  {mark}")
    if plot_path:
        plot(logs, fits, plot_path)
        say(f"plot: {plot_path}")
    worse = [r["log"] for r in rows if r["servo_model"] >= r["pd_baseline"]]
    say(f"servo model beats the fitted PD on {len(rows) - len(worse)}/{len(rows)} logs")
    return 1 if worse else 0
