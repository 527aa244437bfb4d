"""The embedded reach environment: `ArmSim` physics under the reach task, batched, auto-resetting.

API (what PPO needs, rsl_rl/Isaac Lab style, tensors on the env's device):
    obs = env.reset()
    obs, reward, terminated, truncated, info = env.step(actions)
obs [N, num_obs + num_privileged]: the policy's observation, then what only the critic sees
(ReachCfg.critic_physics; num_privileged = 0 without it).
info["final_obs"] holds the observation each environment ended in (valid where it ended;
PPO bootstraps time-outs from it); info["window_error"] the fingertip error (m) where a
target window ended this step, NaN elsewhere. Episode statistics accumulate on the device without
host syncs; `env.pop_stats()` returns their means once per iteration.

The task (soarm/reach_task.py) owns every rule; this class owns the physics only.
"""

from __future__ import annotations

import torch

from soarm.description import RobotDescription, load_robot
from soarm.reach import ACTION_DIM, ReachCfg, check_action, obs_dim, privileged_dim
from soarm.reach_task import EpisodeStart, ReachTask
from soarm.sim import ArmSim


class ReachEnv:
    def __init__(self, cfg: ReachCfg, num_envs: int, device: str = "cpu", seed: int = 0,
                 robot: RobotDescription | None = None, check_actions: bool = True,
                 targets: torch.Tensor | None = None):
        """`check_actions=False` skips the NaN check on every step (a host sync); the
        trainer checks its parameters and losses once per iteration instead, and a
        non-finite state still terminates the episode. `targets` [K, 3]: draw these in
        order instead of random ones (evaluation on given targets)."""
        self.cfg, self.num_envs, self.check_actions = cfg, num_envs, check_actions
        self.device = torch.device(device)
        self.robot = robot or load_robot()
        self.task = ReachTask(cfg, self.robot, num_envs, self.device, seed, targets)
        servo, rand = self.task.servo, cfg.randomization
        self.sim = ArmSim(self.robot, servo.params, servo.registers, num_envs,
                          dt=cfg.physics_dt, device=device, backlash=self.task.max_backlash,
                          pd_drives=rand.pd_share > 0, carries_payload=rand.payload_kg[1] > 0)
        self.dyn = self.sim.dyn
        self.num_obs, self.num_actions = obs_dim(cfg.obs_history, cfg.fine_error), ACTION_DIM
        self.num_privileged = privileged_dim(cfg)
        self.window = cfg.window_steps
        self.arm = self.task.arm
        self.obs = self.reset()

    def joint_angles(self) -> torch.Tensor:
        """The true joint angles [N, J] (rad)."""
        return self.sim.q

    def reading(self) -> torch.Tensor:
        """What the arm joints' encoders read now [N, A] (rad)."""
        return self.sim.measured()[:, self.arm]

    def reset(self) -> torch.Tensor:
        self.task.restart_targets()
        every = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        self._restart(every, self.task.draw_episodes(every))
        self.obs = self.task.observe(self.reading())
        return self.obs

    def stagger(self, quantum: int) -> None:
        self.task.stagger(quantum)

    def step(self, actions: torch.Tensor):
        if self.check_actions:
            check_action(actions)
        goal = self.sim.goal.clone()
        goal[:, self.arm] = self.task.act(actions)
        self.sim.step(goal, self.cfg.substeps)
        out = self.task.finish_step(self.reading(), self.joint_angles())
        self._restart(out.done, out.start)
        self.obs = self.task.observe(self.reading())
        return self.obs, out.reward, out.terminated, out.truncated, {"final_obs": out.final_obs,
                                                                      "window_error": out.window_error}

    def _restart(self, mask: torch.Tensor, start: EpisodeStart) -> None:
        """New episodes where `mask`: the drawn physics, the arm placed at its start pose."""
        ph = self.sim.physics
        for name, value in start.physics.items():
            setattr(ph, name, torch.where(mask[:, None], value, getattr(ph, name)))
        self.sim.reset(mask, start.joint_angles)
        self.task.reset(mask, self.reading(), start)

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The complete running state: restoring it continues the very same episodes."""
        return {"task": self.task.state_dict(), "sim": self.sim.state_dict(), "obs": self.obs}

    def load_state_dict(self, state: dict) -> None:
        self.task.load_state_dict(state["task"])
        self.sim.load_state_dict(state["sim"])
        self.obs = state["obs"].to(self.device)

    def pop_stats(self) -> dict[str, float]:
        return self.task.episodes.pop()

