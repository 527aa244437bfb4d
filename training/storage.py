"""Rollout buffer [T, N, ...], allocated once, and generalized advantage estimation."""

from __future__ import annotations

import torch


class RolloutStorage:
    """One rollout of T steps from N environments. Observations are stored raw (the
    normalizer is applied inside the networks), actions unclipped as sampled."""

    def __init__(self, T: int, N: int, obs_dim: int, action_dim: int, device: torch.device):
        kw = dict(device=device, dtype=torch.float32)
        self.T, self.N = T, N
        self.obs = torch.zeros(T, N, obs_dim, **kw)
        self.actions = torch.zeros(T, N, action_dim, **kw)
        self.means = torch.zeros(T, N, action_dim, **kw)     # old policy mean, for the KL
        self.log_probs = torch.zeros(T, N, **kw)
        self.values = torch.zeros(T, N, **kw)
        self.rewards = torch.zeros(T, N, **kw)
        self.dones = torch.zeros(T, N, **kw)
        self.truncated = torch.zeros(T, N, dtype=torch.bool, device=device)
        self.final_obs = torch.zeros(T, N, obs_dim, **kw)     # where an episode ended
        self.advantages = torch.zeros(T, N, **kw)
        self.returns = torch.zeros(T, N, **kw)

    def flat(self, name: str) -> torch.Tensor:
        x = getattr(self, name)
        return x.view(self.T * self.N, *x.shape[2:])


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_value: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns [T, N]. `dones[t]` ends the episode after step t (terminated
    or truncated); truncated steps must already carry gamma * V(final observation) in
    their reward, so no value leaks across an episode boundary."""
    T = rewards.shape[0]
    adv = torch.empty_like(rewards)
    last = torch.zeros_like(last_value)
    next_value = last_value
    for t in range(T - 1, -1, -1):
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * live * next_value - values[t]
        last = delta + gamma * lam * live * last
        adv[t] = last
        next_value = values[t]
    return adv, adv + values
