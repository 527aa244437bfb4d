from pathlib import Path

import pytest
import torch

from soarm import REPO_ROOT
from soarm.calibration import servo_fit as fitting
from soarm.calibration.search import SearchCfg
from soarm.config import ConfigError
from soarm.logs import LogError
from soarm.servo import TICK, ServoParams, ServoRegisters, ServoState, _spd_solve, integrate, quantize, servo_torque

LOGS = sorted((REPO_ROOT / "data" / "real_servo_logs").glob("*.json"))
FIT = REPO_ROOT / "configs" / "servo" / "sts3250_bench_fit.yaml"


def test_quantize_is_whole_ticks():
    q = torch.tensor([0.0, TICK * 0.49, TICK * 0.51, -TICK * 2.6])
    assert torch.allclose(quantize(q) / TICK, torch.tensor([0.0, 0.0, 1.0, -3.0]))


def test_spd_solve_matches_lapack():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(64, 6, 6, generator=g, dtype=torch.float64)
    M = A @ A.transpose(1, 2) + 0.1 * torch.eye(6, dtype=torch.float64)
    b = torch.randn(64, 6, generator=g, dtype=torch.float64)
    x, d = _spd_solve(M, b)
    assert torch.allclose(x, torch.linalg.solve(M, b), atol=1e-9)
    assert torch.allclose(d, torch.linalg.inv(M).diagonal(dim1=1, dim2=2), atol=1e-9)


def test_coulomb_friction_stops_but_never_reverses():
    M = torch.full((3, 1, 1), 0.03)
    qd = torch.tensor([[0.5], [0.001], [-0.001]])
    q, v = integrate(torch.zeros(3, 1), qd, M, torch.zeros(3, 1), 0.2, 0.01)
    assert v[0, 0] < 0.5 and v[0, 0] > 0          # slowed, same direction
    assert torch.all(v[1:] == 0)                   # small motion sticks, no sign flip


def test_holds_inside_deadband_and_saturates():
    p, reg = ServoParams(), ServoRegisters(acceleration=0)
    q = torch.zeros(1, 2)
    st = ServoState(q)
    goal = torch.tensor([[TICK * 1.0, 1.0]])     # one tick (dead-band), and a huge error
    st.target = goal.clone()
    tau, _ = servo_torque(st, goal, q, torch.zeros(1, 2), p, reg, 0.001)
    assert tau[0, 0] == 0
    stall = p.kt / p.resistance * p.max_pwm * p.voltage
    assert tau[0, 1] == pytest.approx(stall, rel=1e-5)


def test_profile_respects_speed_limit():
    p, reg = ServoParams(max_velocity=2.0), ServoRegisters(acceleration=0)
    st = ServoState(torch.zeros(1, 1))
    for _ in range(10):
        servo_torque(st, torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), p, reg, 0.01)
    assert st.target.item() == pytest.approx(0.2, abs=1e-6)


def test_torque_off_gives_no_drive():
    st = ServoState(torch.zeros(1, 1))
    tau, _ = servo_torque(st, torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), ServoParams(),
                          ServoRegisters(), 0.01, enabled=False)
    assert tau.item() == 0


def test_servo_model_beats_fitted_pd_on_real_logs():
    """The stored fit (soarm servo-fit): our model's RMS must be below the fitted PD's on every log."""
    fits, motor = fitting.load_fit(FIT)
    assert motor == "sts3250"
    rows = fitting.compare([fitting.load_bench(p) for p in LOGS], fits)
    assert len(rows) == 2
    for r in rows:
        assert r["servo_model"] < r["pd_baseline"], r
        assert r["servo_model"] < 0.02, r          # rad; a broken model drifts far past this


def test_fitter_recovers_a_known_servo(tmp_path):
    """Synthetic log from known parameters: the fitter must bring the RMS near zero."""
    import dataclasses

    log = fitting.load_bench(LOGS[1])
    truth = {"kt": 1.5, "resistance": 2.5, "armature": 0.01, "friction_coulomb": 0.05, "friction_viscous": 0.05,
             "friction_load": 0.1, "error_gain": 0.2, "d_gain": 0.0002, "max_velocity": 8.0, "offset": 0.0}
    cut = slice(0, 80)
    short = dataclasses.replace(log, t=log.t[cut], goal=log.goal[cut], measured=log.measured[cut],
                                torque=log.torque[cut], volts=log.volts[cut])
    sim = fitting.simulate(fitting.OURS, {k: torch.tensor([v]) for k, v in truth.items()}, short)[0]
    short.measured = sim.numpy()[:, None]
    sheet = fitting.load_datasheet("sts3250")
    start = fitting.evaluate(fitting.OURS, fitting.physical(fitting.OURS, fitting.OURS.initial(), sheet), short)
    fitted = fitting.fit(fitting.OURS, [short], sheet, SearchCfg(iterations=8, population=48, elites=6, polish_steps=2))
    assert fitting.evaluate(fitting.OURS, fitted, short) < 0.3 * start


def test_bad_log_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"kp": 32, "entries": [')
    with pytest.raises(LogError) as e:
        fitting.load_bench(bad)
    assert "bad.json" in str(e.value) and "\n" not in str(e.value)


def _edited(tmp_path, edit) -> Path:
    import json

    raw = json.loads(LOGS[1].read_text())
    edit(raw)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(raw))
    return path


def _set_all(key, value):
    return lambda raw: [e.__setitem__(key, value) for e in raw["entries"]]


@pytest.mark.parametrize("edit, words", [
    (lambda raw: raw.__setitem__("entries", raw["entries"][:10]), "too short (10 samples"),
    (lambda raw: raw["entries"][5].__setitem__("timestamp", 0.0), "row 5, field 't': timestamps go backwards"),
    (lambda raw: raw["entries"][7].__setitem__("position", float("nan")), "row 7, field 'position': not finite"),
    (lambda raw: raw["entries"][9].pop("goal_position"), "row 9, field 'goal_position': missing"),
    (_set_all("torque_enable", False), "torque is off throughout"),
    (_set_all("position", 0.3), "no motion"),
    (lambda raw: raw.pop("motor"), "header 'motor' is None"),
    (lambda raw: raw.__setitem__("vin", 7.4), "header vin 7.4 V but the servo reported a median of 11.9"),
    (lambda raw: raw.__setitem__("mass", -1.0), "need kp in 1..254 and positive mass"),
])
def test_a_log_a_fit_cannot_use_is_one_line_naming_the_problem(tmp_path, edit, words):
    with pytest.raises(LogError) as e:
        fitting.load_bench(_edited(tmp_path, edit))
    assert "edited.json" in str(e.value) and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_log_of_another_servo_type_is_refused_by_the_fit(tmp_path):
    other = fitting.load_bench(_edited(tmp_path, lambda raw: raw.__setitem__("motor", "sts3215")))
    _, motor = fitting.load_fit(FIT)
    with pytest.raises(LogError, match="edited.json: motor 'sts3215', but the fit is of 'sts3250'"):
        fitting.check_same_motor([fitting.load_bench(LOGS[0]), other], motor)


@pytest.mark.slow
def test_held_out_error_of_the_servo_model_does_not_rise():
    """The CI gate on the model's extrapolation: each model fitted on one shipped log (as
    `soarm servo-fit` does, with its search) and scored on the other. Thresholds are today's
    figures (20.19 and 47.96 mrad, docs/experiments.md, "The servo fit on the one search") plus
    15 % for the search's float-order differences between machines; a model change that fits
    worse off its training motion fails here, and so does one that loses to the fitted PD on
    either fold."""
    logs = [fitting.load_bench(p) for p in LOGS]
    rows = {r["held_out"]: r for r in fitting.cross_validate(logs, fitting.load_datasheet("sts3250"),
                                                              fitting.ServoFitCfg().search)}
    limits = {"sts3250_kp32_12V_m1.13_l0.12_sin_sin": 0.0233, "sts3250_kp32_12V_m1.13_l0.12_lift_and_drop": 0.0552}
    for name, limit in limits.items():
        assert rows[name]["sts_servo"] <= limit, (name, rows[name])
        assert rows[name]["sts_servo"] < rows[name]["implicit_pd"], (name, rows[name])


@pytest.mark.parametrize("servo_file", ["sts3215_7v4.yaml", "sts3215_12v.yaml", "sts3250_bench_fit.yaml"])
def test_servo_parameters_lie_within_their_datasheet_bounds(servo_file):
    """The SO-101's servo set (BAM's, identified elsewhere) and our bench fit both give a
    no-load speed, stall torque and speed limit within the fit's bounds of the servo type's
    ratings."""
    import yaml

    doc = yaml.safe_load((REPO_ROOT / "configs" / "servo" / servo_file).read_text())
    sheet = fitting.load_datasheet(doc["motor"])
    raw = doc.get("params") or doc["sts_servo"]
    params = ServoParams(**{k: v for k, v in raw.items() if k != "offset"})
    speed, torque = sheet.ratios(params)
    profile = params.max_velocity / sheet.no_load_speed
    bounds = fitting.RATIO_BOUNDS
    for name, ratio in (("speed_ratio", speed), ("torque_ratio", torque), ("profile_ratio", profile)):
        assert bounds[name][0] <= ratio <= bounds[name][1], (name, ratio)


def test_a_servo_type_without_a_datasheet_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no datasheet for motor .sts9999. \\(known: sts3215, sts3215_12v, sts3250\\)"):
        fitting.load_datasheet("sts9999")
