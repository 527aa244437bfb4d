"""Our training config as rsl_rl 5.5's OnPolicyRunner config: matched settings, defined once.

Used by the side-by-side benchmark (benchmarks/ppo_vs_rsl_rl.py) and by the Isaac Lab
task's rsl_rl agent config (training/isaac/agents.py), so `isaaclab train --task
SO-ARM101-Reach` trains with the settings `soarm train` uses.
"""

from __future__ import annotations

from soarm.training.runner import TrainCfg


def rsl_rl_train_cfg(cfg: TrainCfg, mixed_precision: bool = False, privileged: bool = False) -> dict:
    """`privileged`: the env's observations hold a "critic" group (the task's critic_physics).
    A setting of ours that rsl_rl has no equivalent for is refused, not dropped."""
    p, pol = cfg.ppo, cfg.policy
    for name in ("early_stop_kl", "final_std"):
        if getattr(p, name):
            raise ValueError(f"ppo.{name}: rsl_rl (and so Isaac Lab's runner) has no such setting; leave it at 0")
    model = {"class_name": "MLPModel", "activation": pol.activation, "obs_normalization": True}
    return {
        "num_steps_per_env": p.num_steps, "max_iterations": cfg.run.iterations, "save_interval": cfg.run.save_every,
        "obs_groups": {"actor": ["policy"], "critic": ["critic" if privileged else "policy"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": p.epochs, "num_mini_batches": p.minibatches,
                      "clip_param": p.clip, "gamma": p.gamma, "lam": p.lam, "value_loss_coef": p.value_coef,
                      "entropy_coef": p.entropy_coef, "learning_rate": p.learning_rate,
                      "max_grad_norm": p.max_grad_norm, "use_clipped_value_loss": p.value_clip > 0,
                      "schedule": p.schedule, "desired_kl": p.desired_kl, "use_mixed_precision": mixed_precision},
        "actor": {**model, "hidden_dims": list(pol.actor_hidden),
                  "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": pol.init_std,
                                       "std_type": "scalar"}},
        "critic": {**model, "hidden_dims": list(pol.critic_hidden)},
    }
