"""The deployment contract: what a policy file promises about its inputs and outputs.

Built here from the task config and the robot description (the same objects training
used), written into the ONNX metadata by the exporter (`build`), and read back by the
runtime before it runs a file (`Contract.load`, which runs every check). The math itself
(observation, action -> goal) lives in soarm/reach.py; this module only describes it, so a
robot can tell whether it builds the same thing.

Versioned: `SCHEMA` changes whenever a field's meaning changes; a runtime refuses a file
of another schema.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from soarm.description import RobotDescription
from soarm.reach import ACTION_DIM, ActionBounds, CommandCfg, ReachCfg, obs_dim, obs_terms
from soarm.servo import TICK, TICKS_PER_REV

SCHEMA = 2
METADATA_KEY = "soarm.contract"          # ONNX metadata_props key holding the JSON below
ACTION_TYPE = "relative_joint_position"
# The joint angles a policy reads and commands: radians from the middle of each joint's
# calibrated range (LeRobot's degrees convention; the published so101_new_calib model's zero).
# calibration/calibration.py implements it on the arm.
JOINT_ZERO = "middle_of_calibrated_range"
# What `observe` and the exporter implement, word for word: a file that says anything else was
# built by code that computes its observation or normalization otherwise.
VELOCITY_ESTIMATE = ("(q_t - q_{t-1}) * control_hz from consecutive encoder readings, rad/s; "
                     "zero on the first tick")
NORMALIZATION = "in graph: (obs - mean) / (sqrt(var) + eps)"


class ContractError(ValueError):
    """A policy whose contract this code does not implement; one line naming the field."""


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def build(task: ReachCfg, robot: RobotDescription, training: dict) -> dict:
    idx = robot.arm_index
    return {
        "schema": SCHEMA,
        "task": "reach",
        "observation": [{"name": n, "size": k, "unit": u}
                        for n, k, u in obs_terms(task.obs_history, task.fine_error)],
        "obs_dim": obs_dim(task.obs_history, task.fine_error),
        "fine_error": task.fine_error,                  # m: target_error_fine = tanh(target_error / this)
        "joint_names": list(robot.arm_joints),
        "action": {
            "type": ACTION_TYPE,
            "dim": ACTION_DIM,
            "scale": task.action.scale,                 # rad per control step at action 1
            "clip": task.action.clip,                   # |action| clipped before scaling
            "offset": "previous_goal",                  # goal_t = goal_{t-1} + scale * clip(a)
            # rad: goal_t kept within this of the observed angles; None: unbounded
            "max_relative_target": task.action.max_relative_target,
            # rad: goal_t kept this far inside the joint limits
            "goal_margin": task.action.goal_margin,
            "default_joint_positions": [float(x) for x in robot.home],
        },
        "joint_limits": {"lower": [float(robot.lower[i]) for i in idx],
                         "upper": [float(robot.upper[i]) for i in idx]},
        "gripper": {"joint": robot.gripper_joint, "hold": float(robot.gripper_hold)},
        "control_hz": task.control_hz,
        # Where targets were drawn in training: the robot rejects targets outside it.
        "workspace": {"frame": robot.base_link, "radius": list(task.command.radius),
                      "height": list(task.command.height), "max_bearing": task.command.max_bearing},
        "encoder": {"ticks_per_rev": TICKS_PER_REV, "rad_per_tick": TICK, "joint_zero": JOINT_ZERO},
        "robot_description": {"geometry_hash": robot.geometry_hash()},
        "velocity_estimate": VELOCITY_ESTIMATE,
        "latency": {"ticks": list(task.randomization.latency_ticks),
                    "note": "trained with each goal reaching the servos this many control ticks late, "
                            "drawn uniformly per episode"},
        "normalization": NORMALIZATION,
        "training": training,
    }


@dataclass(frozen=True)
class Contract:
    """A policy file's contract as this code reads it; `load` runs every check."""
    terms: dict                        # the JSON as written in the file
    obs_dim: int
    history: int                       # past control ticks observed (ReachCfg.obs_history)
    fine_error: float                  # m, ReachCfg.fine_error (0: target_error_fine not observed)
    joint_names: tuple[str, ...]       # the arm joints, in action order
    gripper_joint: str
    action: ActionBounds
    control_hz: float
    workspace: CommandCfg              # where training drew its targets (radius, height, bearing)
    frame: str                         # the frame targets are given in

    @classmethod
    def load(cls, terms: dict, robot: RobotDescription, where: str) -> Contract:
        """ContractError (one line naming the field) unless this code builds exactly the
        observation and action the contract describes, for this robot."""
        _check(terms, robot, where)
        action, ws = terms["action"], terms["workspace"]
        return cls(terms, terms["obs_dim"], history(terms), fine_error(terms), tuple(terms["joint_names"]),
                   terms["gripper"]["joint"],
                   ActionBounds(action["scale"], action["clip"], action["max_relative_target"], action["goal_margin"]),
                   float(terms["control_hz"]),
                   CommandCfg(radius=tuple(ws["radius"]), height=tuple(ws["height"]), max_bearing=ws["max_bearing"]),
                   ws["frame"])

    def hash(self) -> str:
        return config_hash(self.terms)


def _check(contract: dict, robot: RobotDescription, where: str) -> None:
    """Raise ContractError unless this code builds exactly the observation and action the
    contract describes, for this robot."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ContractError(f"{where}: unsupported policy contract: {what}")

    need(isinstance(contract, dict), "not a JSON object")
    need(contract.get("schema") == SCHEMA, f"schema {contract.get('schema')!r}, this runtime reads schema {SCHEMA}")
    need(contract.get("task") == "reach", f"task {contract.get('task')!r}, expected 'reach'")
    terms = [(t.get("name"), t.get("size")) for t in contract.get("observation", []) if isinstance(t, dict)]
    fine = contract.get("fine_error", 0.0)         # files from before it: not observed
    need(isinstance(fine, (int, float)) and 0 <= fine <= 1, f"fine_error {fine!r}: a number of m in 0..1")
    ours = [(n, k) for n, k, _ in obs_terms(history(contract), fine)]
    need(terms == ours, f"observation terms {terms} differ from this runtime's {ours}")
    need(contract.get("obs_dim") == sum(k for _, k in ours), f"obs_dim {contract.get('obs_dim')!r}, "
         f"expected {sum(k for _, k in ours)}")
    action = contract.get("action", {})
    need(action.get("type") == ACTION_TYPE, f"action type {action.get('type')!r}, expected {ACTION_TYPE!r}")
    need(action.get("dim") == ACTION_DIM, f"action dim {action.get('dim')!r}, expected {ACTION_DIM}")
    for key in ("scale", "clip"):
        need(isinstance(action.get(key), (int, float)) and action[key] > 0, f"action {key} missing or not positive")
    for key in ("max_relative_target", "goal_margin"):
        need(key in action, f"action {key} missing: a file from before this format; export it again with "
                            "`soarm export RUN_DIR`")
    lead = action["max_relative_target"]
    need(lead is None or (isinstance(lead, (int, float)) and lead > 0),
         f"action max_relative_target {lead!r}: a positive number of rad or null")
    margin = action["goal_margin"]
    need(isinstance(margin, (int, float)) and 0 <= margin <= 0.5,
         f"action goal_margin {margin!r}: a number of rad in 0..0.5")
    need(contract.get("joint_names") == list(robot.arm_joints),
         f"joints {contract.get('joint_names')} differ from the robot's {list(robot.arm_joints)}")
    limits = contract.get("joint_limits", {})
    idx = robot.arm_index
    for side, ours in (("lower", robot.lower[idx]), ("upper", robot.upper[idx])):
        theirs = limits.get(side)
        need(_close(theirs, ours),
             f"joint_limits.{side} {theirs} differ from the robot description's {list(map(float, ours))}")
    hz = contract.get("control_hz")
    need(isinstance(hz, (int, float)) and 1 <= hz <= 1000, f"control_hz {hz!r}")
    ws = contract.get("workspace", {})
    need(isinstance(ws, dict) and ws.get("frame") == robot.base_link
         and all(isinstance(ws.get(k), list) and len(ws[k]) == 2 for k in ("radius", "height"))
         and isinstance(ws.get("max_bearing"), (int, float)),
         f"workspace {ws!r} (needs frame '{robot.base_link}', radius, height, max_bearing)")
    home = action.get("default_joint_positions")
    need(_close(home, robot.home),
         f"action.default_joint_positions {home} differ from the robot description's home "
         f"{list(map(float, robot.home))}")
    grip = contract.get("gripper", {})
    need(isinstance(grip, dict) and grip.get("joint") == robot.gripper_joint
         and _close([grip.get("hold")], [robot.gripper_hold]),
         f"gripper {grip!r} differs from the robot description's ({robot.gripper_joint!r} held at "
         f"{robot.gripper_hold})")
    enc = contract.get("encoder", {})
    need(enc.get("ticks_per_rev") == TICKS_PER_REV, f"encoder ticks_per_rev {enc.get('ticks_per_rev')!r}")
    need(_close([enc.get("rad_per_tick")], [TICK], 1e-12),
         f"encoder rad_per_tick {enc.get('rad_per_tick')!r}, expected {TICK}")
    need(enc.get("joint_zero") == JOINT_ZERO, f"encoder joint_zero {enc.get('joint_zero')!r}, expected {JOINT_ZERO!r}")
    for key, ours in (("velocity_estimate", VELOCITY_ESTIMATE), ("normalization", NORMALIZATION)):
        need(contract.get(key) == ours, f"{key} {contract.get(key)!r}, this runtime implements {ours!r}")
    ticks = contract.get("latency", {}).get("ticks") if isinstance(contract.get("latency"), dict) else None
    need(isinstance(ticks, list) and len(ticks) == 2 and all(isinstance(k, int) and k >= 0 for k in ticks)
         and ticks[0] <= ticks[1], f"latency.ticks {ticks!r}: [low, high] control ticks")
    geometry = contract.get("robot_description", {}).get("geometry_hash")
    need(geometry == robot.geometry_hash(),
         f"robot_description geometry_hash {geometry!r}: the policy was trained on another arm description "
         f"(this one: {robot.geometry_hash()})")


def history(contract: dict) -> int:
    """The past control ticks a policy observes (ReachCfg.obs_history), from its terms."""
    past = [t.get("size") for t in contract.get("observation", [])
            if isinstance(t, dict) and t.get("name") == "past_joint_pos"]
    return past[0] // ACTION_DIM if past and isinstance(past[0], int) else 0


def fine_error(contract: dict) -> float:
    """m: the scale of the observed target_error_fine (ReachCfg.fine_error); 0 where the file
    has none (written before the term existed)."""
    return float(contract.get("fine_error", 0.0))


def _close(theirs, ours, tol: float = 1e-6) -> bool:
    """theirs (from JSON) is a list of numbers equal to ours within tol."""
    return (isinstance(theirs, list) and len(theirs) == len(ours)
            and all(isinstance(a, (int, float)) and abs(a - b) < tol for a, b in zip(theirs, ours)))
