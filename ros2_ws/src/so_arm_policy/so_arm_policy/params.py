"""The node's parameters and the launch file's arguments, without ROS imports.

The parameters are the fields of the driver's DriverCfg (soarm/robot/driver.py), nested
ones dotted (`safety.max_step`), so there is one definition of names, types and defaults.
`launch_parameters` is the whole logic of reach.launch.py, here so that it is tested
where ROS 2's `launch` cannot be installed.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from soarm import REPO_ROOT, config
from soarm.robot.driver import DriverCfg
from soarm.robot.safety import SafetyCfg

DESCRIPTIONS = {
    "port": "serial port of the servo adapter, e.g. /dev/ttyACM0 or /dev/so_arm101 (udev rule)",
    "policy": "exported ONNX policy (soarm export); its contract sets joints, action scale and rate",
    "calibration": "LeRobot calibration JSON of this arm (soarm calibrate, or LeRobot's own file)",
    "baud": "bus baud rate; the SO-101's STS3215 servos ship at 1000000",
    "servo_ids": "servo id of each joint, in the robot's joint order (shoulder_pan ... gripper)",
    "rate_hz": "control rate in Hz: 0 or the rate the policy was trained at (another is refused)",
    "enable_on_start": "torque on at start-up; otherwise call the ~/enable service",
    "log_dir": "directory for an encoder log (MCAP) per enable; empty for none",
    "status_every": "ticks between servo status polls (one servo per poll)",
    "park_speed": "rad/s per joint on the way to the park pose before torque off (disable, Ctrl-C); 0: at once",
    "park_timeout_s": "s after which torque goes off even if the park pose is not reached",
    "safety.margin": "rad kept clear of each joint limit",
    "safety.max_step": "rad a goal may move per tick",
    "safety.max_velocity": "rad/s measured above which the arm holds",
    "safety.hold_after": "ticks without a fresh reading or policy output before holding",
    "safety.torque_off_after": "ticks without a fresh reading or policy output before torque off",
    "safety.max_temperature": "servo temperature (deg C) that turns torque off",
}

# The node's own parameters, beside the driver's (name, default, description).
NODE_PARAMETERS = [("autostart", True, "configure at start-up (open the port, check the servos, load the "
                                       "policy); false: wait for a lifecycle 'configure'")]

# launch argument -> parameter; an empty argument keeps config/reach.yaml's value.
LAUNCH_ARGUMENTS = {"port": "port", "policy": "policy", "calibration": "calibration", "rate": "rate_hz"}
# Launch switches (true/false) that add processes rather than set parameters.
LAUNCH_SWITCHES = {"rviz": "robot_state_publisher and RViz with the shipped config",
                   "use_emulator": "start `soarm emulate` on a link and point the node at it (a dry run)"}
EMULATOR_LINK = "/tmp/so_arm101_emulator"      # the pty's symlink in a use_emulator:=true launch
EMULATOR_READY = "SO-101 servo bus"            # the line `soarm emulate` prints once it answers
SHIPPED_POLICY = REPO_ROOT / "data" / "policies" / "reach.onnx"


def ranges() -> dict[str, tuple[float, float]]:
    """Parameter -> (low, high), for the descriptors `ros2 param describe` shows."""
    return {**DriverCfg.BOUNDS, **{f"safety.{k}": v for k, v in SafetyCfg.BOUNDS.items()}}


def declarations() -> list[tuple[str, Any, str]]:
    """(name, default, description) of every parameter, in DriverCfg's order."""
    out = []

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out.append((prefix + f.name, value, DESCRIPTIONS[prefix + f.name]))
    walk(DriverCfg(), "")
    return out


# Parameters every rclpy node owns; a parameter file may set them.
ROS_OWNED = ("use_sim_time", "start_type_description_service", "qos_overrides.")


def from_overrides(overrides: dict[str, Any]) -> tuple[DriverCfg, dict[str, Any]]:
    """The driver's config and the node's own values from a parameter file's overrides
    (name -> rclpy Parameter or value) over the defaults; ConfigError (one line) if any
    value is invalid or a key unknown."""
    given = {name: getattr(p, "value", p) for name, p in overrides.items() if not name.startswith(ROS_OWNED)}
    node = {name: given.pop(name, default) for name, default, _ in NODE_PARAMETERS}
    for name, default, _ in NODE_PARAMETERS:
        if type(node[name]) is not type(default):
            raise config.ConfigError(f"parameters: {name}: expected {type(default).__name__}, got {node[name]!r}")
    return to_cfg(given), node


def nested(values: dict[str, Any]) -> dict[str, Any]:
    """{"safety.max_step": 0.1} -> {"safety": {"max_step": 0.1}}, as a parameter file nests them."""
    raw: dict[str, Any] = {}
    for name, value in values.items():
        *parents, leaf = name.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "tolist") else value
    return raw


def to_cfg(values: dict[str, Any]) -> DriverCfg:
    """DriverCfg from dotted parameter values; ConfigError (one line) if any is invalid."""
    return config.from_dict(DriverCfg, nested(values), "parameters")


def launch_switch(arguments: dict[str, str], name: str) -> bool:
    text = arguments.get(name, "false").strip().lower()
    if text not in ("true", "false"):
        raise config.ConfigError(f"launch argument {name}:={text!r}: true or false")
    return text == "true"


def emulator_command(arguments: dict[str, str], ready_file: str, calibration_out: str) -> list[str]:
    """`soarm emulate` for use_emulator:=true: on EMULATOR_LINK, assembled as the given
    calibration describes (only read), or writing its own to `calibration_out`."""
    cal = arguments.get("calibration", "").strip()
    return ["soarm", "emulate", "--link", EMULATOR_LINK, "--ready-file", ready_file, "--quiet",
            *(("--calibration", cal) if cal else ("--calibrate", calibration_out))]


def launch_parameters(arguments: dict[str, str], emulator_calibration: str = "") -> dict[str, Any]:
    """Parameter overrides from launch arguments (strings); empty ones are left out. With
    use_emulator:=true the port is the emulator's link, the calibration the one it was
    assembled from (`emulator_calibration` when none is given) and the policy, if none is
    given, the shipped one."""
    types = {name: typing.get_type_hints(DriverCfg)[name] for name in LAUNCH_ARGUMENTS.values()}
    out: dict[str, Any] = {}
    for arg, param in LAUNCH_ARGUMENTS.items():
        text = arguments.get(arg, "").strip()
        if not text:
            continue
        try:
            out[param] = types[param](text)
        except ValueError:
            raise config.ConfigError(f"launch argument {arg}:={text!r} is not a valid {types[param].__name__}") \
                from None
    if launch_switch(arguments, "use_emulator"):
        if "port" in out:
            raise config.ConfigError(f"launch argument port:={out['port']!r} and use_emulator:=true exclude each "
                                     f"other (the emulator's port is {EMULATOR_LINK})")
        out["port"] = EMULATOR_LINK
        out.setdefault("calibration", emulator_calibration)
        if "policy" not in out and SHIPPED_POLICY.is_file():
            out["policy"] = str(SHIPPED_POLICY)
    return out
