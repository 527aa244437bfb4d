"""Training checkpoints: written atomically, read with a one-line error for anything unusable.

A checkpoint is a plain dict of tensors and built-in types (loaded with
`weights_only=True`, so opening one never runs code):
    format, iteration, model, optimizer, lr, cfg (the training config), task (the task
    config), rng, env (the full environment state), counters.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from soarm import config
from soarm.reach import ACTION_DIM, ReachCfg, obs_dim, privileged_dim
from soarm.training.modules import ActorCritic, PolicyCfg
from soarm.files import atomic_write

# Raised whenever what a checkpoint holds changes meaning (2: the task's `action` section and
# `substeps`; strict simulator and task state).
FORMAT = "soarm-ppo/2"
_NAME = re.compile(r"model_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


def save(state: dict, path: str | Path) -> None:
    """Atomic: a crash never leaves half a checkpoint."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or the newest `model_N.pt` of a run directory."""
    path = Path(path)
    if path.is_dir():
        found = sorted((int(m.group(1)), p) for p in path.glob("model_*.pt") if (m := _NAME.search(p.name)))
        if not found:
            raise CheckpointError(f"{path}: no model_N.pt checkpoint in this run directory")
        return found[-1][1]
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    return path


def load(path: str | Path, device: str | torch.device = "cpu") -> dict:
    path = resolve(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated, not a torch file, foreign pickle...
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({msg})") from None
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if isinstance(found, str) and found.startswith("soarm-ppo/") and found != FORMAT:
        raise CheckpointError(f"{path}: a checkpoint of an older version of soarm ({found}, this one reads {FORMAT}); "
                              "train it again with `soarm train`")
    if found != FORMAT:
        raise CheckpointError(f"{path}: not a soarm PPO checkpoint (format {found!r}, expected {FORMAT!r})")
    missing = {"iteration", "model", "cfg", "task"} - set(state)
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(sorted(missing))}")
    state["path"] = str(path)
    return state


def task_cfg(state: dict) -> ReachCfg:
    return config.from_dict(ReachCfg, state["task"], f"{state['path']} (task)")


def build_model(state: dict, device: str | torch.device = "cpu") -> ActorCritic:
    """The trained actor-critic, normalizer included, in eval mode."""
    policy_cfg = config.from_dict(PolicyCfg, state["cfg"]["policy"], f"{state['path']} (policy)")
    task = task_cfg(state)
    model = ActorCritic(obs_dim(task.obs_history, task.fine_error), ACTION_DIM, policy_cfg, privileged_dim(task)).to(device)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{state['path']}: weights do not fit the network ({str(e).splitlines()[0]})") from None
    return model.eval()
