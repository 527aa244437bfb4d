"""PPO pieces that can be checked exactly: the Gaussian, GAE, the first minibatch, the normalizer."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from soarm.training.modules import (ActorCritic, Normalizer, PolicyCfg, gaussian_entropy, gaussian_kl,
                                    gaussian_log_prob)
from soarm.training.ppo import PPO, PPOCfg, minibatch_chunks
from soarm.training.storage import gae
from soarm.training.env import ReachEnv


def test_gaussian_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean, x = torch.randn(64, 5, generator=g), torch.randn(64, 5, generator=g)
    log_std = torch.randn(5, generator=g) * 0.5
    d = torch.distributions.Normal(mean, log_std.exp())
    assert torch.allclose(gaussian_log_prob(x, mean, log_std), d.log_prob(x).sum(-1), atol=1e-5)
    assert torch.allclose(gaussian_entropy(log_std), d.entropy()[0].sum(), atol=1e-6)
    mean2, log_std2 = mean + 0.1 * torch.randn(64, 5, generator=g), log_std + 0.2
    d2 = torch.distributions.Normal(mean2, log_std2.exp())
    ref = torch.distributions.kl_divergence(d, d2).sum(-1)
    assert torch.allclose(gaussian_kl(mean, log_std, mean2, log_std2), ref, atol=1e-5)


def _reference(model, obs):
    """The deployed networks, as plain nn.Sequential calls."""
    x = model.normalizer(obs)
    return model.actor(x), model.critic(x).squeeze(-1)


def _grads(model, mean, value):
    model.zero_grad()
    (mean.square().sum() + value.sum()).backward()
    return [p.grad.clone() for p in (*model.actor.parameters(), *model.critic.parameters())]


@pytest.mark.parametrize("activation", ["elu", "relu", "tanh"])
def test_training_forward_gradients_match_autograd(activation):
    """The training forward takes each activation's derivative from its output."""
    torch.manual_seed(0)
    model = ActorCritic(29, 5, PolicyCfg(activation=activation))
    obs = torch.randn(256, 29) * 2
    for got, ref in zip(_grads(model, *model(obs)), _grads(model, *_reference(model, obs))):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compiled_training_forward_is_the_deployed_network():
    """Under torch.compile the training forward takes another form (fused bias adds, the
    output layer as dot products); it must stay the function that is exported."""
    torch.manual_seed(0)
    model = ActorCritic(29, 5, PolicyCfg())
    model.normalizer.update(torch.randn(256, 29) * 3 + 1)
    obs = torch.randn(512, 29) * 3 + 1
    compiled = torch.compile(model)
    ref_mean, ref_value = _reference(model, obs)
    mean, value = compiled(obs)
    torch.testing.assert_close(mean, ref_mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(value, ref_value, atol=1e-5, rtol=1e-4)
    for got, ref in zip(_grads(model, mean, value), _grads(model, ref_mean, ref_value)):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # bf16 hidden layers: close to the fp32 network, to bf16's resolution.
    with torch.no_grad():
        mean16, value16 = compiled(obs, bf16=True)
    torch.testing.assert_close(mean16, ref_mean.detach(), atol=2e-3, rtol=0.05)
    torch.testing.assert_close(value16, ref_value.detach(), atol=0.05, rtol=0.05)


def test_a_privileged_critic_reads_the_physics_and_the_actor_does_not():
    """With privileged features after the policy's observation: the mean action and the
    exported normalizer see the policy's columns only; the value reads all of them."""
    torch.manual_seed(0)
    model = ActorCritic(29, 5, PolicyCfg(), privileged_dim=7)
    model.normalizer.update(torch.randn(256, 36) * 3 + 1)
    obs = torch.randn(64, 36) * 3 + 1
    other = obs.clone()
    other[:, 29:] += 5.0
    with torch.no_grad():
        (mean, value), (mean_b, value_b) = model(obs), model(other)
        assert torch.equal(mean, mean_b) and (value - value_b).abs().min() > 0
        torch.testing.assert_close(model.act_deterministic(obs[:, :29]), mean)
        deployed = model.policy_normalizer()
        assert deployed.mean.shape == (29,) and torch.equal(deployed.var, model.normalizer.var[:29])
        torch.testing.assert_close(model.actor(deployed(obs[:, :29])), mean)


def slow_gae(rewards, values, dones, last_value, gamma, lam):
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            next_v = last_value[n] if t == T - 1 else values[t + 1, n]
            nonterminal = 1.0 - dones[t, n]
            delta = rewards[t, n] + gamma * next_v * nonterminal - values[t, n]
            running = delta + gamma * lam * nonterminal * running
            adv[t, n] = running
    return adv, adv + values


def test_gae_matches_slow_reference():
    rng = np.random.default_rng(0)
    T, N = 17, 9
    r, v = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    d = (rng.random((T, N)) < 0.15).astype(float)
    last = rng.normal(size=N)
    adv, ret = gae(*(torch.tensor(a) for a in (r, v, d, last)), 0.97, 0.9)
    ref_adv, ref_ret = slow_gae(r, v, d, last, 0.97, 0.9)
    np.testing.assert_allclose(adv.numpy(), ref_adv, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), ref_ret, atol=1e-12)


def test_normalizer_matches_numpy():
    rng = np.random.default_rng(1)
    norm = Normalizer(4)
    batches = [rng.normal(loc=[1, -2, 0, 5], scale=[0.1, 3, 1, 10], size=(n, 4)) for n in (7, 300, 1, 64)]
    for b in batches:
        norm.update(torch.tensor(b, dtype=torch.float32))
    allx = np.concatenate(batches)
    np.testing.assert_allclose(norm.mean.numpy(), allx.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.var.numpy(), allx.var(0), rtol=1e-5)
    assert float(norm.count) == len(allx)


def _rollout(task_cfg, N=32, T=8, mixed_precision=False):
    torch.manual_seed(0)
    env = ReachEnv(task_cfg, N, seed=0, check_actions=False)
    model = ActorCritic(env.num_obs, env.num_actions, PolicyCfg(actor_hidden=(32,), critic_hidden=(32,)),
                        env.num_privileged)
    model.normalizer.update(env.obs)          # non-trivial statistics, as after a first iteration
    cfg = PPOCfg(num_steps=T, minibatches=2, epochs=1, precision="bf16" if mixed_precision else "fp32")
    ppo = PPO(model, cfg, N, torch.device("cpu"), compile=False)
    ppo.begin_rollout()
    obs = env.obs
    with torch.no_grad():
        for t in range(T):
            obs, rew, term, trunc, info = env.step(ppo.act(t, obs))
            ppo.record(t, rew, term, trunc, info["final_obs"])
        ppo.compute_returns(obs)
    return ppo


@pytest.mark.parametrize("mixed_precision,critic_physics", [(False, False), (True, False), (False, True)])
def test_first_minibatch_has_ratio_one_and_zero_kl(task_cfg, mixed_precision, critic_physics):
    """Also in bf16: the rollout and the update run the network at the same precision; also
    with a critic that observes the physics."""
    ppo = _rollout(dataclasses.replace(task_cfg, critic_physics=critic_physics), mixed_precision=mixed_precision)
    s = ppo.storage
    with torch.no_grad():
        mean, value = ppo.model(s.flat("obs"), bf16=mixed_precision)
    log_prob = gaussian_log_prob(s.flat("actions"), mean, ppo.model.log_std).detach()
    torch.testing.assert_close(torch.exp(log_prob - s.flat("log_probs")), torch.ones_like(log_prob),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(value, s.flat("values"))
    idx = torch.arange(ppo.minibatch)
    _, stats = ppo._loss(idx, *ppo._loss_args())
    surrogate, value_loss, entropy, kl, clip_fraction = stats.tolist()
    assert abs(kl) < 1e-7 and clip_fraction == 0.0
    # With ratio 1 the clipped surrogate is minus the mean advantage of the minibatch.
    assert abs(surrogate + float(s.flat("advantages")[idx].mean())) < 1e-5


def test_chunked_minibatch_takes_the_same_step(task_cfg):
    """Accumulating a minibatch's gradient over chunks (done on CPUs, for the cache) is
    the same optimizer step as taking it whole."""
    whole, chunked = _rollout(task_cfg), _rollout(task_cfg)
    chunked.chunks = 4
    for ppo in (whole, chunked):
        ppo.cfg.max_grad_norm = 1e9          # compare the gradients themselves, unclipped
    s = whole.storage
    args = whole._loss_args()
    idx = torch.randperm(s.T * s.N, generator=torch.Generator().manual_seed(0))[:whole.minibatch]
    torch.testing.assert_close(chunked._step(idx, args), whole._step(idx, args))
    for a, b in zip(whole.model.parameters(), chunked.model.parameters()):
        # Chunks sum the rows in another order: fp32 round-off of a few 1e-6 of the gradient's
        # scale. A chunk lost or weighted wrong would be off by a sizeable part of it.
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5 * float(a.grad.abs().max()))
        torch.testing.assert_close(a, b)
    assert not torch.equal(whole.model.actor[0].weight, _rollout(task_cfg).model.actor[0].weight)
    assert minibatch_chunks(24576, torch.device("cpu")) == 3
    assert minibatch_chunks(128, torch.device("cpu")) == 1
    assert minibatch_chunks(8209, torch.device("cpu")) == 1       # a prime: no tiny chunks
    assert minibatch_chunks(24576, torch.device("cuda")) == 1


def test_update_changes_policy_and_adapts_lr(task_cfg):
    ppo = _rollout(task_cfg)
    before = [p.detach().clone() for p in ppo.model.parameters()]
    stats = ppo.update()
    assert all(torch.isfinite(v).all() for v in stats.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, ppo.model.parameters()))
    # The optimizer reads the very tensor the KL rule adapts.
    assert ppo.optimizer.param_groups[0]["lr"] is ppo.lr


def test_adaptive_lr_follows_rsl_rl_rule(task_cfg):
    ppo = _rollout(task_cfg)
    cfg = ppo.cfg
    for kl, factor in ((3 * cfg.desired_kl, 1 / 1.5), (0.1 * cfg.desired_kl, 1.5), (cfg.desired_kl, 1.0)):
        ppo.lr.fill_(1e-3)
        ppo._adapt_lr(torch.tensor(kl))
        assert abs(float(ppo.lr) - 1e-3 * factor) < 1e-9
    ppo.lr.fill_(cfg.lr_bounds[1])
    ppo._adapt_lr(torch.tensor(0.0))         # KL exactly 0 (no change yet): keep the rate
    assert abs(float(ppo.lr) - cfg.lr_bounds[1]) < 1e-9


def test_truncation_bootstraps_from_final_observation(task_cfg):
    """A time-out's reward gains gamma * V(the observation it ended in), nothing else does."""
    ppo = _rollout(task_cfg)
    s = ppo.storage
    rewards = s.rewards.clone()
    s.truncated.zero_()
    s.truncated[3, 5] = True
    s.final_obs[3, 5] = s.obs[0, 0]
    ppo.compute_returns(s.obs[-1])
    expected = rewards.clone()
    with torch.no_grad():
        expected[3, 5] += ppo.cfg.gamma * ppo.model.value(s.obs[0, :1], ppo.bf16)[0]
    torch.testing.assert_close(s.rewards, expected)


def test_final_std_caps_the_std_log_linearly_and_only_when_set(task_cfg):
    ppo = _rollout(task_cfg)
    init = float(ppo.model.log_std.exp().mean())
    ppo.cap_std(0.5, init)                          # off by default
    assert float(ppo.model.log_std.exp().max()) == pytest.approx(init)
    ppo.cfg = dataclasses.replace(ppo.cfg, final_std=0.05)
    ppo.cap_std(0.5, init)                          # halfway: the geometric mean of the two
    torch.testing.assert_close(ppo.model.log_std.exp(), torch.full_like(ppo.model.log_std, (init * 0.05) ** 0.5))
    ppo.cap_std(1.0, init)
    torch.testing.assert_close(ppo.model.log_std.exp(), torch.full_like(ppo.model.log_std, 0.05))
    ppo.model.log_std.data.fill_(math.log(0.01))    # a std below the ceiling is left alone
    ppo.cap_std(1.0, init)
    torch.testing.assert_close(ppo.model.log_std.exp(), torch.full_like(ppo.model.log_std, 0.01))
    with pytest.raises(ValueError, match="final_std"):
        dataclasses.replace(ppo.cfg, final_std=-1.0).validate()


def test_the_rsl_rl_config_refuses_what_rsl_rl_cannot_do():
    from soarm import CONFIG_DIR, config
    from soarm.training.rsl_rl_cfg import rsl_rl_train_cfg
    from soarm.training.runner import TrainCfg

    cfg = config.load(TrainCfg, CONFIG_DIR / "train" / "reach.yaml")
    assert rsl_rl_train_cfg(cfg)["algorithm"]["clip_param"] == cfg.ppo.clip
    with pytest.raises(ValueError, match="ppo.final_std"):
        rsl_rl_train_cfg(dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, final_std=0.05)))
