"""Deterministic evaluation of a reach policy on fresh targets in the embedded simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from soarm.reach import ReachCfg
from soarm.training.env import ReachEnv
from soarm.files import atomic_write

Policy = Callable[[torch.Tensor], torch.Tensor]


def evaluate(policy: Policy, cfg: ReachCfg, targets: int = 256, num_envs: int = 64, seed: int = 1234,
             progress: bool = True, device: str | torch.device = "cpu", fixed: torch.Tensor | None = None) -> dict:
    """Fingertip error at the end of each target window, over `targets` windows; `fixed`
    [K, 3]: these targets in order (with num_envs=1, one arm reaching for them in turn)."""
    env = ReachEnv(cfg, num_envs, seed=seed, device=device, targets=fixed)
    obs = env.reset()
    errors: list[float] = []
    steps = math.ceil(targets / num_envs) * env.window + env.window
    with torch.inference_mode():
        for _ in tqdm(range(steps), desc="evaluate", disable=not progress, leave=False):
            obs, _, _, _, info = env.step(policy(obs[:, :env.num_obs]))    # the policy's part alone
            e = info["window_error"]
            errors.extend(e[torch.isfinite(e)].tolist())
            if len(errors) >= targets:
                break
    err = np.array(errors[:targets])
    return {
        "targets": int(len(err)),
        "mean_error_m": float(err.mean()),
        "median_error_m": float(np.median(err)),
        "p95_error_m": float(np.percentile(err, 95)),
        "success_1cm": float((err < 0.01).mean()),
        "success_5mm": float((err < 0.005).mean()),
    }


def write_report(result: dict, path: str | Path) -> None:
    """Atomic JSON write: a reader never sees half a report."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))


def summary(result: dict) -> str:
    return (f"{result['targets']} targets: mean {result['mean_error_m'] * 1000:.1f} mm, "
            f"median {result['median_error_m'] * 1000:.1f} mm, p95 {result['p95_error_m'] * 1000:.1f} mm, "
            f"success@1cm {result['success_1cm'] * 100:.1f} %, success@5mm {result['success_5mm'] * 100:.1f} %")
