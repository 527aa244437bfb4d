"""Run by tests/test_isaaclab.py inside the Isaac Lab 3 venv (Python 3.12), on CPU, with no
network: the SO-101 reach task as an Isaac Lab DirectRLEnv on Newton (MuJoCo-Warp)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from soarm import CONFIG_DIR, config
from soarm.description import load_robot
from soarm.reach import ReachCfg
from soarm.servo import ServoConfig
from soarm.sim import ArmSim
from soarm.training.isaac import TASK_ID
from soarm.training.isaac.reach_env import SO101ReachEnv
from soarm.training.isaac.reach_env_cfg import SO101ReachEnvCfg


def make_env(num_envs: int, task_file=None, seed: int = 0) -> SO101ReachEnv:
    cfg = SO101ReachEnvCfg(device="cpu", **({"task_file": str(task_file)} if task_file else {}))
    cfg.scene.num_envs, cfg.seed = num_envs, seed
    return SO101ReachEnv(cfg)


def test_registered_for_isaac_lab_and_its_cli():
    assert gym.spec(TASK_ID).kwargs["env_cfg_entry_point"].endswith("reach_env_cfg:SO101ReachEnvCfg")
    eps = [e.value for e in importlib.metadata.entry_points(group="isaaclab.tasks")]
    assert "soarm.training.isaac" in eps


def test_steps_resets_and_joint_targets_move_the_arm():
    env = make_env(4)
    try:
        obs, _ = env.reset()
        assert obs["policy"].shape == (4, env.cfg.observation_space) and torch.isfinite(obs["policy"]).all()
        q0 = env.arm_robot.data.joint_pos.torch.clone()
        push = torch.tensor([[0.6, 0.0, 0.0, 0.0, 0.0]]).repeat(4, 1)          # shoulder_pan goal up
        for _ in range(20):
            obs, rew, term, trunc, extras = env.step(push)
        moved = env.arm_robot.data.joint_pos.torch - q0
        assert (moved[:, 0] > 0.3).all(), moved                         # 20 x 0.03 rad of goal
        assert moved[:, 1:].abs().max() < moved[:, 0].min()
        truncated_seen = False
        for k in range(env.max_episode_length):
            obs, rew, term, trunc, extras = env.step(torch.zeros(4, 5))
            assert torch.isfinite(obs["policy"]).all() and torch.isfinite(rew).all()
            truncated_seen |= bool(trunc.any())
        assert truncated_seen and (env.task.state.steps < env.task.cfg.episode_steps).all()
        assert torch.isfinite(extras["final_obs"]["policy"]).all()
        stats = env.task.episodes.pop()
        assert stats["episodes"] >= 4 and 0 < stats["fingertip_error"] < 1.0
    finally:
        env.close()


@pytest.mark.parametrize("critic_physics", [False, True])
def test_our_ppo_trains_two_iterations_on_it(tmp_path, critic_physics):
    from soarm.training.runner import Runner, TrainCfg

    cfg = config.from_dict(TrainCfg, {"run": {"sim": "isaaclab", "num_envs": 8, "iterations": 2, "compile": False,
                                              "eval_targets": 0, "out_dir": str(tmp_path)},
                                      "ppo": {"num_steps": 8, "minibatches": 2, "epochs": 2}})
    task = dataclasses.replace(config.load(ReachCfg, CONFIG_DIR / cfg.task), critic_physics=critic_physics)
    runner = Runner(cfg, tmp_path / "run", progress=False, task=task)
    assert runner.model.input_dim == runner.model.obs_dim + runner.env.num_privileged
    try:
        row = runner.learn()
    finally:
        runner.env.env.close()
    assert row["iteration"] == 1 and math.isfinite(row["loss/value_loss"])
    assert (tmp_path / "run" / "model_2.pt").is_file()


@pytest.mark.parametrize("mass", [1.0, 1.3])
def test_same_joint_targets_give_the_same_fingertip_path_in_both_backends(tmp_path, mass):
    """Newton (MuJoCo-Warp) with our servo actuator vs the embedded simulator, one arm
    following the same sinusoidal joint goals for 5 s; nominal links, then 30 % heavier
    ones (the mass randomization reaching Newton)."""
    raw = yaml.safe_load((CONFIG_DIR / "task" / "reach.yaml").read_text())
    raw["randomization"] = {"gain_scale": [1.0, 1.0], "friction_scale": [1.0, 1.0], "mass_scale": [mass, mass],
                            "encoder_offset_ticks": 0, "latency_ticks": [0, 0], "backlash_deg": [0.0, 0.0],
                            "start_noise": 0.0}
    task_file = tmp_path / "nominal.yaml"
    task_file.write_text(yaml.safe_dump(raw))
    task = config.load(ReachCfg, task_file)
    robot = load_robot()
    servo = config.load(ServoConfig, CONFIG_DIR / task.servo)
    env = make_env(1, task_file)
    try:
        env.reset()
        sim = ArmSim(robot, servo.params, servo.registers, 1, 1.0 / (task.control_hz * task.substeps))
        sim.reset(torch.ones(1, dtype=torch.bool), env.arm_robot.data.joint_pos.torch.clone())
        sim.physics.mass_scale = torch.full_like(sim.physics.mass_scale, mass)
        arm, home = robot.arm_index, torch.tensor(robot.home, dtype=torch.float32)
        amp = torch.tensor([0.6, 0.4, -0.5, 0.6, 0.8])
        diffs = []
        t0 = time.perf_counter()
        with torch.no_grad():
            for k in range(round(5.0 * task.control_hz)):
                goal = home + amp * math.sin(2 * math.pi * 0.4 * k / task.control_hz)
                env.task.state.goal[:], env.task.state.goals_in_flight[:] = goal, goal[None]   # a zero action keeps it
                env.step(torch.zeros(1, 5))
                full = sim.goal.clone()
                full[:, arm] = goal
                sim.step(full, task.substeps)
                diffs.append(float((env.fingertip()[0] - sim.dyn.fingertip(sim.q)[0]).norm()))
        d = np.array(diffs)
        report = {"mass_scale": mass, "steps": len(d), "mean_mm": d.mean() * 1e3,
                  "rms_mm": math.sqrt((d ** 2).mean()) * 1e3, "max_mm": d.max() * 1e3,
                  "wall_s": time.perf_counter() - t0}
        print("backend agreement: " + json.dumps(report))
        assert report["rms_mm"] < 2.0 and report["max_mm"] < 5.0, report
    finally:
        env.close()


def test_both_backends_compute_the_same_task_from_the_same_readings(monkeypatch, tmp_path):
    """Conformance: the embedded env and the Isaac Lab env, same task file and seed, fed the
    same encoder readings and joint angles (their own physics still runs underneath, unread)
    and the same actions, for more than an episode with staggered starts, a blown-up arm
    and time-outs: the same observations, rewards, ends, window errors, task state (targets,
    goals, latencies, counters) and, at every restart, the same randomization applied. The
    task's critic observes the physics, so Isaac Lab's "critic" group is checked too."""
    from soarm.reach import full_pose
    from soarm.servo import quantize
    from soarm.training.env import ReachEnv
    from soarm.training.isaac.vec_env import network_input

    N, seed = 6, 4
    task = dataclasses.replace(config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml"), critic_physics=True)
    task_file = config.dump(task, tmp_path / "task.yaml")
    ours, isaac = ReachEnv(task, N, seed=seed), make_env(N, task_file, seed=seed)
    try:
        robot, tick = load_robot(), [0]
        home = torch.tensor(robot.home, dtype=torch.float32)
        wave = torch.linspace(0.0, 2.0, N)[:, None] + torch.arange(5.0)[None]

        def reading():
            return quantize(home + 0.3 * torch.sin(0.05 * tick[0] + wave))

        def joint_angles():
            q = full_pose(ours.dyn, reading() + 1e-3)                 # truth a little off the reading
            if tick[0] == 100:
                q[1] = torch.nan                                     # arm 1's physics blows up once
            return q

        for env in (ours, isaac):
            monkeypatch.setattr(env, "reading", reading)
            monkeypatch.setattr(env, "joint_angles", joint_angles)
        o_ours, o_isaac = ours.reset(), network_input(isaac.reset()[0])
        ours.stagger(24), isaac.task.stagger(24)

        def same(a, b, what):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")

        def same_draws(what):
            ph, s = ours.sim.physics, isaac.servos
            for name in ("gain_scale", "coulomb", "viscous", "encoder_offset"):
                same(getattr(ph, name), getattr(s, name), f"{what}, {name}")
            mass = isaac.arm_robot.data.body_mass.torch[:, isaac.bodies] / isaac.nominal_mass
            torch.testing.assert_close(ph.mass_scale, mass, msg=lambda m: f"{what}, mass_scale: {m}")

        same(o_ours, o_isaac, "reset observation")
        same_draws("reset")
        actions = torch.Generator().manual_seed(1)
        restarts = 0
        for k in range(task.episode_steps + 60):
            tick[0] = k
            a = 0.5 * torch.randn(N, 5, generator=actions)
            o1, r1, te1, tr1, i1 = ours.step(a)
            o2, r2, te2, tr2, i2 = isaac.step(a)
            what = f"step {k}"
            same(o1, network_input(o2), f"{what}, observation and the critic's physics")
            same(o1[:, :ours.num_obs], o2["policy"], f"{what}, the policy's observation")
            same(r1, r2, f"{what}, reward")
            same(te1, te2, f"{what}, terminated")
            same(tr1, tr2, f"{what}, truncated")
            same(i1["final_obs"], network_input(i2["final_obs"]), f"{what}, final observation")
            same(i1["window_error"], i2["window_error"], f"{what}, window error")
            for name, value in ours.task.state.as_dict().items():
                same(value, getattr(isaac.task.state, name), f"{what}, task state {name}")
            if (te1 | tr1).any():
                restarts += int((te1 | tr1).sum())
                same_draws(what)
        assert restarts >= N
        stats_ours, stats_isaac = ours.pop_stats(), isaac.task.episodes.pop()
        assert stats_ours == pytest.approx(stats_isaac, rel=1e-6, nan_ok=True) and stats_ours["terminated"] > 0
    finally:
        isaac.close()


def test_isaac_lab_cli_agent_config_is_our_training_config():
    from soarm.training.isaac.agents import SO101ReachPPORunnerCfg
    from soarm.training.runner import TrainCfg

    ours = config.load(TrainCfg, CONFIG_DIR / "train" / "reach.yaml")
    agent = SO101ReachPPORunnerCfg()
    assert agent.num_steps_per_env == ours.ppo.num_steps and agent.max_iterations == ours.run.iterations
    assert agent.algorithm.num_mini_batches == ours.ppo.minibatches
    assert agent.algorithm.desired_kl == ours.ppo.desired_kl
    assert list(agent.actor.hidden_dims) == list(ours.policy.actor_hidden) and agent.actor.obs_normalization
    assert gym.spec(TASK_ID).kwargs["rsl_rl_cfg_entry_point"].endswith("agents:SO101ReachPPORunnerCfg")
