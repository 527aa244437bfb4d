"""SO101ReachEnv behind the interface our trainer drives (that of training/env.py's
ReachEnv), so `soarm train --sim isaaclab` runs our PPO on Isaac Lab unchanged."""

from __future__ import annotations

import torch

from soarm.reach import privileged_dim
from soarm.training.isaac.reach_env import SO101ReachEnv
from soarm.training.isaac.reach_env_cfg import SO101ReachEnvCfg


class IsaacReachEnv:
    def __init__(self, task_file: str, num_envs: int, device: str = "cuda:0", seed: int = 0):
        device = "cuda:0" if str(device) == "cuda" else str(device)          # Isaac Lab names the GPU
        cfg = SO101ReachEnvCfg(task_file=str(task_file), device=device)
        cfg.scene.num_envs, cfg.seed = num_envs, seed
        self.env = SO101ReachEnv(cfg)
        self.num_envs, self.device = num_envs, self.env.device
        self.num_obs, self.num_actions = cfg.observation_space, cfg.action_space
        self.num_privileged = privileged_dim(self.env.task.cfg)
        self.obs = network_input(self.env.reset()[0])

    def step(self, actions: torch.Tensor):
        obs, reward, terminated, truncated, extras = self.env.step(actions)
        self.obs = network_input(obs)
        return self.obs, reward, terminated, truncated, {"final_obs": network_input(extras["final_obs"]),
                                                          "window_error": extras["window_error"]}

    def stagger(self, quantum: int) -> None:
        self.env.task.stagger(quantum)

    def pop_stats(self) -> dict[str, float]:
        return self.env.task.episodes.pop()

    def state_dict(self) -> dict:
        # Newton's state is not captured: a resumed Isaac Lab run starts fresh episodes
        # (weights, optimizer, normalizer and counters still continue).
        return {"backend": "isaaclab", "num_envs": self.num_envs}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_envs") != self.num_envs:
            raise ValueError(f"checkpoint has {state.get('num_envs')} environments, this run {self.num_envs}")


def network_input(groups: dict) -> torch.Tensor:
    """What our networks read (training/env.py): the critic's group where the env has one,
    as it holds the policy's observation first."""
    return groups.get("critic", groups["policy"])
