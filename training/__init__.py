"""Train: the embedded reach environment, PPO and its runner, evaluation, the Isaac Lab backend."""
