"""`soarm sysid`: bad logs are one line naming the file; identification recovers an emulated
arm it was not told about (`soarm emulate --perturb`); training centres on what it found."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from soarm import CONFIG_DIR, config
from soarm.calibration.sysid import SysidCfg
from soarm.calibration.windows import cut_windows
from soarm.description import load_robot
from soarm.logs import EncoderLogWriter, LogError, TickRecord, read_motion
from soarm.reach import ReachCfg

ROBOT = load_robot()
ARM = list(ROBOT.arm_joints)
TASK = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")
DT, SUBSTEPS = TASK.physics_dt, TASK.substeps


def windows(paths, cfg=None):
    cfg = cfg or SysidCfg()
    return cut_windows([read_motion(p) for p in paths], ROBOT, cfg.window_s, cfg.min_motion_s, DT)


def gravity_on(joint: int, mass_scale: list[float]) -> float:
    """N m of gravity on arm joint `joint` at the home pose, with these arm link mass scales."""
    from soarm.dynamics import ArmDynamics
    from soarm.reach import full_pose

    dyn = ArmDynamics(ROBOT)
    scale = torch.ones(1, dyn.J)
    scale[0, ROBOT.arm_index] = torch.tensor(mass_scale[:len(ARM)], dtype=torch.float32)
    q = full_pose(dyn, torch.as_tensor(ROBOT.home, dtype=torch.float32)[None])
    _, bias = dyn.mass_and_bias(q, torch.zeros_like(q), scale)
    return float(bias[0, ROBOT.arm_index[joint]])


def write_log(path, n=120, rate=30.0, moving=True, torque=True, t_back_at=None):
    header = {"source": "soarm", "arm_joints": ARM, "gripper": "gripper", "rate_hz": rate}
    writer = EncoderLogWriter(path, header)
    for k in range(n):
        t = (k if t_back_at is None or k < t_back_at else k - 3) / 30.0
        q = list(ROBOT.home + (0.2 * math.sin(t) if moving else 0.0))
        writer.write(TickRecord(t=t, raw={}, q=q, goal_sent=q if torque else None,
                                decision="command" if torque else "torque_off"))
    return writer.close()


@pytest.mark.parametrize("kw, words", [
    ({"n": 30}, ["too short", "1.0 s of commanded motion"]),
    ({"moving": False}, ["no motion"]),
    ({"torque": False}, ["torque is off throughout"]),
    ({"t_back_at": 50}, ["row 50", "timestamps go backwards"]),
    ({"rate": 0.0}, ["no control rate"]),
])
def test_a_log_unfit_for_identification_is_one_line_naming_it(tmp_path, kw, words):
    log = write_log(tmp_path / "bad.mcap", **kw)
    with pytest.raises(LogError) as e:
        windows([log])
    msg = str(e.value)
    assert "\n" not in msg and "bad.mcap" in msg and all(w in msg for w in words), msg


def test_a_moving_log_is_cut_into_windows_on_the_physics_grid(tmp_path):
    log = write_log(tmp_path / "ok.mcap", n=900)                          # 30 s
    w = windows([log], SysidCfg(window_s=10.0))
    assert w.q0.shape == (3, len(ARM)) and w.pose == ["home"] * 3
    assert math.isclose(w.dt, 1 / 180) and int(w.valid.sum()) == 900
    k = w.valid[0]
    at = w.at[0][k]                                                       # [K, A] each joint's reading's step
    np.testing.assert_allclose(torch.gather(w.goals[0], 0, at), w.measured[0, k], atol=1e-6)   # the goal logged there


def test_training_draws_centre_on_the_identified_arm():
    import dataclasses

    from soarm.arm_params import ArmParams, JointParams
    from soarm.reach import draw_latency, draw_physics, max_latency
    from soarm.servo import ServoConfig

    servo = config.load(ServoConfig, CONFIG_DIR / TASK.servo).params
    joints = {"shoulder_pan": JointParams(gain_scale=0.8, coulomb=2.0 * servo.friction_coulomb,
                                          backlash=math.radians(1.2)),
              "shoulder_lift": JointParams(gain_scale=1.2, mass_scale=1.1),
              "wrist_roll": JointParams(coulomb=0.5 * servo.friction_coulomb)}
    arm = ArmParams(servo=TASK.servo, latency_ticks=2, joints=joints)
    J, n = len(ROBOT.names), 20000
    nominal = draw_physics(torch.Generator().manual_seed(0), TASK.randomization, servo, n, J, "cpu")
    centred = draw_physics(torch.Generator().manual_seed(0), TASK.randomization, servo, n, J, "cpu",
                           centre=arm.rows(ROBOT))
    ratio = lambda k: (centred[k] / nominal[k]).mean(0)                 # noqa: E731
    np.testing.assert_allclose(ratio("gain_scale")[:5], [0.8, 1.2, 1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(ratio("coulomb")[:5], [2.0, 1.0, 1.0, 1.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(ratio("mass_scale")[:5], [1.0, 1.1, 1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(ratio("viscous")[:5], 1.0, rtol=1e-6)     # a field left out: the servo model's
    assert ratio("gain_scale")[5] == 1.0                                 # the gripper: nominal
    servo_arms = ~centred["pd"][:, 0]                                    # a position-driven arm has no play
    assert abs(math.degrees(float(centred["backlash"][servo_arms, 0].mean())) - 1.2) < 0.05
    assert centred["backlash"][~servo_arms].eq(0).all()
    assert float(centred["backlash"].min()) >= 0.0
    lat = draw_latency(torch.Generator().manual_seed(0), TASK.randomization, n, "cpu", arm.latency_ticks)
    lo, hi = TASK.randomization.latency_ticks                            # the range, moved to be about 2
    moved = {max(0, k + 2 - round((lo + hi) / 2)) for k in range(lo, hi + 1)}
    assert set(lat.tolist()) == moved and max_latency(TASK.randomization, arm.latency_ticks) == max(moved)
    split = dataclasses.replace(arm, joints={n: JointParams(viscous=s * servo.friction_viscous,
                                                            friction_load=1.5 * servo.friction_load,
                                                            armature=0.8 * servo.armature, deadband=d)
                                             for n, s, d in zip(ARM, [0.5, 1.0, 1.0, 1.0, 3.0], [0, 2, 3, 1, 0])})
    centred = draw_physics(torch.Generator().manual_seed(0), TASK.randomization, servo, n, J, "cpu",
                           centre=split.rows(ROBOT))
    np.testing.assert_allclose(ratio("viscous")[:5], [0.5, 1.0, 1.0, 1.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(ratio("friction_load")[:5], 1.5, rtol=1e-6)
    np.testing.assert_allclose(ratio("armature")[:5], 0.8, rtol=1e-6)
    assert centred["deadband"][:, :5].eq(torch.tensor([0.0, 2.0, 3.0, 1.0, 0.0])).all()
    assert centred["deadband"][:, 5].eq(servo.deadband_ticks).all()       # the gripper: the servo model's


# A pan-and-lift excitation of `soarm emulate --perturb 6`, recorded over the pty on a quiet
# machine, and what the emulator hid (tests/data/sysid/README.md: how to record it again).
RECORDED = Path(__file__).parent / "data" / "sysid"
PERTURB_SEED, EXCITED = 6, ["shoulder_pan", "shoulder_lift"]
SHORT_PLAN = dict(chirp_s=5.0, dwell_s=0.6)
# A log the hidden arm explains: its RMS error under this share of the nominal model's on each
# excited joint. Goals logged a tick off give 0.41-1.7 on one joint or both (the test below);
# CI's loaded bus pass twice replayed the lift at 0.28 (8.2-8.3 mrad) for a cause not found.
EXPLAINED = 0.35


def hidden_arm(truth_file: Path):
    """What `soarm emulate --perturb` drew (its --reveal file: an arm file, as sysid writes one)."""
    from soarm.arm_params import load_arm

    return load_arm(truth_file, ROBOT)


def fitting(w, compile: bool = False):
    from soarm.calibration.sysid import Fitting
    from soarm.servo import ServoConfig

    return Fitting(w, ROBOT, config.load(ServoConfig, CONFIG_DIR / TASK.servo), SUBSTEPS, SysidCfg(compile=compile))


def replay_errors(w, truth_file: Path):
    """[A] mrad each joint of windows `w` replays at with the values the emulator hid, and with
    the nominal model's."""
    from soarm.calibration.sysid import Candidates, nominal, rms_per_joint

    f = fitting(w)
    truth = Candidates.of(hidden_arm(truth_file), ROBOT, f.servo.params, SUBSTEPS)
    return rms_per_joint(f, truth), rms_per_joint(f, nominal(len(ARM), f.servo.params))


@pytest.mark.bus
def test_the_excitation_over_the_pty_records_what_the_arm_did(tmp_path):
    """`soarm excite` on `soarm emulate --perturb 6`, in real time through the real Feetech SDK
    and the driver, busy machine or not: every segment runs, and the log is one the replay can
    explain. Replayed with the values the emulator hid, the excited joints' error is under a
    EXPLAINED share of the nominal model's (seen here: 2.1-3.4 mrad against 19-30, ratios
    0.07-0.17, quiet and beside two CPU hogs); the test below shows a log recorded a tick off
    is not. On failure it names each window's error, so a bad stretch shows where it is."""
    from soarm import REPO_ROOT
    from soarm.robot.emulator_process import EmulatorProcess
    from soarm.calibration.excite import ExcitationCfg, excite_arm

    truth_file = tmp_path / "truth.yaml"
    args = ("--perturb", str(PERTURB_SEED), "--reveal", str(truth_file))
    with EmulatorProcess(tmp_path / "cal.json", seed=PERTURB_SEED, args=args) as emu:
        report = excite_arm(emu.port, emu.calibration, REPO_ROOT / "data" / "policies" / "reach.onnx",
                            ExcitationCfg(**SHORT_PLAN), EXCITED, tmp_path / "logs", out=lambda line: None)
    emulator = emu.output[-1]                   # its counters and how far its physics fell behind
    assert not report.fault and len(report.done) == 4, (report, emulator)
    w = windows(report.logs)
    hidden, before = replay_errors(w, truth_file)
    excited = [ARM.index(j) for j in EXCITED]
    by_window = lambda: [(w.source[i], replay_errors(w.take([i]), truth_file)[0][excited].tolist())  # noqa: E731
                         for i in range(len(w.source))]
    assert (hidden[excited] < EXPLAINED * before[excited]).all(), (hidden, before, emulator, by_window())


@pytest.mark.slow
@pytest.mark.parametrize("shift", [1, -1], ids=["goal_a_tick_late", "goal_a_tick_early"])
def test_a_log_recorded_a_tick_off_is_one_the_hidden_arm_does_not_explain(tmp_path, shift):
    """What the bus test above guards against, on the recorded log: each goal logged with the
    tick before it (sent a tick later than logged: ratios 1.7 / 1.0 for pan / lift) or after it
    (0.41 / 0.32) leaves the hidden arm too far from the log on at least one joint (the log as
    recorded: 0.14 / 0.07; a physics that froze 0.1 s every 5 s, the emulator's stall rule
    before it replayed stalls: 0.35 / 0.19)."""
    import dataclasses

    from soarm.logs import read_log

    header, ticks = read_log(RECORDED / "perturb6_pan_lift.mcap")
    writer = EncoderLogWriter(tmp_path / "shifted.mcap", header)
    for k in range(1, len(ticks) - 1):
        goal = ticks[k - shift].goal_sent
        writer.write(dataclasses.replace(ticks[k], goal_sent=goal if ticks[k].goal_sent is not None else None))
    hidden, before = replay_errors(windows([writer.close()]), RECORDED / "truth.yaml")
    excited = [ARM.index(j) for j in EXCITED]
    assert (hidden[excited] > EXPLAINED * before[excited]).any(), (hidden, before)


@pytest.mark.slow
def test_sysid_recovers_an_emulated_arm_it_was_not_told_about():
    """The fit, with its defaults, on the recorded excitation of `--perturb 6` (2 ticks of
    latency, 1.27 deg of pan backlash), compared with what the emulator hid. Fitted on a
    recording rather than live: the fit is seeded, so this checks the fit, not the timing
    noise of one real-time run (the bus test above checks the recording). Tolerances, and why
    (docs/sysid.md has the full-plan table):
    - loop gain within 15 %: the chirps' phase and the steps' rise time pin it;
    - the pan's Coulomb friction, and both joints' viscous friction, within 40 %: they show
      only in the small-signal part of the motion, where one encoder tick (1.5 mrad) is a
      large share of the error, and trade against the gain along a valley (pan: gain x0.87
      with friction x0.42 replays within 1 mrad of the truth);
    - the lift's gearbox friction as it holds at home, Coulomb plus load-dependent
      (friction_coulomb c + friction_load l |gravity torque|), within 15 %: gravity keeps that
      gearbox loaded, so the two terms trade against each other (seen 0.48 and 0.60 of the
      Coulomb against 0.80 hidden, replaying below the floor) while their sum is pinned (seen
      within 9 %);
    - armature within 15 % (seen within 8 %: 0.94-0.97 against 0.90, 1.12-1.14 against 1.19;
      the servo model's 1.0 would miss the lift's): the steps' accelerations and the chirps'
      2 Hz end show it beside the link inertia;
    - load-dependent friction within 50 % (seen 0.97-1.07 against 0.78 / 0.89): a
      second-order term, the gearbox's torque is small on these moves;
    - the dead-band: not asserted. At P = 16 the drive for 1-3 ticks of error (0.013-0.041 N m)
      is below the gearbox's Coulomb friction (0.05 N m), so a dead-band of up to 3 ticks
      moves nothing the encoder sees (seen 0.6-1.2 ticks where the truth is 1 and 2);
    - the gravity torque on the shoulder lift at home within 10 %: its load is every link's
      beyond it, and with only the pan and the lift excited, how it splits between those
      links is not identified (the full plan's elbow and wrist segments pin it, docs/sysid.md);
      the pan carries no gravity;
    - backlash within 0.5 deg where the load reverses or is absent (pan); within the
      search range elsewhere: a gearbox pushed always to one side by gravity hides its play;
    - latency: the control tick the emulator delays goals by;
    - the excited joints' RMS below half the nominal model's and within 10 % of what the
      hidden values themselves replay at (the fit reached the floor the log allows)."""
    from soarm.calibration.sysid import Candidates, fit, nominal, rms_per_joint

    truth = hidden_arm(RECORDED / "truth.yaml")
    f = fitting(windows(sorted(RECORDED.glob("*.mcap"))), compile=True)
    sp = f.servo.params
    best = fit(f, out=lambda line: None)
    got = {k: v[0].tolist() for k, v in best.values(sp).items()}          # per arm joint, the fields' units
    hid = lambda name: [getattr(truth.joints[n], name) for n in ARM]       # noqa: E731
    pan, lift = ARM.index("shoulder_pan"), ARM.index("shoulder_lift")
    for j in (pan, lift):
        for name, rel in (("gain_scale", 0.15), ("viscous", 0.4), ("armature", 0.15), ("friction_load", 0.5)):
            assert got[name][j] == pytest.approx(hid(name)[j], rel=rel), (ARM[j], name, got, truth)
    assert got["coulomb"][pan] == pytest.approx(hid("coulomb")[pan], rel=0.4), (got, truth)
    load = abs(gravity_on(lift, hid("mass_scale")))
    holding = lambda c, fl: c + fl * load                                 # noqa: E731 - N m the gearbox holds
    assert holding(got["coulomb"][lift], got["friction_load"][lift]) == pytest.approx(
        holding(hid("coulomb")[lift], hid("friction_load")[lift]), rel=0.15), (got, truth)
    assert gravity_on(lift, got["mass_scale"]) == pytest.approx(gravity_on(lift, hid("mass_scale")), rel=0.1), \
        (got, truth)
    assert math.degrees(got["backlash"][pan]) == pytest.approx(math.degrees(hid("backlash")[pan]), abs=0.5), (got, truth)
    assert round(float(best.latency[0]) / SUBSTEPS) == truth.latency_ticks
    excited = [pan, lift]
    fitted, before, floor = (rms_per_joint(f, c)[excited]
                             for c in (best, nominal(len(ARM), sp), Candidates.of(truth, ROBOT, sp, SUBSTEPS)))
    assert (fitted < 0.5 * before).all() and (fitted < 1.1 * floor).all(), (fitted, before, floor)


def test_an_identified_arm_file_is_checked_and_centres_the_training_env(tmp_path, task_cfg):
    import dataclasses

    from soarm.arm_params import ArmParams, JointParams
    from soarm.training.env import ReachEnv

    arm = ArmParams(servo=task_cfg.servo, latency_ticks=1,
                    joints={n: JointParams(gain_scale=2.0, backlash=math.radians(0.5)) for n in ARM})
    path = config.dump(arm, tmp_path / "arm.yaml")
    base = dataclasses.replace(task_cfg, randomization=dataclasses.replace(task_cfg.randomization, pd_share=0.0,
                                                                          centre_on_arm=True))
    nominal, centred = (ReachEnv(dataclasses.replace(base, arm=a), 256, seed=0) for a in (None, str(path)))
    ratio = centred.sim.physics.gain_scale[:, :5] / nominal.sim.physics.gain_scale[:, :5]
    assert torch.allclose(ratio, torch.tensor(2.0)) and centred.sim.gear_play
    centred.step(torch.zeros(256, 5))
    aside = ReachEnv(dataclasses.replace(base, arm=str(path), randomization=dataclasses.replace(
        base.randomization, centre_on_arm=False)), 256, seed=0)        # the task's model, not training's centre
    assert torch.equal(aside.sim.physics.gain_scale, nominal.sim.physics.gain_scale)
    for text, words in [(path.read_text().replace("wrist_roll", "wrist_twist"), "'wrist_twist' is not a joint"),
                        (path.read_text().replace("sts3215_7v4", "sts3250"), "identified on the servo model"),
                        (path.read_text() + "colour: red\n", "unknown key 'colour'"),
                        ("servo: servo/sts3215_7v4.yaml\ngain_scale: [1, 1, 1, 1, 1]\n", "soarm sysid")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(config.ConfigError, match=words) as e:
            ReachEnv(dataclasses.replace(base, arm=str(bad)), 4, seed=0)
        assert "\n" not in str(e.value) and "bad.yaml" in str(e.value)


def test_sysid_refuses_a_parameter_it_does_not_know_before_it_moves(tmp_path, capsys):
    from soarm import cli

    rc = cli.main(["sysid", "--port", str(tmp_path / "ttyACM5"), "--calibration", str(tmp_path / "c.json"),
                   "--fitted", "gain_scale", "cogging"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "unknown parameter cogging" in err, err


@pytest.mark.slow
def test_sysid_writes_an_arm_file_training_reads_a_report_and_a_plot(tmp_path):
    from soarm.arm_params import load_arm
    from soarm.calibration.search import SearchCfg
    from soarm.calibration.sysid import sysid

    log = write_log(tmp_path / "moving.mcap", n=150)
    cfg = SysidCfg(search=SearchCfg(iterations=1, polish_steps=1, population=4, elites=2), compile=False)
    result = sysid([log], tmp_path / "out", cfg, out=lambda line: None)
    arm = load_arm(tmp_path / "out" / "arm.yaml", ROBOT, "servo/sts3215_7v4.yaml")
    assert all(arm.joints[n] == result.arm.resolved(ROBOT).joints[n] for n in ROBOT.names)
    assert (tmp_path / "out" / "sysid.json").is_file() and (tmp_path / "out" / "sysid.png").stat().st_size > 0
    assert all(j.rms_held_out_mrad is None for j in result.joints)       # one pose only: nothing to hold out


def test_a_fit_worse_than_the_servo_model_on_its_held_out_motion_writes_no_arm_file(tmp_path, monkeypatch, capsys):
    """Held out, the fit must replay better than the servo model, or `soarm sysid` says so with
    both figures and writes nothing (`--keep-worse` writes it anyway)."""
    import dataclasses

    from soarm import cli
    from soarm.arm_params import ArmParams
    from soarm.calibration import sysid as sysid_module
    from soarm.calibration.sysid import JointFit, SysidResult
    from soarm.servo import ServoParams

    def identify(logs, robot, task, cfg, out):
        joints = [JointFit(n, {}, rms_nominal_mrad=4.0, rms_mrad=3.0, rms_held_out_mrad=6.0,
                           rms_held_out_nominal_mrad=5.0) for n in ARM]
        return SysidResult(ArmParams(TASK.servo), joints, 3, 1.0, ServoParams())
    monkeypatch.setattr(sysid_module, "identify", identify)
    monkeypatch.setattr(sysid_module.SysidResult, "table", lambda self: [])
    log = write_log(tmp_path / "moving.mcap", n=150)
    assert cli.main(["sysid", str(log), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "held out 6.00 mrad, servo model 5.00 mrad" in err and "--keep-worse" in err
    assert not (tmp_path / "out").exists()
    better = dataclasses.replace(identify(None, None, None, None, None),
                                 joints=[JointFit(n, {}, 5.0, 3.0, 4.0, 5.0) for n in ARM])
    assert better.worse_than_nominal() == ""
