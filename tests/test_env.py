import dataclasses
import math

import pytest
import torch

from soarm.description import load_robot
from soarm.reach import (OBS_DIM, OBS_SLICES, PRIVILEGED_DIM, PRIVILEGED_SLICES, RewardCfg, action_to_goal,
                         arm_limits, delay_goals, deviation_weights, draw_latency, in_region, limit_clearance,
                         obs_dim, rewards, window_tail)
from soarm.servo import TICK
from soarm.training.env import ReachEnv
from soarm.training.evaluate import evaluate
from soarm.training.scripted import ScriptedReach


def test_shapes_and_finiteness(task_cfg):
    env = ReachEnv(task_cfg, 16, seed=0)
    obs = env.reset()
    assert obs.shape == (16, obs_dim(task_cfg.obs_history, task_cfg.fine_error))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        obs, rew, term, trunc, info = env.step(torch.rand(16, 5, generator=g) * 2 - 1)
        assert torch.isfinite(obs).all() and torch.isfinite(rew).all()
        assert rew.shape == term.shape == trunc.shape == (16,)
    assert in_region(env.task.state.target, task_cfg.command).all()


def test_observation_is_quantized(task_cfg):
    env = ReachEnv(task_cfg, 4, seed=0)
    env.step(torch.zeros(4, 5))
    home = torch.tensor(env.robot.home, dtype=torch.float32)
    ticks = (env.obs[:, OBS_SLICES["joint_pos"]] + home) / TICK
    assert torch.allclose(ticks, ticks.round(), atol=2e-3)


def test_a_history_observes_the_last_readings_and_goals_newest_first(task_cfg):
    """obs_history=3: the past terms are the readings and goals of the three observations
    before, minus home; a new episode starts its history at the present reading."""
    cfg = dataclasses.replace(task_cfg, obs_history=3, fine_error=0.0)
    env = ReachEnv(cfg, 4, seed=0)
    home = torch.tensor(env.robot.home, dtype=torch.float32)
    readings, goals = [env.reading()], [env.task.state.goal.clone()]
    assert torch.equal(env.obs[:, OBS_DIM:OBS_DIM + 15].view(4, 3, 5), (readings[0] - home)[:, None].expand(4, 3, 5))
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        obs, *_ = env.step(torch.rand(4, 5, generator=g) * 2 - 1)
        past_q, past_goal = obs[:, OBS_DIM:OBS_DIM + 15].view(4, 3, 5), obs[:, OBS_DIM + 15:].view(4, 3, 5)
        expect_q = torch.stack(readings[::-1][:3], dim=1) - home[None, None]
        expect_goal = torch.stack(goals[::-1][:3], dim=1) - home[None, None]
        n = min(3, len(readings))                    # the start's reading fills the rest
        assert torch.equal(past_q[:, :n], expect_q[:, :n]) and torch.equal(past_goal[:, :n], expect_goal[:, :n])
        readings.append(env.reading())
        goals.append(env.task.state.goal.clone())
    assert obs.shape == (4, OBS_DIM + 30)


@pytest.mark.slow
@pytest.mark.parametrize("num_envs", [1, 3])
def test_given_targets_are_visited_in_order_one_per_window(task_cfg, num_envs):
    """Across window ends and episode restarts, each window that starts takes the next target."""
    cfg = dataclasses.replace(task_cfg, episode_s=2 * task_cfg.command.resample_s)   # an episode: 2 windows
    fixed = torch.rand(7, 3, generator=torch.Generator().manual_seed(0))
    env = ReachEnv(cfg, num_envs, seed=0, targets=fixed)
    env.reset()
    seen = [env.task.state.target.clone()]
    for _ in range(5):                                                          # 5 more windows
        for _ in range(env.window):
            env.step(torch.zeros(num_envs, 5))
        seen.append(env.task.state.target.clone())
    order = torch.cat(seen)                                                     # window-major, env order
    expect = fixed[torch.arange(len(order)) % len(fixed)]
    assert torch.equal(order, expect)


def test_truncation_and_auto_reset(task_cfg):
    cfg = dataclasses.replace(task_cfg, episode_s=2.0)
    env = ReachEnv(cfg, 8, seed=0)
    env.reset()
    for k in range(cfg.episode_steps):
        obs, _, term, trunc, info = env.step(torch.zeros(8, 5))
    assert trunc.all() and not term.any()
    assert (env.task.state.steps == 0).all()                     # all restarted
    assert not torch.equal(info["final_obs"], obs)         # final_obs is the pre-reset observation
    stats = env.pop_stats()
    assert stats["episodes"] == 8 and stats["truncated"] == 1.0


def test_the_critic_sees_each_episodes_drawn_physics_and_the_policy_does_not(task_cfg):
    """critic_physics: the env's observation is the policy's, unchanged (the same draws, the
    same numbers), followed by the physics and latency each episode drew, renewed at restarts."""
    short = dataclasses.replace(task_cfg, episode_s=task_cfg.command.resample_s)
    plain, asym = ReachEnv(short, 6, seed=2), ReachEnv(dataclasses.replace(short, critic_physics=True), 6, seed=2)
    n = plain.num_obs
    assert (asym.num_obs, asym.num_privileged, plain.num_privileged) == (n, PRIVILEGED_DIM, 0)

    def drawn(env):
        ph = env.sim.physics
        arm = env.arm
        return {"log_gain": ph.gain_scale[:, arm].log(), "payload_100g": ph.payload[:, 0] * 10,
                "latency": env.task.state.latency.float()}

    g = torch.Generator().manual_seed(0)
    seen_restart = False
    for _ in range(short.episode_steps + 3):
        action = torch.rand(6, 5, generator=g) * 2 - 1
        a, *_ = plain.step(action)
        b, _, _, trunc, _ = asym.step(action)
        seen_restart |= bool(trunc.any())
        assert b.shape == (6, n + PRIVILEGED_DIM) and torch.equal(b[:, :n], a)
        priv, want = b[:, n:], drawn(asym)
        cols = {k: priv[:, v] for k, v in PRIVILEGED_SLICES.items()}
        assert torch.allclose(cols["log_gain_scale"], want["log_gain"])
        assert torch.allclose(cols["payload"][:, 0], want["payload_100g"])
        assert torch.equal(cols["latency"][:, 0], want["latency"])
    assert seen_restart


def test_hard_replay_restarts_a_share_of_arms_on_the_worst_ended_episodes_physics(task_cfg):
    """randomization.hard_replay: where episodes end, a share of the new ones take the physics
    and latency of one of the worst quarter of those that ended (by mean window error), the
    rest draw afresh; the task's record of each env's physics is what the simulator runs."""
    short = dataclasses.replace(task_cfg, episode_s=task_cfg.command.resample_s)   # one window an episode
    cfg = dataclasses.replace(short, randomization=dataclasses.replace(short.randomization, hard_replay=0.5))
    n = 16
    env = ReachEnv(cfg, n, seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(cfg.episode_steps - 1):
        env.step(torch.rand(n, 5, generator=g) * 2 - 1)
    old = {k: getattr(env.sim.physics, k).clone() for k in env.task.physics}
    old_latency = env.task.state.latency.clone()
    _, _, term, trunc, info = env.step(torch.rand(n, 5, generator=g) * 2 - 1)
    ended = (term | trunc).nonzero()[:, 0].tolist()     # those that fell below the floor restarted before
    assert len(ended) >= 8
    error = info["window_error"][ended]
    worst = {ended[j] for j in torch.argsort(error, descending=True)[:(len(ended) + 3) // 4].tolist()}
    replayed = 0
    for i in ended:
        same = [j for j in range(n) if all(torch.equal(getattr(env.sim.physics, k)[i], old[k][j]) for k in old)]
        if same:
            replayed += 1
            assert set(same) <= worst and env.task.state.latency[i] == old_latency[same[0]], (i, same, worst)
    assert 0 < replayed < len(ended)
    for k, v in env.task.physics.items():
        assert torch.equal(v, getattr(env.sim.physics, k)), k


def test_stagger_spreads_episode_starts(task_cfg):
    env = ReachEnv(task_cfg, 256, seed=0)
    env.stagger(24)
    assert len(env.task.state.steps.unique()) > 5 and (env.task.state.steps % 24 == 0).all()


def test_nan_action_rejected(task_cfg):
    env = ReachEnv(task_cfg, 2, seed=0)
    with pytest.raises(ValueError, match="NaN"):
        env.step(torch.tensor([[0.0, float("nan"), 0, 0, 0]] * 2))


def test_joint_deviation_holds_only_the_named_joints(task_cfg):
    robot = load_robot()
    weights = deviation_weights(robot, task_cfg.reward, "cpu")
    joint_pos = torch.zeros(2, 5)
    joint_pos[0, robot.arm_joints.index("wrist_roll")] = -0.5
    joint_pos[1, robot.arm_joints.index("shoulder_pan")] = 0.5
    zeros = torch.zeros(2, 5)
    terms = rewards(task_cfg.reward, error=torch.zeros(2, 3), action=zeros, last_action=zeros, joint_pos=joint_pos,
                    joint_vel=zeros, clearance=torch.ones(2, 5), deviation=weights,
                    below_floor=torch.zeros(2, dtype=torch.bool), tail=torch.zeros(2, dtype=torch.bool))
    roll_weight = task_cfg.reward.joint_deviation["wrist_roll"]
    assert roll_weight < 0
    torch.testing.assert_close(terms["joint_deviation"], torch.tensor([0.5 * roll_weight, 0.0]))
    typo = dataclasses.replace(task_cfg.reward, joint_deviation={"wrist_rol": -0.1})
    with pytest.raises(ValueError, match="'wrist_rol' is not an arm joint"):
        deviation_weights(robot, typo, "cpu")


def test_joint_limit_term_prices_only_the_soft_limit_band():
    robot = load_robot()
    cfg = RewardCfg(joint_limit=-2.0, limit_margin=0.15)
    lo, hi = arm_limits(robot, "cpu")
    q = (lo + hi)[None].repeat(3, 1) / 2                   # mid-range: free
    q[1, 2] = hi[2] - 0.05                                 # 0.10 rad into the band
    q[2, 0] = lo[0] + 0.15                                 # exactly on the soft limit: free
    zeros = torch.zeros(3, 5)
    terms = rewards(cfg, error=torch.zeros(3, 3), action=zeros, last_action=zeros, joint_pos=zeros, joint_vel=zeros,
                    clearance=limit_clearance(robot, q), deviation=torch.zeros(5),
                    below_floor=torch.zeros(3, dtype=torch.bool), tail=torch.zeros(3, dtype=torch.bool))
    torch.testing.assert_close(terms["joint_limit"], torch.tensor([0.0, -0.2, 0.0]), atol=1e-5, rtol=0)


def test_position_end_acts_only_on_a_windows_last_ticks(task_cfg):
    cfg = dataclasses.replace(task_cfg, reward=dataclasses.replace(task_cfg.reward, end_ticks=10))
    window = cfg.window_steps
    steps = torch.tensor([0, window - 11, window - 10, window - 1, window, 2 * window - 1])
    assert window_tail(steps, cfg).tolist() == [False, False, True, True, False, True]
    assert ((steps + 1) % window == 0).tolist() == [False, False, False, True, False, True]   # its last: the window's end
    vel, zeros = torch.full((2, 5), 2.0), torch.zeros(2, 5)
    terms = rewards(cfg.reward, error=torch.zeros(2, 3), action=zeros, last_action=zeros, joint_pos=zeros,
                    joint_vel=vel, clearance=torch.ones(2, 5), deviation=torch.zeros(5),
                    below_floor=torch.zeros(2, dtype=torch.bool), tail=torch.tensor([True, False]))
    assert "settle" not in terms                     # no term of zero weight is computed
    # The task's own weight (shipped since T3): full pay at zero error, on a window's last ticks only.
    assert cfg.reward.position_end > 0
    torch.testing.assert_close(terms["position_end"], torch.tensor([cfg.reward.position_end, 0.0]))
    end = dataclasses.replace(cfg.reward, position_end=2.0, tanh_end=0.03)
    terms = rewards(end, error=torch.tensor([[0.0, 0.03, 0.04]] * 2), action=zeros, last_action=zeros,
                    joint_pos=zeros, joint_vel=zeros, clearance=torch.ones(2, 5), deviation=torch.zeros(5),
                    below_floor=torch.zeros(2, dtype=torch.bool), tail=torch.tensor([True, False]))
    torch.testing.assert_close(terms["position_end"], torch.tensor([2.0 * (1 - math.tanh(0.05 / 0.03)), 0.0]))
    with pytest.raises(ValueError, match="end_ticks"):
        dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, end_ticks=window + 1)).validate()
    with pytest.raises(ValueError, match="tanh_end"):
        dataclasses.replace(cfg.reward, tanh_end=0.0).validate()


def test_goal_cannot_wind_up_past_max_relative_target():
    """A joint that does not follow its goals (stalled, heavily damped) keeps its goal within
    max_relative_target: the wound-up lead is what it would overshoot by when it catches up."""
    from soarm.dynamics import ArmDynamics
    from soarm.reach import ActionBounds

    dyn = ArmDynamics(load_robot())
    lead, free_bounds = ActionBounds(0.05, 1.0, 0.3), ActionBounds(0.05, 1.0, None)
    stuck = torch.zeros(1, 5)                      # measured: the joints do not move
    goal = stuck.clone()
    for _ in range(40):                            # full action for 40 ticks: 2 rad unbounded
        goal = action_to_goal(dyn, torch.ones(1, 5), goal, stuck, lead)
    lo, hi = arm_limits(dyn.robot, "cpu")
    torch.testing.assert_close(goal, torch.minimum(torch.full((1, 5), 0.3), hi[None]))
    free = action_to_goal(dyn, torch.ones(1, 5), stuck, stuck, free_bounds)
    torch.testing.assert_close(free, torch.full((1, 5), 0.05))
    # The limits still win over the band.
    at_limit = hi[None] - 0.01
    assert bool((action_to_goal(dyn, torch.ones(1, 5), at_limit, at_limit, lead) <= hi).all())


def test_training_goals_stop_goal_margin_inside_the_limits(task_cfg):
    """Full actions held for 3 s of goals drive every goal to its soft limit and no further."""
    cfg = dataclasses.replace(task_cfg, action=dataclasses.replace(task_cfg.action, goal_margin=0.15,
                                                                   max_relative_target=None))
    env = ReachEnv(cfg, 4, seed=0)
    lo, hi = arm_limits(env.robot, "cpu")
    push = torch.ones(4, 5)
    push[2:] = -1
    for _ in range(90):
        env.task.act(push)
    goal = env.task.state.goal
    torch.testing.assert_close(goal[:2], (hi - 0.15).expand(2, -1))
    torch.testing.assert_close(goal[2:], (lo + 0.15).expand(2, -1))


def test_goals_reach_the_servos_after_each_envs_latency():
    """Env i applies the goal of `delay[i]` ticks ago; a reset line starts at the reset goal."""
    delay = torch.tensor([0, 1, 2])
    line = torch.zeros(3, 3, 1)                            # TaskState.goals_in_flight for at most 2 ticks
    applied = []
    for k in range(1, 5):
        a, line = delay_goals(line, torch.full((3, 1), float(k)), delay)
        applied.append(a[:, 0].tolist())
    assert applied == [[1, 0, 0], [2, 1, 0], [3, 2, 1], [4, 3, 2]]


def test_latency_draws_cover_the_configured_ticks(task_cfg):
    cfg = dataclasses.replace(task_cfg.randomization, latency_ticks=(0, 2))
    drawn = draw_latency(torch.Generator().manual_seed(0), cfg, 3000, "cpu")
    counts = torch.bincount(drawn, minlength=3)
    assert len(counts) == 3 and (counts > 900).all()


def test_an_ideal_position_drive_has_no_gear_play_and_at_least_the_top_speed_asked(task_cfg):
    """A PD-driven arm stands for a published model's actuator: no backlash (a stiff drive closed
    on the output through play limit-cycles at a held goal), and its joint damping, outside the
    force limit, never holds it below `pd_min_top_speed`; the damping the cap takes from the joint
    acts inside the limit, so the drawn damping ratio stands."""
    from soarm import CONFIG_DIR, config
    from soarm.reach import draw_physics
    from soarm.servo import ServoConfig

    servo = config.load(ServoConfig, CONFIG_DIR / task_cfg.servo).params
    cfg = dataclasses.replace(task_cfg.randomization, pd_share=0.5, backlash_deg=(0.5, 1.5), pd_kp=(500.0, 1000.0),
                              pd_damping_ratio=(0.8, 0.8), pd_kv_share=(0.0, 0.0), pd_min_top_speed=2.7)
    d = draw_physics(torch.Generator().manual_seed(0), cfg, servo, 256, 6, "cpu")
    pd = d["pd"][:, 0]
    assert pd.any() and (~pd).any()
    assert (d["backlash"][pd] == 0).all() and (d["backlash"][~pd] >= math.radians(0.5) - 1e-6).all()
    assert (d["pd_force"] / d["pd_damping"] >= 2.7 * (1 - 1e-5)).all()
    c = 2 * 0.8 * torch.sqrt(d["pd_kp"] * servo.armature)
    torch.testing.assert_close(d["pd_kv"] + d["pd_damping"], c)
    assert (d["pd_kv"] > 0).all()                          # all outside as drawn: the cap moved it in
    uncapped = draw_physics(torch.Generator().manual_seed(0), dataclasses.replace(cfg, pd_min_top_speed=0.0),
                            servo, 256, 6, "cpu")
    assert (uncapped["pd_kv"] == 0).all() and (uncapped["pd_force"] / uncapped["pd_damping"] < 2.7).any()


def test_physics_step_converges(task_cfg):
    """The default physics step agrees with one 4x finer on the fingertip path (median < 1 mm)."""
    paths = []
    for substeps in (task_cfg.substeps, 4 * task_cfg.substeps):
        env = ReachEnv(dataclasses.replace(task_cfg, substeps=substeps), 64, seed=1)
        g = torch.Generator().manual_seed(0)
        tips = []
        for k in range(45):
            if k % 15 == 0:
                a = (torch.rand(64, 5, generator=g) * 2 - 1) * 0.4
            env.step(a)
            tips.append(env.dyn.fingertip(env.sim.q))
        paths.append(torch.stack(tips))
    assert (paths[0] - paths[1]).norm(dim=-1).median() < 1e-3


def test_scripted_controller_reaches(task_cfg):
    """The environment is solvable to millimetres through the policy's own action path."""
    env = ReachEnv(task_cfg, 1)
    policy = ScriptedReach(env.dyn, task_cfg.action)
    result = evaluate(policy, task_cfg, targets=64, num_envs=32,
                      progress=False)
    assert result["success_1cm"] > 0.9 and result["median_error_m"] < 0.005, result


def test_velocity_survives_a_target_change(task_cfg):
    """A new target must not reset the velocity estimate of an arm that is moving."""
    env = ReachEnv(task_cfg, 8, seed=0)
    env.reset()
    for k in range(env.window - 1):
        env.step(torch.ones(8, 5) * (0.8 if k < env.window - 4 else -0.8))
    before = env.task.state.target.clone()
    obs, _, term, trunc, info = env.step(torch.ones(8, 5) * -0.8)
    kept = ~(term | trunc)
    assert kept.any() and not torch.equal(env.task.state.target[kept], before[kept])
    vel = obs[kept, OBS_SLICES["joint_vel"]]
    assert vel.abs().sum() > 0
    assert torch.equal(vel, info["final_obs"][kept, OBS_SLICES["joint_vel"]])
