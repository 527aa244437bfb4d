"""A policy named on the command line, ready for `soarm evaluate`: the scripted controller,
an exported ONNX file (run by the robot's own runtime) or a training checkpoint.

The export stage is where all three meet: it reads checkpoints (training) and owns the
runtime that runs ONNX files, so the choice lives here rather than in the CLI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from soarm import CONFIG_DIR, config
from soarm.reach import ReachCfg

DEFAULT_TASK = CONFIG_DIR / "task" / "reach.yaml"


@dataclass
class NamedPolicy:
    act: Callable[[torch.Tensor], torch.Tensor]     # observations -> actions (deterministic)
    task: ReachCfg                                  # the task it is evaluated on
    name: str                                       # for progress lines and reports


def load(spec: str | Path, task: str | Path | None = None) -> NamedPolicy:
    """'scripted', a .onnx file or a checkpoint (a run directory or .pt file). `task`: the
    task config to evaluate on; by default the checkpoint's own, or configs/task/reach.yaml.
    An ONNX file's contract decides how its actions drive the arm (scale, clip, rate)."""
    if str(spec) == "scripted":
        from soarm.export.runtime import ScriptedRuntime

        cfg = config.load(ReachCfg, task or DEFAULT_TASK)
        return NamedPolicy(ScriptedRuntime(cfg), cfg, "the scripted controller")
    if str(spec).endswith(".onnx"):
        from soarm.export.runtime import PolicyRuntime

        rt = PolicyRuntime(spec)
        cfg = dataclasses.replace(config.load(ReachCfg, task or DEFAULT_TASK), action=rt.bounds,
                                  control_hz=rt.control_hz)
        return NamedPolicy(rt, cfg, f"{spec} (onnxruntime)")
    from soarm.training import checkpoint

    state = checkpoint.load(spec)
    cfg = config.load(ReachCfg, task) if task else checkpoint.task_cfg(state)
    return NamedPolicy(checkpoint.build_model(state).act_deterministic, cfg,
                       f"{state['path']} (iteration {state['iteration']})")
