"""PPO for batched environments: act, record, compute returns, update.

Written so that nothing in the rollout or the minibatch loop waits for the device: the
learning rate is a device tensor adapted from the KL on the device, statistics
accumulate as tensors, and the caller reads them once per iteration. One host sync per
iteration remains in `compute_returns` (picking the time-outs to bootstrap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pathlib import Path

import torch
from torch import nn

from soarm.training.modules import ActorCritic, batch_moments, gaussian_entropy, gaussian_kl, gaussian_log_prob
from soarm.training.storage import RolloutStorage, gae

SCHEDULES = ("adaptive", "linear", "fixed")
PRECISIONS = ("auto", "bf16", "fp32")
STAT_NAMES = ("surrogate_loss", "value_loss", "entropy", "kl", "clip_fraction")


@dataclass
class PPOCfg:
    num_steps: int = 24                  # rollout length per environment
    epochs: int = 5
    minibatches: int = 4
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    value_clip: float = 0.2              # 0 turns value clipping off
    value_coef: float = 1.0
    entropy_coef: float = 0.001
    learning_rate: float = 1e-3
    schedule: str = "adaptive"           # adaptive (rsl_rl's KL rule) | linear (to 0) | fixed
    desired_kl: float = 0.01
    lr_bounds: tuple[float, float] = (1e-5, 1e-2)
    max_grad_norm: float = 1.0           # per network (actor incl. std, critic)
    early_stop_kl: float = 0.0           # > 0: stop the epochs once the mean KL exceeds it
    # > 0: the action std may not exceed a ceiling that falls log-linearly from the policy's
    # init_std to this at the last iteration, so that the last updates see the policy nearly
    # as it is deployed (deterministic) instead of under its exploration noise.
    final_std: float = 0.0
    precision: str = "auto"              # bf16 | fp32 | auto (bf16 where the device does it natively)

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ppo.schedule: '{self.schedule}' is not one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ppo.precision: '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        if self.num_steps < 1 or self.epochs < 1 or self.minibatches < 1:
            raise ValueError("ppo.num_steps/epochs/minibatches: must be at least 1")
        if not (0 < self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("ppo.gamma/lam: must lie in (0, 1] and [0, 1]")
        if not 0 < self.lr_bounds[0] <= self.learning_rate <= self.lr_bounds[1]:
            raise ValueError("ppo.learning_rate: must lie inside lr_bounds")
        if not self.final_std >= 0:
            raise ValueError("ppo.final_std: must not be negative (0: no ceiling)")


def use_bf16(precision: str, device: torch.device) -> bool:
    """bf16 matmuls in the hidden layers (fp32 weights, output layers, optimizer and
    losses), in the rollout and the update.
    `auto` takes them where the hardware runs them natively: CUDA with bf16, or a CPU with
    AVX512-BF16/AMX, where they are about 4x faster than fp32. oneDNN also reports bf16 on
    plain AVX-512, where it emulates it at half fp32's speed, so the CPU's own flags decide."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_cpu_bf16()


def native_cpu_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:                       # not Linux: trust oneDNN
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def minibatch_chunks(rows: int, device: torch.device, cpu_rows: int = 8192) -> int:
    """How many equal chunks a minibatch's gradient is accumulated over. On a CPU, chunks
    of at most `cpu_rows` keep a chunk's activations in cache: 1.4x faster updates at
    24576-row minibatches on a 2-core CPU, for the same gradient. A GPU wants the whole."""
    if device.type != "cpu":
        return 1
    fewest = -(-rows // cpu_rows)
    return next((c for c in range(fewest, 4 * fewest + 1) if rows % c == 0), 1)


def compile_or_eager(fn, name: str, enabled: bool):
    """torch.compile(fn), or fn itself where compiling is off or unavailable."""
    if not enabled:
        return fn
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as e:  # noqa: BLE001 - no backend here: run eagerly
        print(f"torch.compile unavailable for {name} ({type(e).__name__}); running eagerly")
        return fn


class PPO:
    def __init__(self, model: ActorCritic, cfg: PPOCfg, num_envs: int, device: torch.device,
                 compile: bool = True, group=None):
        self.model, self.cfg, self.device, self.group = model, cfg, device, group
        self.bf16 = use_bf16(cfg.precision, device)
        self.world = torch.distributed.get_world_size(group) if group is not None else 1
        self.storage = RolloutStorage(cfg.num_steps, num_envs, model.input_dim, model.action_dim, device)
        self.lr = torch.tensor(cfg.learning_rate, device=device)
        # Fused Adam takes the learning rate as a device tensor, so adapting it never syncs.
        self.optimizer = torch.optim.Adam(model.parameters(), lr=self.lr, fused=True)
        self.actor_params = model.actor_parameters()
        self.critic_params = list(model.critic.parameters())
        self.old_log_std = model.log_std.detach().clone()
        batch = cfg.num_steps * num_envs
        if batch % cfg.minibatches:
            raise ValueError(f"ppo.minibatches: {cfg.minibatches} does not divide the batch of {batch} samples")
        self.minibatch = batch // cfg.minibatches
        self.chunks = minibatch_chunks(self.minibatch, device)
        self._act = compile_or_eager(self._act_eager, "action selection", compile)
        self._loss = compile_or_eager(self._loss_eager, "the PPO loss", compile)
        self._gae = compile_or_eager(gae, "GAE", compile)
        self._moments = compile_or_eager(batch_moments, "the normalizer statistics", compile)
        if compile:
            self._warm_up()

    # ---------------------------------------------------------------- rollout
    def begin_rollout(self) -> None:
        self.old_log_std = self.model.log_std.detach().clone()

    @torch.no_grad()
    def act(self, t: int, obs: torch.Tensor) -> torch.Tensor:
        """Sample actions for step t and record what the update needs."""
        noise = torch.randn(obs.shape[0], self.model.action_dim, device=obs.device)
        action, mean, value, log_prob = self._act(obs, noise)
        s = self.storage
        s.obs[t] = obs
        s.actions[t] = action
        s.means[t] = mean
        s.values[t] = value
        s.log_probs[t] = log_prob
        return action

    def _act_eager(self, obs, noise):
        # Same precision as the update, so the first minibatch sees ratio 1 there too.
        mean, value = self.model(obs, self.bf16)
        log_std = self.model.log_std
        action = mean + torch.exp(log_std) * noise
        log_prob = (-0.5 * noise.square() - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return action, mean, value, log_prob

    def record(self, t: int, reward, terminated, truncated, final_obs) -> None:
        s = self.storage
        s.rewards[t] = reward
        s.dones[t] = (terminated | truncated).float()
        s.truncated[t] = truncated
        s.final_obs[t] = final_obs

    @torch.no_grad()
    def compute_returns(self, last_obs: torch.Tensor) -> None:
        """Bootstrap time-outs with the value of the observation they ended in, then GAE."""
        s, cfg = self.storage, self.cfg
        ended = s.truncated.view(-1).nonzero().squeeze(-1)      # the one host sync per iteration
        if ended.numel():
            v = self.model.value(s.flat("final_obs")[ended], self.bf16)
            s.rewards.view(-1).index_add_(0, ended, cfg.gamma * v)
        last_value = self.model.value(last_obs, self.bf16)
        adv, ret = self._gae(s.rewards, s.values, s.dones, last_value, cfg.gamma, cfg.lam)
        s.returns.copy_(ret)
        s.advantages.copy_((adv - adv.mean()) / (adv.std() + 1e-8))

    # ----------------------------------------------------------------- update
    def _loss_eager(self, idx, samples, old_log_std):
        cfg = self.cfg
        f = self.storage.fields(samples[idx])       # one gather of whole sample rows
        mean, value = self.model(f["obs"], self.bf16)
        log_std = self.model.log_std
        log_prob = gaussian_log_prob(f["actions"], mean, log_std)
        ratio = torch.exp(log_prob - f["log_probs"])
        a = f["advantages"]
        surrogate = -torch.min(ratio * a, torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * a).mean()
        r, v_old = f["returns"], f["values"]
        value_loss = (value - r).square()
        if cfg.value_clip > 0:
            clipped = v_old + torch.clamp(value - v_old, -cfg.value_clip, cfg.value_clip)
            value_loss = torch.max(value_loss, (clipped - r).square())
        value_loss = value_loss.mean()
        entropy = gaussian_entropy(log_std)
        loss = surrogate + cfg.value_coef * value_loss - cfg.entropy_coef * entropy
        with torch.no_grad():
            kl = gaussian_kl(f["means"], old_log_std, mean, log_std).mean()
            clip_fraction = ((ratio - 1).abs() > cfg.clip).float().mean()
            stats = torch.stack((surrogate, value_loss, entropy, kl, clip_fraction))
        return loss, stats

    def _loss_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `_loss` reads besides the minibatch's indices: the sample rows [T * N, width]
        and the std the rollout sampled with."""
        s = self.storage
        return s.samples.view(s.T * s.N, -1), self.old_log_std

    def update(self) -> dict[str, torch.Tensor]:
        """Epochs of minibatch SGD over the rollout; returns mean statistics as device tensors."""
        s, cfg = self.storage, self.cfg
        args = self._loss_args()
        total = torch.zeros(len(STAT_NAMES), device=self.device)
        n = 0
        B = s.T * s.N
        for _ in range(cfg.epochs):
            perm = torch.randperm(B, device=self.device)
            epoch_kl = torch.zeros((), device=self.device)
            for k in range(cfg.minibatches):
                stats = self._step(perm[k * self.minibatch:(k + 1) * self.minibatch], args)
                total += stats
                epoch_kl += stats[3]
                n += 1
            # Optional approximate-KL early stop: one host read per epoch, only when enabled.
            if cfg.early_stop_kl > 0 and float(epoch_kl) / cfg.minibatches > cfg.early_stop_kl:
                break
        out = dict(zip(STAT_NAMES, total / n))
        v, r = s.values, s.returns
        out["explained_variance"] = 1 - (r - v).var() / (r.var() + 1e-8)
        out["learning_rate"] = self.lr.clone()
        out["action_std"] = self.model.log_std.detach().exp().mean()
        return out

    def _step(self, idx: torch.Tensor, args: tuple) -> torch.Tensor:
        """One optimizer step on a minibatch. Its gradient is accumulated over equal chunks
        (`self.chunks`): the same mean gradient, with activations that stay in cache."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=False)
        stats = torch.zeros(len(STAT_NAMES), device=self.device)
        for chunk in idx.view(self.chunks, -1):
            loss, chunk_stats = self._loss(chunk, *args)
            (loss / self.chunks).backward()
            stats += chunk_stats
        stats /= self.chunks
        if self.group is not None:
            torch.distributed.all_reduce(stats, group=self.group)     # the KL the rate adapts to, too
            stats /= self.world
        if cfg.schedule == "adaptive":
            self._adapt_lr(stats[3])
        self._reduce_gradients()
        nn.utils.clip_grad_norm_(self.actor_params, cfg.max_grad_norm)
        nn.utils.clip_grad_norm_(self.critic_params, cfg.max_grad_norm)
        self.optimizer.step()
        return stats

    def _adapt_lr(self, kl: torch.Tensor) -> None:
        """rsl_rl's rule, on the device: KL above 2x target -> lr / 1.5, below half -> lr * 1.5."""
        cfg = self.cfg
        lo, hi = cfg.lr_bounds
        lr = self.lr
        new = torch.where(kl > 2 * cfg.desired_kl, torch.clamp(lr / 1.5, min=lo),
                          torch.where((kl < cfg.desired_kl / 2) & (kl > 0), torch.clamp(lr * 1.5, max=hi), lr))
        lr.copy_(new)

    def update_normalizer(self) -> None:
        """Merge the rollout's observations into the normalizer, after the update that
        used the frozen statistics."""
        self.model.normalizer.update(self.storage.obs, self.group, self._moments)

    def cap_std(self, progress: float, init_std: float) -> None:
        """Before a rollout: clamp the action std to cfg.final_std's ceiling at `progress` in
        (0, 1] (the last rollout samples with final_std at most)."""
        if self.cfg.final_std > 0:
            ceiling = (1 - progress) * math.log(init_std) + progress * math.log(self.cfg.final_std)
            with torch.no_grad():
                self.model.log_std.clamp_(max=ceiling)

    def set_linear_lr(self, progress: float) -> None:
        """Linear annealing towards zero, progress in [0, 1)."""
        self.lr.fill_(max(self.cfg.learning_rate * (1 - progress), self.cfg.lr_bounds[0]))

    def _reduce_gradients(self) -> None:
        if self.group is None:
            return
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=self.group)
        flat /= self.world
        for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(new)

    def _warm_up(self) -> None:
        """Compile now, on the empty buffers, so a backend failure shows at start-up and
        falls back to eager instead of failing mid-run."""
        try:
            s = self.storage
            with torch.no_grad():       # as in the rollout: grad mode is part of the compiled guard
                obs = torch.zeros(s.N, self.model.input_dim, device=self.device)
                self._act(obs, torch.zeros(s.N, self.model.action_dim, device=self.device))
                self._gae(s.rewards, s.values, s.dones, torch.zeros_like(s.rewards[0]), self.cfg.gamma, self.cfg.lam)
                self._moments(s.obs)
            idx = torch.arange(self.minibatch // self.chunks, device=self.device)
            loss, _ = self._loss(idx, *self._loss_args())
            loss.backward()
        except Exception as e:  # noqa: BLE001 - a compiler/toolchain failure: run eagerly
            print(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); running eagerly")
            self._act, self._loss, self._gae, self._moments = self._act_eager, self._loss_eager, gae, batch_moments
        self.optimizer.zero_grad(set_to_none=False)
