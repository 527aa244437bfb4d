"""SO-ARM101 reach in Isaac Lab (direct workflow): the environment.

The task is soarm/reach_task.py's, the very object the embedded simulator (training/env.py)
steps: targets, observations, actions to goals through the latency, rewards, terminations,
target windows, episode statistics and the domain randomization draws. This class owns the
physics only: Newton integrates the rigid bodies, the servo actuator (actuator.py) computes
every joint torque. Of the drawn physics it applies servo gain, friction (Coulomb, viscous,
load-dependent), dead-band, armature, encoder offsets and link masses; gearbox backlash, fingertip payload and ideal-PD drives are not applied
(the Isaac actuator has no gear play, and every joint runs the servo model).

Observations and the fingertip come from our own kinematics (soarm/dynamics.py) of the
joint angles Isaac Lab reports, so both backends measure the task identically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from isaaclab.envs import DirectRLEnv

from soarm import config
from soarm.description import load_robot
from soarm.reach import ReachCfg
from soarm.reach_task import EpisodeStart, ReachTask
from soarm.training.isaac.reach_env_cfg import SO101ReachEnvCfg


class SO101ReachEnv(DirectRLEnv):
    cfg: SO101ReachEnvCfg

    def __init__(self, cfg: SO101ReachEnvCfg, render_mode: str | None = None, **kwargs):
        task_cfg = config.load(ReachCfg, cfg.task_file)
        super().__init__(cfg, render_mode, **kwargs)
        self.arm_robot = self.scene["robot"]
        self.servos = self.arm_robot.actuators["servos"]
        self.robot = load_robot()
        self.task = ReachTask(task_cfg, self.robot, self.num_envs, self.device, 0 if cfg.seed is None else cfg.seed)
        self.dyn, self.arm = self.task.dyn, self.task.arm
        self.joint_goal = torch.zeros(self.num_envs, len(self.robot.names), device=self.device)
        self.gripper = self.robot.index(self.robot.gripper_joint)
        # The body each joint moves, and its nominal mass and inertia, for mass randomization.
        self.bodies = torch.tensor([self.arm_robot.body_names.index(j.link) for j in self.robot.joints],
                                   device=self.device)
        self.nominal_mass = self.arm_robot.data.body_mass.torch[:, self.bodies].clone()
        self.nominal_inertia = self.arm_robot.data.body_inertia.torch[:, self.bodies].clone()
        self.starts: EpisodeStart | None = None          # drawn by this step's finish_step
        self._reset_idx(None)

    # ------------------------------------------------------------ what the arm reads
    def joint_angles(self) -> torch.Tensor:
        """The true joint angles [N, J] (rad)."""
        return self.arm_robot.data.joint_pos.torch

    def reading(self) -> torch.Tensor:
        """What the arm joints' encoders read [N, A] (rad): whole ticks with calibration error."""
        return self.servos.measured(self.joint_angles())[:, self.arm]

    def fingertip(self) -> torch.Tensor:
        return self.dyn.fingertip(self.joint_angles())

    # ------------------------------------------------------------ step
    def _pre_physics_step(self, actions: torch.Tensor) -> None:
        self.joint_goal[:, self.arm] = self.task.act(actions)
        self.joint_goal[:, self.gripper] = self.robot.gripper_hold

    def _apply_action(self) -> None:
        self.arm_robot.set_joint_position_target_index(target=self.joint_goal)

    def _get_dones(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.outcome = self.task.finish_step(self.reading(), self.joint_angles())
        self.starts = self.outcome.start
        # Ours, not Isaac Lab's compute_final_obs: that would observe twice per step.
        self.extras["final_obs"] = self._groups(self.outcome.final_obs)
        self.extras["window_error"] = self.outcome.window_error
        return self.outcome.terminated, self.outcome.truncated

    def _get_rewards(self) -> torch.Tensor:
        return self.outcome.reward

    def step(self, action: torch.Tensor):
        out = super().step(action)
        self.starts = None                               # a reset outside a step draws afresh
        return out

    def _get_observations(self) -> dict:
        return self._groups(self.task.observe(self.reading()))

    def _groups(self, x: torch.Tensor) -> dict:
        """Isaac Lab's observation groups of the task's network input: "policy" what the
        policy observes; "critic" (an asymmetric actor-critic) that and the drawn physics."""
        if not self.cfg.state_space:
            return {"policy": x}
        return {"policy": x[:, :self.cfg.observation_space], "critic": x}

    # ------------------------------------------------------------ reset
    def _reset_idx(self, env_ids: Sequence[int] | torch.Tensor | None):
        if env_ids is None:
            env_ids = torch.arange(self.num_envs, device=self.device)
        env_ids = torch.as_tensor(env_ids, device=self.device, dtype=torch.long)
        super()._reset_idx(env_ids)
        mask = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        mask[env_ids] = True
        start = self.starts if self.starts is not None else self.task.draw_episodes(mask)
        drawn, s = {k: v[env_ids] for k, v in start.physics.items()}, self.servos
        for name in s.PHYSICS:
            getattr(s, name)[env_ids] = drawn[name]
        self.arm_robot.write_joint_armature_to_sim_index(armature=drawn["armature"], env_ids=env_ids)
        mass_scale = drawn["mass_scale"]                  # link mass and inertia, as soarm/dynamics.py scales them
        self.arm_robot.set_masses_index(masses=self.nominal_mass[env_ids] * mass_scale, body_ids=self.bodies,
                                        env_ids=env_ids)
        self.arm_robot.set_inertias_index(inertias=self.nominal_inertia[env_ids] * mass_scale[..., None],
                                          body_ids=self.bodies, env_ids=env_ids)
        q = start.joint_angles[env_ids]
        self.arm_robot.write_joint_position_to_sim_index(position=q, env_ids=env_ids)
        self.arm_robot.write_joint_velocity_to_sim_index(velocity=torch.zeros_like(q), env_ids=env_ids)
        s.restart(env_ids, q)
        self.joint_goal[env_ids] = s.measured(q, env_ids)
        self.task.reset(mask, self.reading(), start)
