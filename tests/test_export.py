"""ONNX export and the policy runtime: parity, the contract in the metadata, one observation
code path, evaluation of the shipped file, and refusal of bad files and bad input."""

import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch

from soarm import cli, contract
from soarm.export.exporter import export
from soarm.export.runtime import PolicyError, PolicyRuntime
from soarm.reach import OBS_DIM, OBS_SLICES, PRIVILEGED_DIM, full_pose, obs_dim, obs_terms
from soarm.training import checkpoint
from soarm.training.env import ReachEnv
from soarm.training.evaluate import evaluate
from soarm.training.runner import Runner

from tests.helpers import tiny_cfg


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    Runner(tiny_cfg(2), root / "run", progress=False).learn()
    result = export(root / "run", root / "policy.onnx", verify_count=2000)
    return root, result


def test_parity_and_single_file(exported, task_cfg):
    root, result = exported
    assert result["parity_max_abs"] < 1e-5 and result["observations"] == 2000
    assert [p.name for p in root.iterdir() if p.is_file()] == ["policy.onnx"]      # no external .data
    model = onnx.load(root / "policy.onnx")
    assert model.opset_import[0].version >= 17
    assert all(not t.external_data for t in model.graph.initializer)
    (inp,), (out,) = model.graph.input, model.graph.output
    assert inp.name == "obs" and out.name == "actions"
    assert inp.type.tensor_type.shape.dim[0].dim_param                               # dynamic batch
    assert inp.type.tensor_type.shape.dim[1].dim_value == obs_dim(task_cfg.obs_history, task_cfg.fine_error)


def test_contract_in_metadata(exported, robot, task_cfg):
    root, _ = exported
    meta = {p.key: p.value for p in onnx.load(root / "policy.onnx").metadata_props}
    c = json.loads(meta[contract.METADATA_KEY])
    assert c["schema"] == contract.SCHEMA
    assert [(t["name"], t["size"], t["unit"]) for t in c["observation"]] == list(obs_terms(task_cfg.obs_history, task_cfg.fine_error))
    assert c["joint_names"] == list(robot.arm_joints)
    assert c["action"]["default_joint_positions"] == pytest.approx(list(robot.home))
    assert c["control_hz"] == 30.0 and c["encoder"]["ticks_per_rev"] == 4096
    assert c["fine_error"] == task_cfg.fine_error
    assert len(c["training"]["config_hash"]) == 16 and c["training"]["iteration"] == 2
    for key in ("velocity_estimate", "latency", "joint_limits", "task"):
        assert key in c


def test_runtime_matches_torch_for_any_batch(exported):
    root, _ = exported
    rt = PolicyRuntime(root / "policy.onnx")
    model = checkpoint.build_model(checkpoint.load(root / "run"))
    obs = torch.randn(7, rt.obs_dim) * 0.1
    with torch.no_grad():
        want = model.act_deterministic(obs).numpy()
    np.testing.assert_allclose(rt.act(obs.numpy()), want, atol=1e-5)
    np.testing.assert_allclose(rt.act(obs[0].numpy()), want[:1], atol=1e-5)


def test_runtime_builds_the_same_observation_as_the_sim(exported, task_cfg):
    root, _ = exported
    rt = PolicyRuntime(root / "policy.onnx")
    env = ReachEnv(task_cfg, 8, seed=3)
    env.step(torch.rand(8, 5) - 0.5)
    before = env.task.state.last_reading.clone()              # the reading one tick ago
    past = env.task.state.past_readings.clone(), env.task.state.past_goals.clone()   # the history then
    env.step(torch.rand(8, 5) - 0.5)
    q, s = env.reading(), env.task.state
    obs = rt.observe(q.numpy(), before.numpy(), s.goal.numpy(), s.target.numpy(), s.last_action.numpy(),
                     past[0].numpy(), past[1].numpy())
    np.testing.assert_array_equal(obs, env.obs.numpy())
    a = rt.act(obs)
    bounds = task_cfg.action
    want = s.goal + bounds.scale * torch.clamp(torch.from_numpy(a), -1, 1)
    if bounds.max_relative_target is not None:
        want = torch.clamp(want, q - bounds.max_relative_target, q + bounds.max_relative_target)
    m = bounds.goal_margin
    want = torch.clamp(want, torch.tensor(env.robot.lower[env.robot.arm_index] + m, dtype=torch.float32),
                       torch.tensor(env.robot.upper[env.robot.arm_index] - m, dtype=torch.float32))
    np.testing.assert_allclose(rt.next_goal(s.goal.numpy(), a, q.numpy()), want.numpy(), atol=1e-7)


@pytest.mark.slow
def test_a_policy_with_a_history_runs_on_the_robot_path_as_in_the_sim(tmp_path, task_cfg):
    """obs_history=3 and fine_error end to end: the file's contract names the past terms and
    the fine error's scale, the runtime builds the sim's observation from the past readings
    and goals, PolicyStep keeps them newest first, and evaluating the file equals evaluating
    the checkpoint."""
    from soarm.robot.loop import PolicyStep
    from soarm.robot.safety import SafetyCfg, SafetyLayer

    task = dataclasses.replace(task_cfg, obs_history=3, fine_error=0.004)
    Runner(tiny_cfg(2), tmp_path / "run", progress=False, task=task).learn()
    export(tmp_path / "run", tmp_path / "policy.onnx", verify_count=200)
    rt = PolicyRuntime(tmp_path / "policy.onnx")
    assert rt.history == 3 and rt.fine_error == 0.004 and rt.obs_dim == OBS_DIM + 30 + 3
    env = ReachEnv(task, 8, seed=3)
    for _ in range(4):
        s = env.task.state
        before, past_q, past_goal = s.last_reading.clone(), s.past_readings.clone(), s.past_goals.clone()
        env.step(torch.rand(8, 5) - 0.5)
        obs = rt.observe(env.reading().numpy(), before.numpy(), s.goal.numpy(), s.target.numpy(),
                         s.last_action.numpy(), past_q.numpy(), past_goal.numpy())
        np.testing.assert_array_equal(obs, env.obs.numpy())
        np.testing.assert_allclose(obs[:, -3:], np.tanh((s.target - env.task.dyn.fingertip(
            full_pose(env.task.dyn, env.reading()))).numpy() / 0.004), atol=1e-6)
    with pytest.raises(PolicyError, match="observes 3 past ticks, given 0"):
        rt.observe(*(x.numpy() for x in (env.reading(), before, s.goal, s.target, s.last_action)))

    robot = env.robot
    q = env.reading()[0].numpy()
    step = PolicyStep(rt, SafetyLayer(SafetyCfg(), robot.lower[robot.arm_index], robot.upper[robot.arm_index]),
                      30.0, q)
    seen, goals = [], []
    for k in range(4):
        reading = q + 0.002 * k
        goals.append(step.goal.copy())
        assert step(reading, s.target[0].numpy()).decision.goal is not None
        seen.append(reading)
    np.testing.assert_array_equal(step.past_q, np.stack(seen[::-1][:3]))
    np.testing.assert_array_equal(step.past_goal, np.stack(goals[::-1][:3]))

    state = checkpoint.load(tmp_path / "run")
    with torch.no_grad():
        a = evaluate(checkpoint.build_model(state).act_deterministic, task, targets=16, num_envs=8, progress=False)
        b = evaluate(rt, task, targets=16, num_envs=8, progress=False)
    assert abs(a["mean_error_m"] - b["mean_error_m"]) < 1e-4


@pytest.mark.slow
def test_a_critic_that_saw_the_physics_stays_out_of_the_file(tmp_path, task_cfg):
    """critic_physics: the file holds the policy alone (its observation, its normalizer
    statistics), and acts as the checkpoint does."""
    task = dataclasses.replace(task_cfg, critic_physics=True)
    Runner(tiny_cfg(2), tmp_path / "run", progress=False, task=task).learn()
    export(tmp_path / "run", tmp_path / "policy.onnx", verify_count=200)
    rt = PolicyRuntime(tmp_path / "policy.onnx")
    assert rt.obs_dim == obs_dim(task.obs_history, task.fine_error) == rt.contract.obs_dim
    model = checkpoint.build_model(checkpoint.load(tmp_path / "run"))
    assert model.input_dim == rt.obs_dim + PRIVILEGED_DIM
    with torch.no_grad():
        a = evaluate(model.act_deterministic, task, targets=16, num_envs=8, progress=False)
        b = evaluate(rt, task, targets=16, num_envs=8, progress=False)
    assert abs(a["mean_error_m"] - b["mean_error_m"]) < 1e-4


def test_evaluating_the_file_equals_evaluating_the_checkpoint(exported):
    root, _ = exported
    state = checkpoint.load(root / "run")
    task, model = checkpoint.task_cfg(state), checkpoint.build_model(state)
    with torch.no_grad():
        a = evaluate(model.act_deterministic, task, targets=32, num_envs=16, progress=False)
        b = evaluate(PolicyRuntime(root / "policy.onnx"), task, targets=32, num_envs=16, progress=False)
    for key in ("mean_error_m", "median_error_m", "p95_error_m"):
        assert abs(a[key] - b[key]) < 1e-4, (key, a[key], b[key])


def _with_contract(src, dst, edit):
    model = onnx.load(src)
    meta = {p.key: p.value for p in model.metadata_props}
    del model.metadata_props[:]
    c = json.loads(meta[contract.METADATA_KEY])
    edit(c)
    model.metadata_props.add(key=contract.METADATA_KEY, value=json.dumps(c))
    onnx.save(model, dst)


def _bad_files(root, tmp):
    good = root / "policy.onnx"
    (tmp / "truncated.onnx").write_bytes(good.read_bytes()[:500])
    (tmp / "text.onnx").write_text("this is not a model\n")
    plain = onnx.load(good)
    del plain.metadata_props[:]
    onnx.save(plain, tmp / "plain.onnx")
    _with_contract(good, tmp / "schema9.onnx", lambda c: c.update(schema=9))
    _with_contract(good, tmp / "obs.onnx", lambda c: c["observation"].pop())
    _with_contract(good, tmp / "joints.onnx", lambda c: c["joint_names"].reverse())
    _with_contract(good, tmp / "home.onnx", lambda c: c["action"]["default_joint_positions"].__setitem__(1, 0.5))
    _with_contract(good, tmp / "hold.onnx", lambda c: c["gripper"].update(hold=0.7))
    _with_contract(good, tmp / "zero.onnx", lambda c: c["encoder"].update(joint_zero="homing_pose"))
    _with_contract(good, tmp / "urdf.onnx", lambda c: c["robot_description"].update(geometry_hash="0" * 16))
    _with_contract(good, tmp / "lead.onnx", lambda c: c["action"].update(max_relative_target=-0.3))
    _with_contract(good, tmp / "margin.onnx", lambda c: c["action"].update(goal_margin=-0.1))
    _with_contract(good, tmp / "vel.onnx", lambda c: c.update(velocity_estimate="filtered, 5 Hz"))
    _with_contract(good, tmp / "norm.onnx", lambda c: c.update(normalization="none"))
    _with_contract(good, tmp / "latency.onnx", lambda c: c["latency"].update(ticks=[2, 0]))
    return {"missing.onnx": "no such policy file", "truncated.onnx": "not a valid ONNX model",
            "text.onnx": "not a valid ONNX model", "plain.onnx": "soarm export", "schema9.onnx": "schema 9",
            "obs.onnx": "observation terms", "joints.onnx": "joints", "home.onnx": "default_joint_positions",
            "hold.onnx": "gripper", "zero.onnx": "joint_zero", "urdf.onnx": "geometry_hash",
            "lead.onnx": "max_relative_target", "margin.onnx": "goal_margin", "vel.onnx": "velocity_estimate", "norm.onnx": "normalization",
            "latency.onnx": "latency.ticks"}


def test_bad_files_are_refused_with_one_line(exported, tmp_path):
    root, _ = exported
    for name, words in _bad_files(root, tmp_path).items():
        with pytest.raises(PolicyError) as e:
            PolicyRuntime(tmp_path / name)
        msg = str(e.value)
        assert "\n" not in msg and name in msg and words in msg, msg


def test_bad_observations_never_give_an_action(exported):
    root, _ = exported
    rt = PolicyRuntime(root / "policy.onnx")
    with pytest.raises(PolicyError, match="observation shape"):
        rt.act(np.zeros((1, rt.obs_dim - 1)))
    obs = np.zeros((2, rt.obs_dim), dtype=np.float32)
    obs[1, OBS_SLICES["joint_goal"].start + 2] = np.nan
    with pytest.raises(PolicyError, match="NaN or inf in joint_goal"):
        rt.act(obs)


def test_cli_evaluate_refuses_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x00\x01garbage")
    assert cli.main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "broken.onnx" in err


def test_cli_export_writes_beside_the_checkpoint_by_default(exported, capsys):
    root, _ = exported
    assert cli.main(["export", str(root / "run"), "--verify", "100"]) == 0
    assert (root / "run" / "policy.onnx").is_file()
    assert f"-> {root / 'run' / 'policy.onnx'}" in capsys.readouterr().out
    (root / "run" / "policy.onnx").unlink()


def test_export_fails_above_the_parity_tolerance_and_writes_nothing(exported, monkeypatch, tmp_path):
    from soarm.export import exporter

    root, _ = exported
    monkeypatch.setattr(exporter, "TOLERANCE", 0.0)
    with pytest.raises(ValueError, match="torch vs onnxruntime differ by .* nothing written"):
        exporter.export(root / "run", tmp_path / "p.onnx", verify_count=256)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("fine", [-0.01, "0.01", 2.0])
def test_a_bad_fine_error_in_the_contract_is_refused(exported, tmp_path, fine):
    root, _ = exported
    _with_contract(root / "policy.onnx", tmp_path / "bad.onnx", lambda c: c.update(fine_error=fine))
    with pytest.raises(PolicyError, match="fine_error"):
        PolicyRuntime(tmp_path / "bad.onnx")


def test_the_runtime_applies_the_contracts_goal_bound(exported, tmp_path):
    """A file whose contract bounds the goal's lead gets that bound from the runtime, as training applied it."""
    root, _ = exported
    _with_contract(root / "policy.onnx", tmp_path / "bounded.onnx",
                   lambda c: c["action"].update(max_relative_target=0.02))
    rt = PolicyRuntime(tmp_path / "bounded.onnx")
    q = np.zeros((1, 5), dtype=np.float32)
    goal = np.full((1, 5), 0.05, dtype=np.float32)         # already 0.05 rad ahead of the arm
    np.testing.assert_allclose(rt.next_goal(goal, np.ones((1, 5)), q), np.full((1, 5), 0.02), atol=1e-7)
    free = PolicyRuntime(root / "policy.onnx")
    assert free.bounds.max_relative_target is None
    np.testing.assert_allclose(free.next_goal(goal, np.ones((1, 5)), q), goal + free.bounds.scale, atol=1e-7)


def test_the_runtime_keeps_goals_the_contracts_margin_inside_the_limits(exported, tmp_path):
    """Goals pushed at a joint's limits stop goal_margin inside them, as in training; a file from
    before the field is refused, saying how to make it again."""
    root, _ = exported
    rt = PolicyRuntime(root / "policy.onnx")
    assert rt.bounds.goal_margin == pytest.approx(0.15)
    idx = rt.robot.arm_index
    lo, hi = rt.robot.lower[idx], rt.robot.upper[idx]
    at_upper, at_lower = hi[None].astype(np.float32), lo[None].astype(np.float32)
    np.testing.assert_allclose(rt.next_goal(at_upper, np.ones((1, 5)), at_upper), (hi - 0.15)[None], atol=1e-6)
    np.testing.assert_allclose(rt.next_goal(at_lower, -np.ones((1, 5)), at_lower), (lo + 0.15)[None], atol=1e-6)
    _with_contract(root / "policy.onnx", tmp_path / "old.onnx", lambda c: c["action"].pop("goal_margin"))
    with pytest.raises(PolicyError, match="goal_margin missing.*soarm export") as e:
        PolicyRuntime(tmp_path / "old.onnx")
    assert "\n" not in str(e.value)
