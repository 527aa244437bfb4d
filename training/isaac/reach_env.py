"""SO-ARM101 reach in Isaac Lab (direct workflow): the environment.

The task is soarm/reach.py's, function for function, as in the embedded simulator
(training/env.py): targets from `sample_targets`, observations from `observe`, actions to
goals by `action_to_goal` (relative joint targets), `rewards`, `terminations`, and the same
domain randomization draws (`draw_physics`, `draw_latency`, `uniform`) of servo gain,
friction, encoder offsets, link masses and goal latency; the drawn gearbox backlash, fingertip
payload and ideal-PD share are not applied (the Isaac actuator has no gear play, and every
joint runs the servo model). Newton integrates the rigid bodies; the servo
actuator (actuator.py) computes every joint torque.

Observations and the fingertip come from our own kinematics (soarm/dynamics.py) of the
joint angles Isaac Lab reports, so both backends measure the task identically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from isaaclab.envs import DirectRLEnv

from soarm import config
from soarm.description import load_robot
from soarm.dynamics import ArmDynamics
from soarm.identified import task_centre
from soarm.reach import (ReachCfg, action_to_goal, delay_goals, deviation_weights, draw_latency, draw_physics, max_latency,
                         draw_targets, full_pose, limit_clearance, observe, rewards, sample_targets, task_state,
                         terminations, uniform)
from soarm.training.episode_stats import EpisodeStats
from soarm.training.isaac.reach_env_cfg import SO101ReachEnvCfg


class SO101ReachEnv(DirectRLEnv):
    cfg: SO101ReachEnvCfg

    def __init__(self, cfg: SO101ReachEnvCfg, render_mode: str | None = None, **kwargs):
        self.task = config.load(ReachCfg, cfg.task_file)
        super().__init__(cfg, render_mode, **kwargs)
        self.arm_robot = self.scene["robot"]
        self.servos = self.arm_robot.actuators["servos"]
        self.robot = load_robot()
        self.dyn = ArmDynamics(self.robot, self.device)
        self.arm = torch.tensor(self.robot.arm_index, device=self.device)
        self.home = torch.as_tensor(self.robot.home, device=self.device, dtype=torch.float32)
        self.deviation = deviation_weights(self.robot, self.task.reward, self.device)
        self.gen = torch.Generator().manual_seed(0 if cfg.seed is None else cfg.seed)
        self.centre = task_centre(self.task.arm, self.task.servo, self.robot, self.device)
        self.target_pool = sample_targets(self.dyn, self.task.command, max(65536, 4 * self.num_envs), self.gen)
        self.window = self.task.window_steps
        N, A = self.num_envs, len(self.robot.arm_joints)
        self.target, self.action, self.goal, self.goal_line, self.delay, self.prev_meas = task_state(
            N, A, max_latency(self.task.randomization, self.centre), self.device)
        self.joint_goal = torch.zeros(N, len(self.robot.names), device=self.device)
        self.gripper = self.robot.index(self.robot.gripper_joint)
        self.episodes = EpisodeStats(N, self.device)
        # The body each joint moves, and its nominal mass and inertia, for mass randomization.
        self.bodies = torch.tensor([self.arm_robot.body_names.index(j.link) for j in self.robot.joints],
                                   device=self.device)
        self.nominal_mass = self.arm_robot.data.body_mass.torch[:, self.bodies].clone()
        self.nominal_inertia = self.arm_robot.data.body_inertia.torch[:, self.bodies].clone()
        self._reset_idx(None)
        self.obs_meas = self.prev_meas.clone()           # the reading the latest observation was made from

    # ------------------------------------------------------------ helpers
    def measured(self) -> torch.Tensor:
        """Encoder readings of the arm joints (rad): whole ticks with calibration error."""
        return self.servos.measured(self.arm_robot.data.joint_pos.torch)[:, self.arm]

    def fingertip(self) -> torch.Tensor:
        return self.dyn.fingertip(self.arm_robot.data.joint_pos.torch)

    # ------------------------------------------------------------ step
    def _pre_physics_step(self, actions: torch.Tensor) -> None:
        self.actions_now = actions.clone()
        self.goal = action_to_goal(self.dyn, actions, self.goal, self.obs_meas, self.task.action_scale,
                                   self.task.action_clip, self.task.max_relative_target)
        applied, self.goal_line = delay_goals(self.goal_line, self.goal, self.delay)
        self.joint_goal[:, self.arm] = applied
        self.joint_goal[:, self.gripper] = self.robot.gripper_hold

    def _apply_action(self) -> None:
        self.arm_robot.set_joint_position_target_index(target=self.joint_goal)

    def _get_dones(self) -> tuple[torch.Tensor, torch.Tensor]:
        tip = self.fingertip()
        self.error = self.target - tip
        terminated, self.below = terminations(self.task.reward, tip, self.arm_robot.data.joint_pos.torch)
        time_out = (self.episode_length_buf >= self.max_episode_length) & ~terminated
        return terminated, time_out

    def _get_rewards(self) -> torch.Tensor:
        meas = self.measured()
        vel = (meas - self.prev_meas) * self.task.control_hz
        terms = rewards(self.task.reward, error=self.error, action=self.actions_now, last_action=self.action,
                        joint_pos=meas - self.home, joint_vel=vel, clearance=limit_clearance(self.robot, meas),
                        deviation=self.deviation, below_floor=self.below)
        reward = torch.stack(list(terms.values())).sum(0)
        self.action = self.actions_now
        done = self.reset_terminated | self.reset_time_outs
        window_end = (self.episode_length_buf % self.window == 0) | done
        dist = self.error.norm(dim=-1)
        self.episodes.record(terms, reward, dist, window_end, done, self.reset_terminated, self.reset_time_outs,
                             self.episode_length_buf)
        self.extras["window_error"] = torch.where(window_end, dist, torch.nan)
        redraw = window_end & ~done
        new = draw_targets(self.target_pool, self.num_envs, self.gen)
        self.target = torch.where(redraw[:, None], new, self.target)
        return reward

    def step(self, action: torch.Tensor):
        out = super().step(action)
        # The velocity term of the next observation differences against the reading this
        # one was made from (reset environments already hold their reset pose there).
        self.prev_meas = self.obs_meas
        return out

    def _get_observations(self) -> dict:
        self.obs_meas = meas = self.measured()
        obs = observe(self.dyn, meas, self.prev_meas, self.goal, self.target, self.action, self.task.control_hz)
        return {"policy": obs}

    # ------------------------------------------------------------ reset
    def _reset_idx(self, env_ids: Sequence[int] | torch.Tensor | None):
        if env_ids is None:
            env_ids = torch.arange(self.num_envs, device=self.device)
        env_ids = torch.as_tensor(env_ids, device=self.device)
        super()._reset_idx(env_ids)
        n, J, dev = len(env_ids), len(self.robot.names), self.device
        cfg, s = self.task.randomization, self.servos
        drawn = draw_physics(self.gen, cfg, s.params, n, J, dev, centre=self.centre)
        s.gain_scale[env_ids] = drawn["gain_scale"]
        s.coulomb[env_ids] = drawn["coulomb"]
        s.viscous[env_ids] = drawn["viscous"]
        mass_scale = drawn["mass_scale"]                  # link mass and inertia, as soarm/dynamics.py scales them
        self.arm_robot.set_masses_index(masses=self.nominal_mass[env_ids] * mass_scale, body_ids=self.bodies,
                                        env_ids=env_ids)
        self.arm_robot.set_inertias_index(inertias=self.nominal_inertia[env_ids] * mass_scale[..., None],
                                          body_ids=self.bodies, env_ids=env_ids)
        s.encoder_offset[env_ids] = drawn["encoder_offset"]
        self.delay[env_ids] = draw_latency(self.gen, cfg, n, dev, self.centre)
        noise = (-cfg.start_noise, cfg.start_noise)
        arm_q = self.home + uniform(self.gen, (n, len(self.home)), noise, dev, torch.float32)
        q = full_pose(self.dyn, arm_q)
        self.arm_robot.write_joint_position_to_sim_index(position=q, env_ids=env_ids)
        self.arm_robot.write_joint_velocity_to_sim_index(velocity=torch.zeros_like(q), env_ids=env_ids)
        s.restart(env_ids, q)
        full = s.measured(q, env_ids)
        meas = full[:, self.arm]
        self.goal[env_ids] = meas                         # torque on: goal := present
        self.goal_line[env_ids] = meas[:, None]
        self.prev_meas[env_ids] = meas
        self.joint_goal[env_ids] = full
        self.action[env_ids] = 0.0
        self.target[env_ids] = draw_targets(self.target_pool, n, self.gen)
        mask = torch.zeros(self.num_envs, dtype=torch.bool, device=dev)
        mask[env_ids] = True
        self.episodes.reset(mask)
