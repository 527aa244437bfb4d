"""The SO-101 robot description: our URDF plus its YAML companion, parsed once.

Everything else (dynamics, task, exporter, robot layer) reads the arm from the
`RobotDescription` built here, never from a second copy of the numbers.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from soarm import CONFIG_DIR
from soarm.config import ConfigError

DEFAULT_ROBOT = CONFIG_DIR / "robot" / "so101.yaml"


@dataclass(frozen=True)
class Joint:
    name: str
    parent: int            # index of the joint whose child body carries this joint; -1 = base
    xyz: np.ndarray        # origin translation in the parent body frame
    rot: np.ndarray        # origin rotation (3x3) in the parent body frame
    lower: float
    upper: float
    # Inertial data of the child body, in its own frame.
    mass: float
    com: np.ndarray
    inertia: np.ndarray    # 3x3 about the centre of mass
    link: str              # the child body's name in the URDF


@dataclass(frozen=True)
class RobotDescription:
    joints: tuple[Joint, ...]          # all revolute joints, parents before children
    arm_joints: tuple[str, ...]        # the joints the policy drives, in action order
    gripper_joint: str
    gripper_hold: float
    fingertip_body: int                # joint index whose child body carries the fingertip
    fingertip_xyz: np.ndarray          # fingertip origin in that body's frame
    home: np.ndarray                   # default arm pose, arm_joints order
    park: np.ndarray                   # arm pose the robot moves to before torque goes off
    base_link: str                     # the URDF root link: the frame targets are given in
    urdf: str = ""                     # the URDF file it was read from

    @property
    def names(self) -> list[str]:
        return [j.name for j in self.joints]

    def index(self, name: str) -> int:
        return self.names.index(name)

    @property
    def arm_index(self) -> list[int]:
        return [self.index(n) for n in self.arm_joints]

    @property
    def home_pose(self) -> np.ndarray:
        """Every joint's angle at the home pose (rad), the gripper at its hold angle."""
        q = np.full(len(self.joints), float(self.gripper_hold))
        q[self.arm_index] = self.home
        return q

    @property
    def lower(self) -> np.ndarray:
        return np.array([j.lower for j in self.joints])

    @property
    def upper(self) -> np.ndarray:
        return np.array([j.upper for j in self.joints])

    def geometry_hash(self) -> str:
        """A hash of everything the policy's observation depends on: each joint's name,
        parent, origin and limits, the fingertip, the home pose and the gripper hold."""
        import hashlib
        import json

        r = lambda x: np.round(np.asarray(x, dtype=float), 9).tolist()   # noqa: E731
        data = {"joints": [[j.name, j.parent, r(j.xyz), r(j.rot), r(j.lower), r(j.upper)] for j in self.joints],
                "fingertip": [self.fingertip_body, r(self.fingertip_xyz)], "arm": list(self.arm_joints),
                "home": r(self.home), "gripper": [self.gripper_joint, r(self.gripper_hold)]}
        return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]


def rpy_matrix(r: float, p: float, y: float) -> np.ndarray:
    """URDF convention: fixed-axis roll about x, then pitch about y, then yaw about z."""
    cr, sr, cp, sp, cy, sy = math.cos(r), math.sin(r), math.cos(p), math.sin(p), math.cos(y), math.sin(y)
    rx = np.array([[1, 0, 0], [0, cr, -sr], [0, sr, cr]])
    ry = np.array([[cp, 0, sp], [0, 1, 0], [-sp, 0, cp]])
    rz = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    return rz @ ry @ rx


@lru_cache(maxsize=8)
def load_robot(path: str | Path = DEFAULT_ROBOT) -> RobotDescription:
    path = Path(path)
    try:
        meta = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    need = ["urdf", "arm_joints", "gripper_joint", "gripper_hold", "fingertip_link", "home", "park"]
    for key in need:
        if key not in meta:
            raise ConfigError(f"{path}: missing key '{key}'")
    unknown = sorted(set(meta) - set(need))
    if unknown:
        raise ConfigError(f"{path}: unknown key '{unknown[0]}'")
    urdf = path.parent / meta["urdf"]
    joints, fixed, base = _parse_urdf(urdf)

    names = [j.name for j in joints]
    for n in list(meta["arm_joints"]) + [meta["gripper_joint"]]:
        if n not in names:
            raise ConfigError(f"{path}: joint '{n}' is not a revolute joint of {urdf.name}")
    poses = {}
    for key in ("home", "park"):
        pose = np.asarray(meta[key], dtype=float)
        if pose.shape != (len(meta["arm_joints"]),):
            raise ConfigError(f"{path}: '{key}' must have one value per arm joint ({len(meta['arm_joints'])})")
        for n, q in zip(meta["arm_joints"], pose):
            j = joints[names.index(n)]
            if not j.lower <= q <= j.upper:
                raise ConfigError(f"{path}: '{key}' puts {n} at {q:+.3f} rad, outside its limits "
                                  f"{j.lower:+.3f}..{j.upper:+.3f}")
        poses[key] = pose
    tip = meta["fingertip_link"]
    if tip not in fixed:
        raise ConfigError(f"{path}: fingertip_link '{tip}' is not a fixed child link in {urdf.name}")
    body, xyz = fixed[tip]
    return RobotDescription(
        joints=tuple(joints),
        arm_joints=tuple(meta["arm_joints"]),
        gripper_joint=meta["gripper_joint"],
        gripper_hold=float(meta["gripper_hold"]),
        fingertip_body=names.index(body),
        fingertip_xyz=xyz,
        home=poses["home"],
        park=poses["park"],
        base_link=base,
        urdf=str(urdf),
    )


def _floats(elem: ET.Element | None, attr: str, n: int, where: str, default: str | None = None) -> np.ndarray:
    text = elem.get(attr, default) if elem is not None else default
    if text is None:
        raise ConfigError(f"{where}: missing attribute '{attr}'")
    try:
        values = [float(v) for v in text.split()]
    except ValueError:
        raise ConfigError(f"{where}: attribute '{attr}' is not numeric: {text!r}") from None
    if len(values) != n or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{where}: attribute '{attr}' needs {n} finite numbers, got {text!r}")
    return np.array(values)


def _parse_urdf(path: Path) -> tuple[list[Joint], dict[str, tuple[str, np.ndarray]], str]:
    """Revolute joints in tree order, and fixed child links as (owning joint, xyz)."""
    try:
        root = ET.parse(path).getroot()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except ET.ParseError as e:
        raise ConfigError(f"{path}: malformed URDF ({e})") from None

    inertials = {}
    for link in root.findall("link"):
        name = link.get("name")
        inertial = link.find("inertial")
        if inertial is None:
            continue
        where = f"{path.name}: link '{name}' inertial"
        origin = inertial.find("origin")
        com = _floats(origin, "xyz", 3, where + " origin", "0 0 0")
        if np.any(_floats(origin, "rpy", 3, where + " origin", "0 0 0") != 0):
            raise ConfigError(f"{where}: rotated inertial frames are not supported")
        mass = float(_floats(inertial.find("mass"), "value", 1, where + " mass")[0])
        if mass <= 0:
            raise ConfigError(f"{where}: mass must be positive, got {mass}")
        el = inertial.find("inertia")
        ixx, ixy, ixz, iyy, iyz, izz = (float(_floats(el, k, 1, where + " inertia")[0])
                                        for k in ("ixx", "ixy", "ixz", "iyy", "iyz", "izz"))
        inertia = np.array([[ixx, ixy, ixz], [ixy, iyy, iyz], [ixz, iyz, izz]])
        if np.any(np.linalg.eigvalsh(inertia) <= 0):
            raise ConfigError(f"{where}: inertia is not positive definite")
        inertials[name] = (mass, com, inertia)

    base_links = {link.get("name") for link in root.findall("link")}
    revolute, fixed_raw = [], []
    for j in root.findall("joint"):
        name, kind = j.get("name"), j.get("type")
        where = f"{path.name}: joint '{name}'"
        parent, child = j.find("parent"), j.find("child")
        if parent is None or child is None:
            raise ConfigError(f"{where}: needs <parent> and <child>")
        origin = j.find("origin")
        xyz = _floats(origin, "xyz", 3, where + " origin", "0 0 0")
        rot = rpy_matrix(*_floats(origin, "rpy", 3, where + " origin", "0 0 0"))
        if kind == "fixed":
            fixed_raw.append((child.get("link"), parent.get("link"), xyz))
            continue
        if kind != "revolute":
            raise ConfigError(f"{where}: type '{kind}' is not supported (revolute or fixed)")
        axis = _floats(j.find("axis"), "xyz", 3, where + " axis", "1 0 0")
        if not np.allclose(axis, [0, 0, 1]):
            raise ConfigError(f"{where}: axis must be '0 0 1' (child frame z), got {axis.tolist()}")
        lim = j.find("limit")
        lower = float(_floats(lim, "lower", 1, where + " limit")[0])
        upper = float(_floats(lim, "upper", 1, where + " limit")[0])
        if not lower < upper:
            raise ConfigError(f"{where}: limit lower {lower} is not below upper {upper}")
        if child.get("link") not in inertials:
            raise ConfigError(f"{where}: child link '{child.get('link')}' has no <inertial>")
        revolute.append((name, parent.get("link"), child.get("link"), xyz, rot, lower, upper))

    # Order parents before children, starting from links that no joint moves.
    child_links = {r[2] for r in revolute} | {f[0] for f in fixed_raw}
    roots = base_links - child_links
    if len(roots) != 1:
        raise ConfigError(f"{path.name}: expected one root link, found {sorted(roots)}")
    base = roots.pop()
    owner = {base: -1}          # link -> index of the joint that moves it
    joints: list[Joint] = []
    pending = list(revolute)
    while pending:
        ready = [r for r in pending if r[1] in owner]
        if not ready:
            raise ConfigError(f"{path.name}: joint '{pending[0][0]}' hangs from unknown link '{pending[0][1]}'")
        for r in ready:
            name, plink, clink, xyz, rot, lower, upper = r
            mass, com, inertia = inertials[clink]
            joints.append(Joint(name, owner[plink], xyz, rot, lower, upper, mass, com, inertia, clink))
            owner[clink] = len(joints) - 1
            pending.remove(r)
    fixed = {}
    for clink, plink, xyz in fixed_raw:
        if plink not in owner or owner[plink] < 0:
            raise ConfigError(f"{path.name}: fixed link '{clink}' must hang from a moving link")
        fixed[clink] = (joints[owner[plink]].name, xyz)
    return joints, fixed, base


def with_payload(robot: RobotDescription, mass: float) -> RobotDescription:
    """The arm holding a point mass (kg) at its fingertip: folded into the fingertip body's
    inertial (mass, centre of mass, inertia by the parallel-axis theorem)."""
    import dataclasses

    j = robot.joints[robot.fingertip_body]
    m = j.mass + mass
    com = (j.mass * j.com + mass * robot.fingertip_xyz) / m

    def about(point_mass: float, r: np.ndarray) -> np.ndarray:
        return point_mass * (r @ r * np.eye(3) - np.outer(r, r))
    inertia = j.inertia + about(j.mass, j.com - com) + about(mass, robot.fingertip_xyz - com)
    joints = list(robot.joints)
    joints[robot.fingertip_body] = dataclasses.replace(j, mass=m, com=com, inertia=inertia)
    return dataclasses.replace(robot, joints=tuple(joints))
