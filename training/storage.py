"""Rollout buffer [T, N, ...], allocated once, and generalized advantage estimation."""

from __future__ import annotations

import torch


class RolloutStorage:
    """One rollout of T steps from N environments. Observations are stored raw (the
    normalizer is applied inside the networks), actions unclipped as sampled.

    What the update reads of a sample (observation, action, old mean, log-prob, value,
    advantage, return) lies in one row of `samples`, padded to whole 64-byte cache lines:
    a minibatch gathers each random row in 3 cache lines instead of 8 from separate
    buffers. The named fields are views into it."""

    def __init__(self, T: int, N: int, obs_dim: int, action_dim: int, device: torch.device):
        kw = dict(device=device, dtype=torch.float32)
        self.T, self.N = T, N
        # (name, width); width 0 is one scalar per sample.
        self.layout = (("obs", obs_dim), ("actions", action_dim), ("means", action_dim),   # means: for the KL
                       ("log_probs", 0), ("values", 0), ("advantages", 0), ("returns", 0))
        width = sum(max(w, 1) for _, w in self.layout)
        self.samples = torch.zeros(T, N, -(-width // 16) * 16, **kw)
        for name, view in self.fields(self.samples).items():
            setattr(self, name, view)
        self.rewards = torch.zeros(T, N, **kw)
        self.dones = torch.zeros(T, N, **kw)
        self.truncated = torch.zeros(T, N, dtype=torch.bool, device=device)
        self.final_obs = torch.zeros(T, N, obs_dim, **kw)     # where an episode ended

    def fields(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named fields of sample rows [..., row width], as views."""
        out, start = {}, 0
        for name, width in self.layout:
            out[name] = rows[..., start] if width == 0 else rows[..., start:start + width]
            start += max(width, 1)
        return out

    def flat(self, name: str) -> torch.Tensor:
        x = getattr(self, name)
        return x.reshape(self.T * self.N, *x.shape[2:])


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
