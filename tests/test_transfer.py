"""The transfer suite and the plants it adds: the published MJCF in MuJoCo, backlash, payload."""

import math

import numpy as np
import pytest
import torch

from soarm import REPO_ROOT, cli
from soarm.description import with_payload
from soarm.reach import full_pose
from soarm.calibration.transfer import PLANTS, jitter, parse_plants, run_suite

POLICY = REPO_ROOT / "data" / "policies" / "reach.onnx"


def test_unknown_plant_is_one_line_listing_the_known_ones(capsys, tmp_path):
    assert cli.main(["transfer", str(POLICY), "--plants", "nominal,mujocco", "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown plant 'mujocco'" in err and all(n in err for n in PLANTS)
    assert not (tmp_path / "t.json").exists()
    assert parse_plants(None) == list(PLANTS)


@pytest.mark.slow
def test_suite_runs_the_policy_on_our_plant_and_on_mujoco(tmp_path):
    out = tmp_path / "t.json"
    assert cli.main(["transfer", str(POLICY), "--plants", "nominal,mujoco,latency_1", "--targets", "4",
                     "--out", str(out)]) == 0
    import json

    r = json.loads(out.read_text())
    rows = r["plants"]
    assert list(rows) == ["nominal", "mujoco", "latency_1"] and (tmp_path / "t.png").stat().st_size > 0
    for row in rows.values():
        assert row["targets"] == 4 and math.isfinite(row["mean_error_m"]) and row["torque_off_ticks"] == 0
    assert rows["nominal"]["mean_error_m"] < 0.01                          # the shipped policy reaches
    assert rows["nominal"]["jitter_m"] < 1e-3                              # and holds still there
    assert rows["nominal"]["ratio_to_nominal"] == 1.0
    assert rows["mujoco"]["mean_error_m"] != rows["nominal"]["mean_error_m"]


@pytest.mark.slow
def test_a_task_file_sets_the_spread_the_randomized_row_draws(tmp_path, capsys):
    """`--task RUN/task.yaml` judges a policy on the randomization it trained on; a task of
    another control rate than the policy's, or no task file, is one line and writes nothing."""
    import dataclasses
    import json

    from soarm import config
    from soarm.export.policies import DEFAULT_TASK
    from soarm.reach import ReachCfg

    task = config.load(ReachCfg, DEFAULT_TASK)
    # The row's latency range is centred on the arm's own latency: a wider range draws later arms.
    late = dataclasses.replace(task, randomization=dataclasses.replace(task.randomization, latency_ticks=(0, 8)))
    config.dump(late, tmp_path / "late.yaml")
    runs = {}
    for name, extra in (("default", []), ("late", ["--task", str(tmp_path / "late.yaml")])):
        out = tmp_path / f"{name}.json"
        assert cli.main(["transfer", str(POLICY), "--plants", "nominal,randomized", "--targets", "4",
                         "--out", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["late"]["task"] == str(tmp_path / "late.yaml")
    assert runs["late"]["plants"]["nominal"] == runs["default"]["plants"]["nominal"]      # same targets
    assert runs["late"]["plants"]["randomized"]["errors_m"] != runs["default"]["plants"]["randomized"]["errors_m"]

    config.dump(dataclasses.replace(task, control_hz=50.0), tmp_path / "fast.yaml")
    for bad, says in ((tmp_path / "fast.yaml", "control_hz 50.0 is not the policy's 30.0"),
                      (tmp_path / "none.yaml", "none.yaml")):
        capsys.readouterr()
        assert cli.main(["transfer", str(POLICY), "--task", str(bad), "--out", str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err, err
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.slow
def test_a_drawn_plant_sends_several_arms_to_each_target():
    """The randomized row judges 4 arms, each drawn apart, on each of the suite's targets."""
    rows = run_suite(POLICY, ["nominal", "randomized"], targets=4, progress=False)["plants"]
    assert PLANTS["randomized"].arms_per_target == 4
    assert rows["nominal"]["targets"] == 4 and rows["randomized"]["targets"] == 16
    by_window = np.array(rows["randomized"]["errors_m"]).reshape(4, 4)      # window-major: 4 arms, one target
    assert len(set(by_window[-1].tolist())) == 4                              # each arm its own plant


def test_jitter_is_the_fingertips_rms_motion_about_where_it_holds():
    still = np.zeros((10, 2, 3))
    chatter = still.copy()
    chatter[::2, 1, 0], chatter[1::2, 1, 0] = 0.002, -0.002               # arm 1 flips 2 mm each tick
    chatter[:, :, 2] = 0.2                                                 # where it holds does not count
    assert jitter(chatter) == pytest.approx([0.0, 0.002])


@pytest.mark.slow
def test_same_targets_and_seed_give_the_same_figures():
    a = run_suite(POLICY, ["calibration_10ticks"], targets=4, progress=False)
    b = run_suite(POLICY, ["calibration_10ticks"], targets=4, progress=False)
    assert a["plants"]["calibration_10ticks"]["errors_m"] == b["plants"]["calibration_10ticks"]["errors_m"]


def test_rows_are_judged_against_their_bounds():
    from soarm.calibration.transfer import judge, summary

    def row(mean, sensed, clear=1.0):
        return {"mean_error_m": mean, "sensed_mean_error_m": sensed, "clear_of_limits": clear}
    rows = {"nominal": row(2.0, 2.0), "mujoco": row(2.7, 2.7), "latency_2": row(2.9, 2.9),
            "calibration_10ticks": row(6.0, 2.2), "friction_x2": row(2.2, 2.2, clear=0.98)}
    judge(rows)
    assert rows["mujoco"]["bound"] == 1.3 and not rows["mujoco"]["holds"]          # 1.35x
    assert rows["latency_2"]["holds"]                                              # 1.45x of 1.5x
    cal = rows["calibration_10ticks"]                                              # the offsets are invisible
    assert cal["ratio_to_nominal"] == 3.0 and cal["judged_ratio"] == pytest.approx(1.1) and cal["holds"]
    assert not rows["friction_x2"]["holds"]                                        # posture: 98 % clear
    line = summary({"plants": rows})
    assert line.startswith("3/5 plants within bounds") and "mujoco 1.35x" in line and "friction_x2" in line


def test_mujoco_actuator_scale_scales_stiffness_and_damping():
    """x4: kp x4 and damping x2, the added half as the actuator's kv (inside its force limit);
    x0.25: kp x0.25, the joint's damping halved."""
    from soarm.mujoco_arm import load_model

    base, stiff, soft = load_model(), load_model(actuator_scale=4.0), load_model(actuator_scale=0.25)
    assert np.allclose(stiff.actuator_gainprm[:, 0], 4 * base.actuator_gainprm[:, 0])
    assert np.allclose(stiff.actuator_biasprm[:, 1], 4 * base.actuator_biasprm[:, 1])
    assert np.allclose(stiff.dof_damping, base.dof_damping)
    assert np.allclose(-stiff.actuator_biasprm[:, 2], base.dof_damping[:6]) and (base.actuator_biasprm[:, 2] == 0).all()
    assert np.allclose(soft.dof_damping, base.dof_damping / 2) and (soft.actuator_biasprm[:, 2] == 0).all()
    assert base.actuator_gainprm[0, 0] == pytest.approx(17.8)               # as published


def test_a_stiffer_mujoco_servo_is_as_fast_as_the_published_one(robot, dyn64):
    """Its damping is its drive's: at the force limit the x50 arm's pan turns as fast as the
    published arm's (joint damping outside the limit would cap it at 0.79 rad/s)."""
    from soarm.mujoco_arm import MujocoArm

    peak = {}
    for scale in (1.0, 50.0):
        arm = MujocoArm(robot, 1, actuator_scale=scale)
        q = full_pose(dyn64, torch.as_tensor(robot.home, dtype=torch.float64)[None]).numpy()
        arm.reset(q)
        goal = q.copy()
        goal[0, 0] += 1.5
        speeds = []
        for _ in range(15):                                   # 0.5 s
            before = arm.q[0, 0]
            arm.step(goal, 1 / 30)
            speeds.append((arm.q[0, 0] - before) * 30)
        peak[scale] = max(speeds)
    assert peak[50.0] > 2.0 and peak[50.0] > 0.6 * peak[1.0], peak


def test_payload_adds_its_mass_at_the_fingertip(robot):
    heavy = with_payload(robot, 0.1)
    assert sum(j.mass for j in heavy.joints) == pytest.approx(sum(j.mass for j in robot.joints) + 0.1)
    j0, j1 = robot.joints[robot.fingertip_body], heavy.joints[robot.fingertip_body]
    assert np.linalg.norm(j1.com - robot.fingertip_xyz) < np.linalg.norm(j0.com - robot.fingertip_xyz)
    assert np.all(np.linalg.eigvalsh(j1.inertia) > 0)


def hold_then_reverse(robot, backlash: float):
    """The elbow held at home, then sent 0.2 rad down and back: where it ends, and its slack."""
    from soarm import CONFIG_DIR, config
    from soarm.servo import ServoConfig
    from soarm.sim import ArmSim

    servo = config.load(ServoConfig, CONFIG_DIR / "servo" / "sts3215_7v4.yaml")
    sim = ArmSim(robot, servo.params, servo.registers, 1, 0.0056, backlash=backlash)
    q0 = full_pose(sim.dyn, torch.as_tensor(robot.home, dtype=torch.float32)[None])
    sim.reset(torch.ones(1, dtype=torch.bool), q0)
    with torch.no_grad():
        sim.step(sim.goal, 200)
        g = sim.goal.clone()
        g[0, 2] -= 0.2
        sim.step(g, 150)
        g[0, 2] += 0.2
        sim.step(g, 300)
    return sim.q[0] - q0[0], sim.slack[0]


def test_backlash_lets_the_output_wander_within_the_gap(robot):
    none, slack0 = hold_then_reverse(robot, 0.0)
    gap = math.radians(1.0)
    play, slack = hold_then_reverse(robot, gap)
    assert torch.all(slack0 == 0)
    assert torch.all(slack.abs() <= gap / 2 + 1e-6)
    assert torch.isfinite(play).all()
    # The same servo loop closes on the output encoder, so the arm ends within about a gap of
    # where it ends without play, but not at the same place.
    assert (play - none).abs().max() <= gap + 4 * 2 * math.pi / 4096
    assert (play - none).abs().max() > 2 * math.pi / 4096


def test_batched_payload_is_the_folded_one(robot):
    """The per-environment payload the training draws (ArmDynamics `payload`) gives the very
    M and bias of the description with the mass folded in (the transfer suite's payload row)."""
    from soarm.dynamics import ArmDynamics

    gen = torch.Generator().manual_seed(0)
    q = torch.rand(8, 6, generator=gen, dtype=torch.float64) * 2 - 1
    qd = torch.rand(8, 6, generator=gen, dtype=torch.float64) * 4 - 2
    batched = ArmDynamics(robot, dtype=torch.float64).mass_and_bias(q, qd, None, torch.full((8, 1), 0.1,
                                                                                              dtype=torch.float64))
    folded = ArmDynamics(with_payload(robot, 0.1), dtype=torch.float64).mass_and_bias(q, qd)
    assert torch.allclose(batched[0], folded[0], atol=1e-12) and torch.allclose(batched[1], folded[1], atol=1e-12)


@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_pd_drive_follows_mujocos_position_actuator(robot, scale):
    """ArmSim's ideal PD drive (the training's published-model share) set to the published
    MJCF's actuator, kp x1 and x50, follows MuJoCo's own trajectory of a goal step, at the
    training's physics step (MuJoCo runs its 2 ms): implicit, stable at kp 890."""
    from soarm import CONFIG_DIR, config
    from soarm.mujoco_arm import MujocoArm
    from soarm.servo import ServoConfig
    from soarm.sim import ArmSim

    servo = config.load(ServoConfig, CONFIG_DIR / "servo" / "sts3215_7v4.yaml")
    sim = ArmSim(robot, servo.params, servo.registers, 1, 0.0056, dtype=torch.float64, pd_drives=True)
    ph = sim.physics
    ph.pd[:], ph.pd_kp[:], ph.pd_kv[:] = True, 17.8 * scale, 0.60 * (math.sqrt(scale) - 1)
    ph.pd_damping[:], ph.pd_force[:], ph.coulomb[:] = 0.60, 3.35, 0.052
    mj = MujocoArm(robot, 1, actuator_scale=scale)
    home = full_pose(sim.dyn, torch.as_tensor(robot.home, dtype=torch.float64)[None])
    mj.reset(home.numpy())
    sim.reset(torch.ones(1, dtype=torch.bool), home)
    goal = home.clone()
    goal[0, 1:4] += torch.tensor([0.3, -0.3, 0.2], dtype=torch.float64)
    worst = 0.0
    for _ in range(60):                                   # 2 s at 30 Hz
        mj.step(goal.numpy(), 1 / 30)
        with torch.no_grad():
            sim.step(goal, 6)
        worst = max(worst, float(np.abs(mj.q - sim.q.numpy()).max()))
    assert np.abs(sim.q.numpy() - goal.numpy())[0, 1:4].max() < 0.03          # it moved the 0.2-0.3 rad
    assert worst < 0.03, f"ArmSim's PD left MuJoCo's trajectory by {worst:.4f} rad"


def test_a_perturbation_row_acts_on_top_of_the_tasks_model_of_the_arm():
    """On an identified arm (the default model), `backlash_1deg` still plays 1 deg in every
    joint, and `servo_model` drops the arm: the rows perturb the arm, the arm does not mask them."""
    from soarm.arm_params import ArmParams, JointParams
    from soarm.calibration.transfer import SuiteContext
    from soarm.reach import ReachCfg
    from soarm import CONFIG_DIR, config

    task = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")
    ctx = SuiteContext.of(task)
    ctx.arm = ArmParams(task.servo, joints={"shoulder_lift": JointParams(backlash=0.002, gain_scale=1.5)}).resolved(ctx.robot)
    gen = torch.Generator().manual_seed(0)
    play = PLANTS["backlash_1deg"].build(ctx, 2, gen).sim.physics
    assert torch.all(play.backlash >= math.radians(1.0) - 1e-9) and float(play.gain_scale[0, 1]) == 1.5
    bare = PLANTS["servo_model"].build(ctx, 2, gen).sim.physics
    assert torch.all(bare.gain_scale == 1.0) and torch.all(bare.backlash == 0.0)


def test_stiction_holds_a_joint_at_rest_and_not_a_moving_one(robot):
    """Static above kinetic friction (ArmParams `stiction`): the lift, torque off, stays where
    it was let go while gravity stays under its static friction; the same friction does not
    brake a joint that is already moving."""
    from soarm import CONFIG_DIR, config
    from soarm.servo import ServoConfig
    from soarm.sim import ArmSim

    servo = config.load(ServoConfig, CONFIG_DIR / "servo" / "sts3215_7v4.yaml")
    sim = ArmSim(robot, servo.params, servo.registers, 3, 0.0056)
    q0 = full_pose(sim.dyn, torch.as_tensor(robot.home, dtype=torch.float32)[None]).expand(3, -1)
    sim.reset(torch.ones(3, dtype=torch.bool), q0)
    sim.physics.stiction[1:, 1] = 5.0                     # env 0: none; 1 and 2: more than gravity
    sim.qd[2, 1] = -0.5                                   # env 2: already moving
    sim.enabled[:] = False
    with torch.no_grad():
        sim.step(sim.goal, 20)
    moved = (sim.q[:, 1] - q0[:, 1]).abs()
    assert moved[0] > 1e-3 and moved[1] == 0 and moved[2] > 1e-3


def test_the_scripted_controller_runs_through_the_suite_as_a_policy():
    """`soarm transfer scripted`: the baseline a learned policy must beat, through the same
    decision step, safety layer and plants, under the task's own contract."""
    from soarm.calibration.transfer import run_suite

    result = run_suite("scripted", ["nominal", "latency_1"], targets=16, progress=False)
    rows = result["plants"]
    assert rows["nominal"]["median_error_m"] < 0.005 and rows["latency_1"]["targets"] == 16, rows["nominal"]
    assert rows["nominal"]["torque_off_ticks"] == 0
