"""Train: the embedded reach environment, PPO and its runner, evaluation, servo identification."""
