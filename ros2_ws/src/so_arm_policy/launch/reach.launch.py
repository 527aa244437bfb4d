"""ros2 launch so_arm_policy reach.launch.py port:=/dev/ttyACM0 policy:=/path/policy.onnx \
       calibration:=/path/so101.json [rate:=30] [namespace:=arm1] [config:=/path/reach.yaml] \
       [rviz:=true] [use_emulator:=true]

Arguments left empty keep the value in config/reach.yaml. rviz:=true adds
robot_state_publisher and RViz (config/reach.rviz); use_emulator:=true starts `soarm emulate`
on a link and the node once the emulator answers: a full dry run without an arm. The mapping
of arguments onto parameters and the emulator's command line are so_arm_policy.params,
tested without ROS; this file runs only on a ROS 2 installation (the `launch` packages are
not on PyPI).
"""

import os
import tempfile

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction, RegisterEventHandler
from launch.event_handlers import OnProcessIO
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from so_arm_policy.params import (EMULATOR_READY, LAUNCH_ARGUMENTS, LAUNCH_SWITCHES, emulator_command,
                                  launch_parameters, launch_switch)
from soarm.description import load_robot
from soarm.robot.urdf_visual import robot_description

SHARE = get_package_share_directory("so_arm_policy")
CONFIG = os.path.join(SHARE, "config", "reach.yaml")
RVIZ = os.path.join(SHARE, "config", "reach.rviz")
HELP = {"port": "serial port of the servo adapter", "policy": "exported ONNX policy",
        "calibration": "LeRobot calibration JSON", "rate": "control rate in Hz (default: the policy's)"}


def _actions(context):
    args = {name: LaunchConfiguration(name).perform(context) for name in (*LAUNCH_ARGUMENTS, *LAUNCH_SWITCHES)}
    namespace = LaunchConfiguration("namespace").perform(context)
    scratch = tempfile.mkdtemp(prefix="so_arm_policy_")
    node = Node(package="so_arm_policy", executable="reach_node", name="so_arm_policy", namespace=namespace,
                parameters=[LaunchConfiguration("config").perform(context),
                            launch_parameters(args, os.path.join(scratch, "calibration.json"))],
                output="screen", emulate_tty=True)
    actions = []
    if launch_switch(args, "rviz"):
        urdf = robot_description(load_robot())
        actions += [Node(package="robot_state_publisher", executable="robot_state_publisher", namespace=namespace,
                         parameters=[{"robot_description": urdf}], output="screen"),
                    Node(package="rviz2", executable="rviz2", arguments=["-d", RVIZ], output="screen")]
    if not launch_switch(args, "use_emulator"):
        return actions + [node]
    emulator = ExecuteProcess(cmd=emulator_command(args, os.path.join(scratch, "ready.json"),
                                                   os.path.join(scratch, "calibration.json")), output="screen")
    started = []

    def on_stdout(event):                    # the node once the emulator answers, once
        if not started and EMULATOR_READY in event.text.decode(errors="replace"):
            started.append(True)
            return [node]
        return None
    return actions + [emulator, RegisterEventHandler(OnProcessIO(target_action=emulator, on_stdout=on_stdout))]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value="", description=HELP[name]) for name in LAUNCH_ARGUMENTS]
        + [DeclareLaunchArgument(name, default_value="false", description=text)
           for name, text in LAUNCH_SWITCHES.items()]
        + [DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
           DeclareLaunchArgument("config", default_value=CONFIG, description="parameter file"),
           OpaqueFunction(function=_actions)])
