"""Networks of the PPO agent: observation normalizer, Gaussian actor, critic.

Log-probability, entropy and KL of the diagonal Gaussian are written out by hand: the
std does not depend on the state, so these are a few fused element-wise ops instead of
a `torch.distributions` object built (and validated) on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from soarm.training import fused_mlp

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class PolicyCfg:
    actor_hidden: tuple[int, ...] = (128, 128)
    critic_hidden: tuple[int, ...] = (128, 128)
    activation: str = "elu"
    init_std: float = 0.5

    def validate(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"policy.activation: '{self.activation}' is not one of {sorted(ACTIVATIONS)}")
        if not self.init_std > 0:
            raise ValueError("policy.init_std: must be positive")


ACTIVATIONS = {"elu": nn.ELU, "relu": nn.ReLU, "tanh": nn.Tanh}

def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag(exp(log_std))^2), summed over the last dim."""
    z = (x - mean) * torch.exp(-log_std)
    return (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1)


def gaussian_entropy(log_std: torch.Tensor) -> torch.Tensor:
    return (0.5 + LOG_SQRT_2PI + log_std).sum(-1)


def gaussian_kl(mean_old, log_std_old, mean_new, log_std_new) -> torch.Tensor:
    """KL(old || new) per sample, summed over the action dims."""
    var_old, var_new = torch.exp(2 * log_std_old), torch.exp(2 * log_std_new)
    return (log_std_new - log_std_old + (var_old + (mean_old - mean_new).square()) / (2 * var_new) - 0.5).sum(-1)


class Normalizer(nn.Module):
    """Running mean and variance of the observations (Chan et al. parallel merge).

    `forward` normalizes with the current statistics; `update` merges a batch in. The
    trainer freezes the statistics during a rollout and its update, and merges the
    rollout in afterwards, so the stored log-probs stay exact. The statistics are
    buffers: they travel with the state dict and into the exported ONNX graph. `eps` is
    rsl_rl's: a feature that never varied is scaled by 100, not by a million.
    """

    def __init__(self, dim: int, eps: float = 1e-2):
        super().__init__()
        self.eps = eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n], n <= dim: normalized by the first n features' statistics."""
        n = x.shape[-1]
        return (x - self.mean[:n]) / (self.var[:n].sqrt() + self.eps)

    def leading(self, dim: int) -> Normalizer:
        """The statistics of the first `dim` features alone (the policy's part of the input)."""
        if dim == len(self.mean):
            return self
        out = Normalizer(dim, self.eps).to(self.mean.device)
        for name in ("mean", "var"):
            getattr(out, name).copy_(getattr(self, name)[:dim])
        out.count.copy_(self.count)
        return out

    @torch.no_grad()
    def update(self, x: torch.Tensor, group=None, moments=None) -> None:
        """Merge the rows of x [..., dim]; with a process group, the rows of every rank.
        `moments` computes `batch_moments` (the trainer passes a compiled one)."""
        var, mean = (moments or batch_moments)(x)
        n = torch.tensor(float(x.numel() // x.shape[-1]), dtype=torch.float64, device=x.device)
        mean, m2 = mean.double(), var.double() * n
        if group is not None:
            sums = torch.cat((n[None], mean * n))
            torch.distributed.all_reduce(sums, group=group)
            overall = sums[1:] / sums[0]
            m2 = m2 + n * (mean - overall).square()
            torch.distributed.all_reduce(m2, group=group)
            n, mean = sums[0], overall
        count = self.count
        total = count + n
        delta = mean - self.mean.double()
        m2_all = self.var.double() * count + m2 + delta.square() * (count * n / total)
        self.mean.copy_(self.mean.double() + delta * (n / total))
        self.var.copy_(m2_all / total)
        self.count.copy_(total)


def batch_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(variance, mean) of each feature over the rows of x [..., dim]."""
    return torch.var_mean(x.reshape(-1, x.shape[-1]), dim=0, correction=0)


# Orthogonal init of the hidden layers at the scale of PyTorch's default Linear init (weights
# of std 1/sqrt(3 fan_in)), the scale rsl_rl's and Isaac Lab's networks start from. CleanRL's
# sqrt 2 (He's gain for ReLU) learned the reach worse at equal env steps: 3.63 mm mean over
# seeds 0-5 at 150 iterations against 2.88 with this gain (benchmarks/ppo_vs_rsl_rl.py --learn),
# and seed 3 stalled on a plateau with it.
HIDDEN_GAIN = 1 / math.sqrt(3)


def mlp(sizes: list[int], activation: str, out_gain: float) -> nn.Sequential:
    """Orthogonal init (`HIDDEN_GAIN` in the hidden layers, `out_gain` at the output), zero biases."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(lin.weight, out_gain if last else HIDDEN_GAIN)
        nn.init.zeros_(lin.bias)
        layers.append(lin)
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs behind one observation normalizer.

    The input is the policy's observation [.., obs_dim], then `privileged_dim` features only
    the critic reads (an asymmetric actor-critic: the drawn physics, soarm.reach.PRIVILEGED_TERMS)."""

    def __init__(self, obs_dim: int, action_dim: int, cfg: PolicyCfg, privileged_dim: int = 0):
        super().__init__()
        self.obs_dim, self.action_dim = obs_dim, action_dim
        self.input_dim = obs_dim + privileged_dim
        self.normalizer = Normalizer(self.input_dim)
        self.actor = mlp([obs_dim, *cfg.actor_hidden, action_dim], cfg.activation, 0.01)
        self.critic = mlp([self.input_dim, *cfg.critic_hidden, 1], cfg.activation, 1.0)
        self.log_std = nn.Parameter(torch.full((action_dim,), math.log(cfg.init_std)))

    def actor_parameters(self) -> list[nn.Parameter]:
        return [*self.actor.parameters(), self.log_std]

    def forward(self, obs: torch.Tensor, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(action mean [B, A], value [B]) of raw observations, as training runs them
        (`fused_mlp`); with `bf16` the hidden layers run in bfloat16."""
        x = self.normalizer(obs)
        return (fused_mlp.forward(self.actor, x[..., :self.obs_dim], bf16),
                fused_mlp.forward(self.critic, x, bf16).squeeze(-1))

    def value(self, obs: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        return fused_mlp.forward(self.critic, self.normalizer(obs), bf16).squeeze(-1)

    def act_deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The deployed policy: the mean action, of the policy's observation [.., obs_dim]."""
        return self.actor(self.normalizer(obs))

    def policy_normalizer(self) -> Normalizer:
        """The normalizer of the policy's observation alone, as exported."""
        return self.normalizer.leading(self.obs_dim)
