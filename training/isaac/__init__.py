"""The Isaac Lab backend (Isaac Lab 3, Python 3.12, its own venv): the SO-ARM101 reach task
as a DirectRLEnv on Newton, with our servo model as the actuator.

Importing this package registers the task with gymnasium; Isaac Lab's CLI imports it
through the `isaaclab.tasks` entry point in pyproject.toml:

    isaaclab train --task SO-ARM101-Reach ...         # Isaac Lab's own runners
    soarm train --sim isaaclab --device cuda          # our PPO
"""

import gymnasium as gym

TASK_ID = "SO-ARM101-Reach"

gym.register(
    id=TASK_ID,
    entry_point=f"{__name__}.reach_env:SO101ReachEnv",
    disable_env_checker=True,
    kwargs={"env_cfg_entry_point": f"{__name__}.reach_env_cfg:SO101ReachEnvCfg",
            "rsl_rl_cfg_entry_point": f"{__name__}.agents:SO101ReachPPORunnerCfg",
            "default_agent": "rsl_rl"},
)
