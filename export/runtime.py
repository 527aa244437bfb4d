"""The one policy runtime: an exported ONNX file, its contract checked, run by onnxruntime
(or the scripted controller under the task's contract, `ScriptedRuntime`, as a baseline).

Used by `soarm evaluate policy.onnx` in the embedded sim and by the robot. The observation
and the action -> goal mapping are soarm/reach.py's own functions, fed with the
contract's parameters, so there is no second copy of that math.

    rt = PolicyRuntime("policy.onnx")
    obs = rt.observe(q, q_prev, goal, target, last_action)     # encoder readings in rad
    action = rt.act(obs)                                        # raises on bad input
    goal = rt.next_goal(goal, action, q)                        # then the safety clamps

Anything wrong (missing, truncated or foreign file, no or unsupported contract, wrong
observation size, NaN) raises PolicyError with one line; no action comes out of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from soarm import contract
from soarm.description import RobotDescription, load_robot
from soarm.dynamics import ArmDynamics
from soarm.reach import OBS_SLICES, action_to_goal, in_region, observe


class PolicyError(ValueError):
    """A policy file or an input the runtime refuses; the message is one line."""


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


class PolicyRuntime:
    def __init__(self, path: str | Path, robot: RobotDescription | None = None, threads: int = 1):
        import onnx
        import onnxruntime as ort

        self.path = path = Path(path)
        if not path.is_file():
            raise PolicyError(f"{path}: no such policy file")
        data = path.read_bytes()
        try:
            model = onnx.load_model_from_string(data)
            onnx.checker.check_model(model)
        except Exception as e:  # noqa: BLE001 - truncated, not protobuf, invalid graph
            raise PolicyError(f"{path}: not a valid ONNX model ({_first_line(e)})") from None
        meta = {p.key: p.value for p in model.metadata_props}
        if contract.METADATA_KEY not in meta:
            raise PolicyError(f"{path}: no '{contract.METADATA_KEY}' metadata; export policies with `soarm export`")
        try:
            terms = json.loads(meta[contract.METADATA_KEY])
        except json.JSONDecodeError as e:
            raise PolicyError(f"{path}: contract metadata is not JSON ({e.msg})") from None
        self.robot = robot or load_robot()
        try:
            self.contract = contract.Contract.load(terms, self.robot, str(path))
        except contract.ContractError as e:
            raise PolicyError(str(e)) from None
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001
            raise PolicyError(f"{path}: onnxruntime cannot load it ({_first_line(e)})") from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        c = self.contract
        if [i.name for i in inputs] != ["obs"] or inputs[0].shape[-1] != c.obs_dim:
            raise PolicyError(f"{path}: graph input must be obs[batch, {c.obs_dim}], "
                              f"got {[(i.name, i.shape) for i in inputs]}")
        if [o.name for o in outputs] != ["actions"] or outputs[0].shape[-1] != len(c.joint_names):
            raise PolicyError(f"{path}: graph output must be actions[batch, {len(c.joint_names)}], "
                              f"got {[(o.name, o.shape) for o in outputs]}")
        self._adopt_contract()

    def _adopt_contract(self) -> None:
        c = self.contract
        self.obs_dim, self.action_dim, self.history = c.obs_dim, len(c.joint_names), c.history
        self.fine_error = c.fine_error
        self.control_hz, self.bounds, self.workspace, self.frame = c.control_hz, c.action, c.workspace, c.frame
        self.dyn = ArmDynamics(self.robot)

    def _infer(self, obs: np.ndarray) -> np.ndarray:
        return self.session.run(["actions"], {"obs": obs})[0]

    def check_target(self, target, frame: str | None = None) -> np.ndarray:
        """The target as float32[3] if the policy may be given it; else PolicyError (one line):
        another frame than the robot base, not finite, or outside the workspace it was
        trained on (the policy's behaviour there is unknown)."""
        if frame is not None and frame != self.frame:
            raise PolicyError(f"target in frame '{frame}', expected the robot base frame '{self.frame}'")
        t = np.asarray(target, dtype=np.float32).reshape(-1)
        if t.shape != (3,) or not np.isfinite(t).all():
            raise PolicyError(f"target {t.tolist()} is not a finite 3-D point")
        if not bool(in_region(torch.from_numpy(t)[None], self.workspace)[0]):
            ws = self.workspace
            raise PolicyError(f"target {[round(float(x), 3) for x in t]} m is outside the trained workspace "
                              f"(radius {list(ws.radius)} m, height {list(ws.height)} m, "
                              f"bearing <= {ws.max_bearing} rad)")
        return t

    # ------------------------------------------------------------ the contract
    def observe(self, q, q_prev, goal, target, last_action, past_q=None, past_goal=None) -> np.ndarray:
        """The observation [N, obs_dim] from arm encoder readings now and one tick ago (rad,
        action order; pass q as q_prev on the first tick), the goal commanded now, the
        target (m, base frame) and the previous action; for a policy with a history, the
        readings and goals of the last `history` observations [N, history, A] (newest first)."""
        t = [torch.as_tensor(np.atleast_2d(x), dtype=torch.float32) for x in (q, q_prev, goal, target, last_action)]
        n, a = t[0].shape
        past = [torch.zeros(n, 0, a) if p is None else torch.as_tensor(np.asarray(p, dtype=np.float32)).reshape(n, -1, a)
                for p in (past_q, past_goal)]
        if not past[0].shape[1] == past[1].shape[1] == self.history:
            raise PolicyError(f"{self.path}: the policy observes {self.history} past ticks, given "
                              f"{past[0].shape[1]} readings and {past[1].shape[1]} goals")
        return observe(self.dyn, *t[:3], t[3], t[4], self.control_hz, *past, self.fine_error).numpy()

    def act(self, obs) -> np.ndarray:
        """Actions [N, action_dim] for observations [N, obs_dim] (or one [obs_dim])."""
        obs = np.asarray(obs, dtype=np.float32)
        if obs.ndim == 1:
            obs = obs[None]
        if obs.ndim != 2 or obs.shape[1] != self.obs_dim:
            raise PolicyError(f"{self.path}: observation shape {tuple(obs.shape)}, the contract says "
                              f"[batch, {self.obs_dim}]")
        bad = ~np.isfinite(obs)
        if bad.any():
            raise PolicyError(f"{self.path}: observation contains NaN or inf in {', '.join(_terms(bad))}; "
                              "no action computed")
        out = self._infer(obs)
        if not np.isfinite(out).all():
            raise PolicyError(f"{self.path}: the policy produced a non-finite action; refusing to use it")
        return out

    def next_goal(self, goal, action, q) -> np.ndarray:
        """The next arm goal (rad) from the current one, an action and the arm readings (rad)
        its observation was made from, per the contract."""
        g, a, m = (torch.as_tensor(np.atleast_2d(x), dtype=torch.float32) for x in (goal, action, q))
        return action_to_goal(self.dyn, a, g, m, self.bounds).numpy()

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        """Torch in, torch out: lets `evaluate` run the shipped file in the embedded sim."""
        return torch.from_numpy(self.act(obs.detach().cpu().numpy())).to(obs.device)


class ScriptedRuntime(PolicyRuntime):
    """The scripted controller (training/scripted.py) behind the runtime's interface: the task's
    own contract, no ONNX file, so the robot's decision step and the transfer suite run it as
    they run a policy (`soarm transfer scripted`)."""

    def __init__(self, task, robot: RobotDescription | None = None):
        from soarm.training.scripted import ScriptedReach

        self.path = Path("scripted")
        self.robot = robot or load_robot()
        self.contract = contract.Contract.load(contract.build(task, self.robot, {"controller": "scripted"}),
                                               self.robot, "scripted")
        self._adopt_contract()
        self.controller = ScriptedReach(self.dyn, self.bounds)

    def _infer(self, obs: np.ndarray) -> np.ndarray:
        return self.controller(torch.from_numpy(obs)).numpy()


def _terms(bad: np.ndarray) -> list[str]:
    cols = bad.any(axis=0)
    return [name for name, cols_of in OBS_SLICES.items() if cols[cols_of].any()]
