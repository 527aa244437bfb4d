"""Train: the embedded batched simulator, the reach environment and (soon) PPO."""
