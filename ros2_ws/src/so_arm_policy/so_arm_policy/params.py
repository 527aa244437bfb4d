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

from soarm import config
from soarm.robot.driver import DriverCfg

DESCRIPTIONS = {
    "port": "serial port of the servo adapter, e.g. /dev/ttyACM0 or /dev/so_arm101 (udev rule)",
    "policy": "exported ONNX policy (soarm export); its contract sets joints, action scale and rate",
    "calibration": "LeRobot calibration JSON of this arm (soarm calibrate, or LeRobot's own file)",
    "baud": "bus baud rate; the SO-101's STS3215 servos ship at 1000000",
    "servo_ids": "servo id of each joint, in the robot's joint order (shoulder_pan ... gripper)",
    "rate_hz": "control rate in Hz; 0 takes the rate the policy was trained at",
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

# launch argument -> parameter; an empty argument keeps config/reach.yaml's value.
LAUNCH_ARGUMENTS = {"port": "port", "policy": "policy", "calibration": "calibration", "rate": "rate_hz"}


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


def undeclared(overrides: dict[str, Any], declared: dict[str, Any]) -> dict[str, Any]:
    """The parameter overrides (name -> rclpy Parameter or value) that are neither ours nor
    ROS's own, as plain values."""
    return {name: getattr(p, "value", p) for name, p in overrides.items()
            if name not in declared and not name.startswith(ROS_OWNED)}


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


def launch_parameters(arguments: dict[str, str]) -> dict[str, Any]:
    """Parameter overrides from launch arguments (strings); empty ones are left out."""
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
    return out
