"""`soarm servo-fit` / `servo-check`: the servo model identified on real bench logs, beside a fitted PD.

A bench log (BAM's format, data/real_servo_logs/README.md) is one servo swinging a point mass
under gravity, the goals it was sent and the positions it reported. A `Bench` is K copies of
that rig, one per candidate parameter set, behind the plant interface (soarm/plant.py); the
log is played through it (`soarm.plant.play`), and the one search (calibration/search.py)
fits each model, so that neither gets a better optimizer than the other:

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
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from soarm import CONFIG_DIR, REPO_ROOT, config
from soarm.calibration.search import Scored, SearchCfg, search
from soarm.config import ConfigError
from soarm.dynamics import GRAVITY
from soarm.files import atomic_write
from soarm.logs import LogError, MotionLog, read_bam
from soarm.plant import Drive, Plant, play
from soarm.servo import (Datasheet, Datasheets, ServoParams, ServoRegisters, ServoState, integrate, quantize,
                         servo_torque)

SUBSTEP = 0.002   # s, integration step inside each logged interval
DATASHEETS = CONFIG_DIR / "servo" / "datasheets.yaml"
MIN_SAMPLES = 20           # a log shorter than this cannot pin a step response
MIN_SPAN = 0.05            # rad: the positions must span at least this (motion to fit)
VIN_TOLERANCE = 0.15       # the header's supply voltage and the servo's median reading agree within 15 %


@dataclass
class ServoFitCfg:
    logs: list[str] = field(default_factory=lambda: [str(p) for p in
                                                     sorted((REPO_ROOT / "data" / "real_servo_logs").glob("*.json"))])
    out: str = str(CONFIG_DIR / "servo" / "sts3250_bench_fit.yaml")
    plot: str = str(REPO_ROOT / "runs" / "servo_fit.png")
    # Wider and more selective than sysid's: one group of 8-10 parameters, and the bench's
    # valleys are long (docs/experiments.md, "The servo fit on the one search").
    search: SearchCfg = field(default_factory=lambda: SearchCfg(population=256, elites=16, iterations=40))


# ------------------------------------------------------------------ logs
def load_bench(path: str | Path) -> MotionLog:
    """A BAM bench log a fit can use; LogError naming the file and the problem otherwise."""
    log = read_bam(path)
    rig = log.rig
    if len(log.t) < MIN_SAMPLES:
        raise LogError(path, f"too short ({len(log.t)} samples; need at least {MIN_SAMPLES})")
    if not log.torque.any():
        raise LogError(path, "torque is off throughout (nothing drives the servo to fit)", field="torque_enable")
    span = float(np.ptp(log.measured))
    if span < MIN_SPAN:
        raise LogError(path, f"no motion (positions span {span:.4f} rad; need {MIN_SPAN})", field="position")
    if not (1 <= rig["kp"] <= 254 and rig["mass"] > 0 and rig["length"] > 0 and rig["vin"] > 0):
        raise LogError(path, f"header kp {rig['kp']}, mass {rig['mass']} kg, length {rig['length']} m, "
                             f"vin {rig['vin']} V: need kp in 1..254 and positive mass, length and vin")
    measured = float(np.median(log.volts))
    if abs(measured - rig["vin"]) > VIN_TOLERANCE * rig["vin"]:
        raise LogError(path, f"header vin {rig['vin']:g} V but the servo reported a median of {measured:.2f} V",
                       field="input_volts")
    return log


def name(log: MotionLog) -> str:
    return Path(log.source).stem


def check_same_motor(logs: list[MotionLog], motor: str | None = None) -> str:
    """The one servo type of `logs` (and of a fit, where given); LogError naming the odd log."""
    motor = motor or logs[0].rig["motor"]
    for log in logs:
        if log.rig["motor"] != motor:
            raise LogError(log.source, f"motor '{log.rig['motor']}', but the fit is of '{motor}'")
    return motor


def load_datasheet(motor: str, path: str | Path = DATASHEETS) -> Datasheet:
    sheets = config.load(Datasheets, path).motors
    if motor not in sheets:
        raise ConfigError(f"{path}: no datasheet for motor '{motor}' (known: {', '.join(sorted(sheets))})")
    return sheets[motor]


# ------------------------------------------------------------------ the two models
@dataclass(frozen=True)
class Model:
    """A vector of named parameters, searched in log space within bounds (LINEAR: as they are)."""
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
LINEAR = {"offset"}


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


class Bench(Plant):
    """K benches, one per candidate parameter set (physical units, [K] each) of a model: a
    point mass on a massless arm under gravity, driven by the servo model or the PD. Each
    interval of the log is integrated in equal substeps of at most SUBSTEP; the reading is
    the angle itself (the fit compares angles, as the model was fitted)."""

    def __init__(self, model: Model, values: dict[str, torch.Tensor], rig: dict):
        self.model, self.N, self.dt = model, next(iter(values.values())).shape[0], SUBSTEP
        self.col = {k: v.reshape(self.N, 1).double() for k, v in values.items()}
        # The bench logs record only kp; D is taken as the factory 32 and no profile ramp.
        self.registers = ServoRegisters(p=rig["kp"], d=32, i=0, acceleration=0)
        self.mass, self.length = rig["mass"], rig["length"]
        self.M = (self.mass * self.length ** 2 + self.col["armature"])[..., None]       # [K, 1, 1]
        self.params = servo_params(self.col) if model is OURS else None
        self.on, self.volts = True, None

    def reset(self, q: np.ndarray) -> None:
        self._q = torch.as_tensor(np.asarray(q, dtype=np.float64)).reshape(-1, 1).expand(self.N, 1).clone()
        self._qd = torch.zeros_like(self._q)
        self.firmware = ServoState(self._q)

    def torque(self, on) -> None:
        self.on = bool(np.all(on))

    def supply(self, volts: float) -> None:
        self.volts = volts

    def step(self, goal, seconds: float) -> None:
        n = max(1, math.ceil(seconds / SUBSTEP - 1e-9))
        dt = seconds / n
        goal = torch.full_like(self._q, float(np.asarray(goal).reshape(-1)[0]))
        q, qd, c = self._q, self._qd, self.col
        for _ in range(n):
            g = -self.mass * GRAVITY * self.length * torch.sin(q + c["offset"])
            if self.model is OURS:
                tau, coulomb = servo_torque(self.firmware, quantize(goal), quantize(q), qd, self.params,
                                            self.registers, dt, voltage=self.volts, enabled=self.on)
            else:
                drive = torch.clamp(c["stiffness"] * (goal - q) - c["damping"] * qd, -c["effort"], c["effort"])
                tau = (drive if self.on else torch.zeros_like(q)) - c["viscous"] * qd
                coulomb = c["friction"]
            q, qd = integrate(q, qd, self.M, tau + g, coulomb, dt)
        self._q, self._qd = q, qd

    @property
    def q(self) -> np.ndarray:
        return self._q.numpy()

    @property
    def qd(self) -> np.ndarray:
        return self._qd.numpy()

    def measured(self) -> np.ndarray:
        return self._q.numpy().copy()


def simulate(model: Model, values: dict[str, torch.Tensor], log: MotionLog) -> torch.Tensor:
    """The bench's angles [K, T] for K candidate parameter sets (physical units) on this log."""
    bench = Bench(model, values, log.rig)
    bench.reset(log.measured[0])
    drive = Drive(goal=lambda k: log.goal[k], seconds=np.diff(log.t), torque=lambda k: log.torque[k],
                  volts=log.volts)
    return torch.from_numpy(play(bench, drive)[:, :, 0].T.copy())


def rms(model: Model, values: dict[str, torch.Tensor], log: MotionLog) -> torch.Tensor:
    """RMS position error [K] (rad) against the recorded encoder positions."""
    ref = torch.as_tensor(log.measured[:, 0], dtype=torch.float64)
    return torch.sqrt(((simulate(model, values, log) - ref) ** 2).mean(-1))


def fit(model: Model, logs: list[MotionLog], datasheet: Datasheet, cfg: SearchCfg,
        say: Callable[[str], None] = lambda line: None) -> dict[str, float]:
    """The one search minimizing the mean RMS over `logs`; the best parameters in physical units."""
    names = list(model.bounds)
    lo = torch.tensor([model.bounds[k][0] for k in names], dtype=torch.float64)
    hi = torch.tensor([model.bounds[k][1] for k in names], dtype=torch.float64)
    log_space = torch.tensor([k not in LINEAR for k in names])
    to_x = lambda v: torch.where(log_space, torch.log(v.clamp_min(1e-12)), v)       # noqa: E731
    from_x = lambda x: torch.where(log_space, torch.exp(x), x)                        # noqa: E731
    x_lo, x_hi = to_x(lo), to_x(hi)

    def objective(theta: torch.Tensor) -> Scored:                 # [B, 1, P]
        x = from_x(theta[:, 0])
        values = physical(model, {k: x[:, i] for i, k in enumerate(names)}, datasheet)
        cost = torch.stack([rms(model, values, log) for log in logs]).mean(0)
        return Scored(torch.nan_to_num(cost, nan=1e9)[:, None])

    mean = to_x(torch.tensor([model.initial()[k] for k in names], dtype=torch.float64))[None]
    best = search(objective, mean, ((x_hi - x_lo) / 4)[None], x_lo, x_hi, cfg, say, model.name,
                  show=lambda e: f"mean RMS {float(e[0]) * 1000:.2f} mrad")
    x = from_x(best[0])
    return {k: float(v) for k, v in physical(model, {k: x[i] for i, k in enumerate(names)}, datasheet).items()}


def evaluate(model: Model, values: dict[str, float], log: MotionLog) -> float:
    return float(rms(model, {k: torch.tensor([v]) for k, v in values.items()}, log)[0])


def cross_validate(logs: list[MotionLog], datasheet: Datasheet, cfg: SearchCfg,
                   progress: Callable[[int], None] = lambda i: None) -> list[dict]:
    """Each model fitted on each log alone and scored on every other log (held out): what a
    fit says about motion it was not fitted on. One row per (fitted on, held out) pair."""
    rows = []
    for i, train in enumerate(logs):
        fits = {m.name: fit(m, [train], datasheet, cfg) for m in (OURS, BASELINE)}
        for j, test in enumerate(logs):
            if j != i:
                rows.append({"fitted_on": name(train), "held_out": name(test),
                             **{m.name: evaluate(m, fits[m.name], test) for m in (OURS, BASELINE)}})
        progress(i)
    return rows


# ------------------------------------------------------------------ reports
def compare(logs: list[MotionLog], fits: dict[str, dict[str, float]]) -> list[dict]:
    return [{"log": name(log), "servo_model": evaluate(OURS, fits[OURS.name], log),
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


def plot(logs: list[MotionLog], fits: dict[str, dict[str, float]], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(logs), 1, figsize=(10, 3.2 * len(logs)), squeeze=False)
    for ax, log in zip(axes[:, 0], logs):
        ax.plot(log.t, log.goal[:, 0], "k:", lw=1, label="goal")
        ax.plot(log.t, log.measured[:, 0], "k", lw=1.5, label="recorded")
        for model, style in ((OURS, "C0"), (BASELINE, "C3")):
            sim = simulate(model, {k: torch.tensor([v]) for k, v in fits[model.name].items()}, log)[0]
            error = evaluate(model, fits[model.name], log)
            ax.plot(log.t, sim.numpy(), style, lw=1, label=f"{model.name} (RMS {error * 1000:.1f} mrad)")
        ax.set_title(name(log))
        ax.set_ylabel("rad")
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("s")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)


# ---------------------------------------------------------------- the two commands
def _say(line: str) -> None:
    print(line, flush=True)


def servo_fit(cfg: ServoFitCfg, say: Callable[[str], None] = _say) -> int:
    """`soarm servo-fit`: both models fitted on every log and saved; their RMS in sample and,
    with more than one log, held out. 0 when ours beats the PD on every log."""
    logs = [load_bench(p) for p in cfg.logs]
    motor = check_same_motor(logs)
    sheet = load_datasheet(motor)
    fits = {}
    for model in (OURS, BASELINE):
        t0 = time.time()
        fits[model.name] = fit(model, logs, sheet, cfg.search, lambda line: say(f"  {line}"))
        say(f"fitted {model.name} in {time.time() - t0:.0f} s")
    save_fit(fits, [Path(p).name for p in cfg.logs], cfg.out, motor, sheet)
    say(f"wrote {cfg.out}")
    say("in sample (fitted on every log):")
    rc = report(logs, fits, cfg.plot, say)
    if len(logs) > 1:
        say("held out (fitted on one log, scored on another):")
        rows = cross_validate(logs, sheet, cfg.search, progress=lambda i: say(f"  fold {i + 1}/{len(logs)} fitted"))
        say(f"{'held out':55s} {'servo model':>12s} {'fitted PD':>12s}  (RMS, mrad; fitted on the other log)")
        for r in rows:
            say(f"{r['held_out']:55s} {r['sts_servo'] * 1000:12.2f} {r['implicit_pd'] * 1000:12.2f}")
    return rc


def servo_check(logs: list[str | Path], fit_path: str | Path, plot_path: str | Path | None,
                say: Callable[[str], None] = _say) -> int:
    """`soarm servo-check`: both fitted models' RMS on (new) logs of the fitted motor."""
    fits, motor = load_fit(fit_path)
    bench = [load_bench(p) for p in logs]
    check_same_motor(bench, motor)
    return report(bench, fits, plot_path, say)


def report(logs: list[MotionLog], fits: dict[str, dict[str, float]], plot_path: str | Path | None,
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
