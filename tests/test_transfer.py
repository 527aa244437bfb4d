"""The transfer suite and the plants it adds: the published MJCF in MuJoCo, backlash, payload."""

import math

import numpy as np
import pytest
import torch

from soarm import REPO_ROOT, cli
from soarm.description import with_payload
from soarm.reach import full_pose
from soarm.robot.transfer import PLANTS, parse_plants, run_suite

POLICY = REPO_ROOT / "data" / "policies" / "reach.onnx"


def test_unknown_plant_is_one_line_listing_the_known_ones(capsys, tmp_path):
    assert cli.main(["transfer", str(POLICY), "--plants", "nominal,mujocco", "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown plant 'mujocco'" in err and all(n in err for n in PLANTS)
    assert not (tmp_path / "t.json").exists()
    assert parse_plants(None) == list(PLANTS)


def test_suite_runs_the_policy_on_our_plant_and_on_mujoco(tmp_path):
    pytest.importorskip("mujoco")
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
    assert rows["nominal"]["ratio_to_nominal"] == 1.0
    assert rows["mujoco"]["mean_error_m"] != rows["nominal"]["mean_error_m"]


def test_same_targets_and_seed_give_the_same_figures():
    a = run_suite(POLICY, ["calibration_10ticks"], targets=4, progress=False)
    b = run_suite(POLICY, ["calibration_10ticks"], targets=4, progress=False)
    assert a["plants"]["calibration_10ticks"]["errors_m"] == b["plants"]["calibration_10ticks"]["errors_m"]


def test_mujoco_actuator_scale_scales_stiffness_and_damping():
    pytest.importorskip("mujoco")
    from soarm.mujoco_arm import load_model

    base, stiff = load_model(), load_model(actuator_scale=4.0)
    assert np.allclose(stiff.actuator_gainprm[:, 0], 4 * base.actuator_gainprm[:, 0])
    assert np.allclose(stiff.actuator_biasprm[:, 1], 4 * base.actuator_biasprm[:, 1])
    assert np.allclose(stiff.dof_damping, 2 * base.dof_damping)
    assert base.actuator_gainprm[0, 0] == pytest.approx(17.8)               # as published


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
