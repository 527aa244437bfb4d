"""Entry point of the export stage: checkpoint -> one self-describing ONNX file.

    soarm export runs/reach/latest -o policy.onnx

The graph is the deterministic actor (the mean action) behind the observation normalizer,
whose statistics are initializers: `(obs - mean) / (sqrt(var) + eps)`, the very module
training used. One input `obs` [batch, obs_dim] (dynamic batch), one output `actions`;
weights inside the file. The deployment contract (soarm/contract.py) goes into
`metadata_props`. Before the file is written, torch and onnxruntime are compared on
recorded observations; the export fails above the tolerance.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from soarm import contract
from soarm.description import load_robot
from soarm.training import checkpoint
from soarm.training.env import ReachEnv
from soarm.files import atomic_write

OPSET = 18
TOLERANCE = 1e-5


class DeployedActor(nn.Module):
    """Normalizer + actor MLP: raw observation in, mean action out."""

    def __init__(self, normalizer: nn.Module, actor: nn.Module):
        super().__init__()
        self.normalizer, self.actor = normalizer, actor

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.normalizer(obs))


def recorded_observations(model, task, count: int, seed: int = 7) -> torch.Tensor:
    """`count` observations the policy itself meets in the embedded sim (its own closed loop,
    fresh targets), so parity is checked where the deployed policy operates."""
    envs = 256
    env = ReachEnv(task, envs, seed=seed)
    out, obs = [], env.reset()
    with torch.no_grad():
        while sum(len(o) for o in out) < count:
            out.append(obs[:, :model.obs_dim])                # the policy's part (not the critic's)
            obs, *_ = env.step(model.act_deterministic(out[-1]))
    return torch.cat(out)[:count]


def to_onnx(actor: DeployedActor, obs_dim: int) -> bytes:
    import onnx

    actor = actor.eval()
    batch = torch.export.Dim("batch", min=1)
    # The exporter chatters about optional torchvision ops and its own deprecations.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(actor, (torch.zeros(2, obs_dim),), dynamo=True, opset_version=OPSET,
                                    input_names=["obs"], output_names=["actions"],
                                    dynamic_shapes={"obs": {0: batch}}, external_data=False, verbose=False)
    model = program.model_proto
    onnx.checker.check_model(model)
    return model.SerializeToString()


def with_metadata(onnx_bytes: bytes, meta: dict) -> bytes:
    import onnx

    model = onnx.load_model_from_string(onnx_bytes)
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    model.producer_name = "soarm"
    return model.SerializeToString()


def parity(onnx_bytes: bytes, actor: DeployedActor, obs: torch.Tensor) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(onnx_bytes, opts, providers=["CPUExecutionProvider"])
    got = sess.run(["actions"], {"obs": obs.numpy().astype(np.float32)})[0]
    with torch.no_grad():
        want = actor(obs).numpy()
    return float(np.abs(got - want).max())


def export(source: str | Path, out: str | Path, verify_count: int = 10_000) -> dict:
    """Export the checkpoint (or a run's newest) to `out`; returns a summary dict."""
    state = checkpoint.load(source)
    task = checkpoint.task_cfg(state)
    model = checkpoint.build_model(state)
    robot = load_robot()
    actor = DeployedActor(model.policy_normalizer(), model.actor)
    training = {
        "checkpoint": Path(state["path"]).name,
        "iteration": state["iteration"],
        "env_steps": state.get("counters", {}).get("env_steps"),
        "commit": state.get("commit", "unknown"),
        "config_hash": contract.config_hash({"train": state["cfg"], "task": state["task"]}),
    }
    terms = contract.build(task, robot, training)
    raw = to_onnx(actor, model.obs_dim)
    obs = recorded_observations(model, task, verify_count)
    err = parity(raw, actor, obs)
    if not err < TOLERANCE:
        raise ValueError(f"export: torch vs onnxruntime differ by {err:.2e} > {TOLERANCE:.0e} "
                         f"on {len(obs)} observations; nothing written")
    data = with_metadata(raw, {contract.METADATA_KEY: json.dumps(terms), "soarm.schema": str(contract.SCHEMA)})
    out = atomic_write(out, lambda tmp: tmp.write_bytes(data))
    return {"path": str(out), "bytes": len(data), "parity_max_abs": err, "observations": len(obs),
            "checkpoint": state["path"], "iteration": state["iteration"]}
