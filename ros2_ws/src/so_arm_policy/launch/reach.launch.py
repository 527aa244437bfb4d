"""ros2 launch so_arm_policy reach.launch.py port:=/dev/ttyACM0 policy:=/path/policy.onnx \
       calibration:=/path/so101.json [rate:=30] [namespace:=arm1] [config:=/path/reach.yaml]

Arguments left empty keep the value in config/reach.yaml. The mapping of arguments onto
parameters is so_arm_policy.params.launch_parameters, tested without ROS; this file runs
only on a ROS 2 installation (the `launch` packages are not on PyPI).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from so_arm_policy.params import LAUNCH_ARGUMENTS, launch_parameters

CONFIG = os.path.join(get_package_share_directory("so_arm_policy"), "config", "reach.yaml")
HELP = {"port": "serial port of the servo adapter", "policy": "exported ONNX policy",
        "calibration": "LeRobot calibration JSON", "rate": "control rate in Hz (default: the policy's)"}


def _node(context):
    args = {name: LaunchConfiguration(name).perform(context) for name in LAUNCH_ARGUMENTS}
    return [Node(package="so_arm_policy", executable="reach_node", name="so_arm_policy",
                 namespace=LaunchConfiguration("namespace").perform(context),
                 parameters=[LaunchConfiguration("config").perform(context), launch_parameters(args)],
                 output="screen", emulate_tty=True)]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value="", description=HELP[name]) for name in LAUNCH_ARGUMENTS]
        + [DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
           DeclareLaunchArgument("config", default_value=CONFIG, description="parameter file"),
           OpaqueFunction(function=_node)])
