"""The embedded reach environment: `ArmSim` physics + the reach task, batched, auto-resetting.

API (what PPO needs, rsl_rl/Isaac Lab style, tensors on the env's device):
    obs = env.reset()
    obs, reward, terminated, truncated, info = env.step(actions)
info["final_obs"] holds the observation each environment ended in (valid where it ended;
PPO bootstraps time-outs from it); info["window_error"] the fingertip error (m) where a
target window ended this step, NaN elsewhere. Episode statistics accumulate on the device without
host syncs; `env.pop_stats()` returns their means once per iteration.
"""

from __future__ import annotations

import math

import torch

from soarm import CONFIG_DIR, config
from soarm.description import RobotDescription, load_robot
from soarm.identified import task_centre
from soarm.reach import (ACTION_DIM, OBS_DIM, ReachCfg, action_to_goal, check_action, delay_goals, deviation_weights,
                         draw_latency, draw_physics, draw_targets, max_latency, full_pose, limit_clearance, observe, rewards,
                         sample_targets, task_state, terminations, uniform)
from soarm.servo import ServoConfig
from soarm.sim import ArmSim
from soarm.training.episode_stats import EpisodeStats


class ReachEnv:
    # Everything that evolves while the env runs, for checkpoints (besides sim and generator).
    _STATE = ("target", "action", "goal", "goal_line", "delay", "prev_meas", "step_count", "obs")

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
        servo_cfg = config.load(ServoConfig, CONFIG_DIR / cfg.servo)
        servo, registers = servo_cfg.params, servo_cfg.registers
        rand = cfg.randomization
        self.centre = task_centre(cfg.arm, cfg.servo, self.robot, self.device)
        play = math.radians(rand.backlash_deg[1]) + (0.0 if self.centre is None else float(self.centre.backlash.max()))
        self.sim = ArmSim(self.robot, servo, registers, num_envs, dt=1.0 / (cfg.control_hz * cfg.substeps),
                          device=device, backlash=play,
                          pd_drives=rand.pd_share > 0, carries_payload=rand.payload_kg[1] > 0)
        self.dyn = self.sim.dyn
        self.gen = torch.Generator().manual_seed(seed)
        self.num_obs, self.num_actions = OBS_DIM, ACTION_DIM
        self.max_steps, self.window = cfg.episode_steps, cfg.window_steps
        self.arm = torch.tensor(self.robot.arm_index, device=self.device)
        self.home = torch.as_tensor(self.robot.home, device=self.device, dtype=torch.float32)
        self.deviation = deviation_weights(self.robot, cfg.reward, self.device)
        self.target_pool = sample_targets(self.dyn, cfg.command, max(65536, 4 * num_envs), self.gen)
        self.fixed_targets = None if targets is None else torch.as_tensor(targets, dtype=torch.float32,
                                                                          device=self.device)
        self.drawn = 0
        N = num_envs
        self.target, self.action, self.goal, self.goal_line, self.delay, self.prev_meas = task_state(
            N, ACTION_DIM, max_latency(rand, self.centre), self.device)
        self.step_count = torch.zeros(N, dtype=torch.long, device=self.device)
        self.episodes = EpisodeStats(N, self.device)
        self.obs = self.reset()

    # ------------------------------------------------------------------ reset
    def reset(self) -> torch.Tensor:
        self.drawn = 0                                   # given targets start over from the first
        self._reset(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        self.obs = self._observe()
        return self.obs

    def stagger(self, quantum: int) -> None:
        """Spread episode starts over the episode length in steps of `quantum` (the rollout
        length), so time-outs do not all land in the same iteration."""
        slots = max(1, self.max_steps // quantum)
        k = torch.randint(0, slots, (self.num_envs,), generator=self.gen)
        self.step_count = (k * quantum).to(self.device)

    def _reset(self, mask: torch.Tensor) -> None:
        n, cfg = self.num_envs, self.cfg.randomization
        J, dev, dt = self.sim.J, self.device, torch.float32
        ph, servo = self.sim.physics, self.sim.servo
        m = mask[:, None]
        for name, value in draw_physics(self.gen, cfg, servo, n, J, dev, dt, self.centre).items():
            setattr(ph, name, torch.where(m, value, getattr(ph, name)))
        self.delay = torch.where(mask, draw_latency(self.gen, cfg, n, dev, self.centre), self.delay)
        noise = (-cfg.start_noise, cfg.start_noise)
        arm_q = self.home + uniform(self.gen, (n, len(self.home)), noise, dev, dt)
        self.sim.reset(mask, full_pose(self.dyn, arm_q))
        self.target = torch.where(m[:, :1].expand(n, 3), self._draw_targets(mask), self.target)
        self.action = torch.where(mask[:, None], 0.0, self.action)
        meas = self.sim.measured()[:, self.arm]
        self.goal = torch.where(mask[:, None], meas, self.goal)          # torque on: goal := present
        self.goal_line = torch.where(mask[:, None, None], meas[:, None], self.goal_line)
        self.prev_meas = torch.where(mask[:, None], meas, self.prev_meas)
        self.step_count = torch.where(mask, 0, self.step_count)
        self.episodes.reset(mask)

    def _draw_targets(self, mask: torch.Tensor) -> torch.Tensor:
        """New targets [N, 3], used where `mask`. Given targets are handed out in order, one
        per window that ends, to the environments that need one (in env order)."""
        if self.fixed_targets is not None:
            rank = torch.cumsum(mask.long(), 0) - 1
            idx = (self.drawn + rank.clamp(min=0)) % len(self.fixed_targets)
            self.drawn += int(mask.sum())
            return self.fixed_targets[idx]
        return draw_targets(self.target_pool, self.num_envs, self.gen)

    def _observe(self, meas: torch.Tensor | None = None) -> torch.Tensor:
        meas = self.sim.measured()[:, self.arm] if meas is None else meas
        return observe(self.dyn, meas, self.prev_meas, self.goal, self.target, self.action, self.cfg.control_hz)

    # ------------------------------------------------------------------- step
    def step(self, actions: torch.Tensor):
        if self.check_actions:
            check_action(actions)
        cfg = self.cfg
        self.goal = action_to_goal(self.dyn, actions, self.goal, self.prev_meas, cfg.action_scale, cfg.action_clip,
                                   cfg.max_relative_target)
        applied, self.goal_line = delay_goals(self.goal_line, self.goal, self.delay)
        goal = self.sim.goal.clone()
        goal[:, self.arm] = applied
        self.sim.step(goal, cfg.substeps)

        meas = self.sim.measured()[:, self.arm]
        vel = (meas - self.prev_meas) * cfg.control_hz
        tip = self.dyn.fingertip(full_pose(self.dyn, self.sim.q[:, self.arm]))   # the true fingertip
        error = self.target - tip
        terminated, below = terminations(cfg.reward, tip, self.sim.q)
        terms = rewards(cfg.reward, error=error, action=actions, last_action=self.action, joint_pos=meas - self.home,
                        joint_vel=vel, clearance=limit_clearance(self.robot, meas), deviation=self.deviation,
                        below_floor=below)
        reward = torch.stack(list(terms.values())).sum(0)
        self.action = actions
        final_obs = self._observe(meas)
        self.step_count += 1

        truncated = (self.step_count >= self.max_steps) & ~terminated
        done = terminated | truncated
        window_end = (self.step_count % self.window == 0) | done
        self.episodes.record(terms, reward, error.norm(dim=-1), window_end, done, terminated, truncated,
                             self.step_count)

        # New targets where a window ended, fresh episodes where one ended; then observe
        # again. _reset set prev_meas to the reset pose where an episode restarted, so the
        # velocity is this step's everywhere else and zero there.
        new_window = window_end & ~done
        self.target = torch.where(new_window[:, None], self._draw_targets(new_window), self.target)
        self._reset(done)
        now = self.sim.measured()[:, self.arm]
        self.obs = self._observe(now)
        self.prev_meas = now
        window_error = torch.where(window_end, error.norm(dim=-1), torch.nan)
        return self.obs, reward, terminated, truncated, {"final_obs": final_obs, "window_error": window_error}

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The complete running state: restoring it continues the very same episodes."""
        return {"gen": self.gen.get_state(), "sim": self.sim.state_dict(), "episodes": self.episodes.state_dict(),
                **{k: getattr(self, k) for k in self._STATE}}

    def load_state_dict(self, state: dict) -> None:
        if state["target"].shape[0] != self.num_envs:
            raise ValueError(f"env state holds {state['target'].shape[0]} environments, this env has {self.num_envs}")
        self.gen.set_state(state["gen"])
        self.sim.load_state_dict(state["sim"])
        self.episodes.load_state_dict(state["episodes"])
        for k in self._STATE:
            setattr(self, k, state[k].to(self.device))

    def pop_stats(self) -> dict[str, float]:
        return self.episodes.pop()
