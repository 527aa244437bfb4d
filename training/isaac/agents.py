"""rsl_rl agent config for Isaac Lab's own CLI (`isaaclab train --task SO-ARM101-Reach
--rl_library rsl_rl`): the settings of configs/train/reach.yaml, mapped once by
training/rsl_rl_cfg.py."""

from __future__ import annotations

from isaaclab.utils import configclass
from isaaclab_rl.rsl_rl import RslRlMLPModelCfg, RslRlOnPolicyRunnerCfg, RslRlPpoAlgorithmCfg

from soarm import CONFIG_DIR, config
from soarm.reach import ReachCfg
from soarm.training.rsl_rl_cfg import rsl_rl_train_cfg
from soarm.training.runner import TrainCfg


def _model(d: dict) -> RslRlMLPModelCfg:
    dist = d.get("distribution_cfg")
    return RslRlMLPModelCfg(
        hidden_dims=d["hidden_dims"], activation=d["activation"], obs_normalization=d["obs_normalization"],
        distribution_cfg=None if dist is None else RslRlMLPModelCfg.GaussianDistributionCfg(
            init_std=dist["init_std"], std_type=dist["std_type"]))


@configclass
class SO101ReachPPORunnerCfg(RslRlOnPolicyRunnerCfg):
    experiment_name: str = "so101_reach"
    # Placeholders: __post_init__ takes them from configs/train/reach.yaml.
    num_steps_per_env: int = 0
    max_iterations: int = 0
    empirical_normalization: bool = False        # the models normalize (obs_normalization)
    obs_groups: dict = {}

    def __post_init__(self):
        train = config.load(TrainCfg, CONFIG_DIR / "train" / "reach.yaml")
        task = config.load(ReachCfg, CONFIG_DIR / train.task)
        d = rsl_rl_train_cfg(train, privileged=task.critic_physics)
        self.num_steps_per_env, self.max_iterations = d["num_steps_per_env"], d["max_iterations"]
        self.save_interval, self.obs_groups = d["save_interval"], d["obs_groups"]
        self.actor, self.critic = _model(d["actor"]), _model(d["critic"])
        self.algorithm = RslRlPpoAlgorithmCfg(**{k: v for k, v in d["algorithm"].items() if k != "class_name"})
