"""The ROS 2 node with real rclpy (PyPI wheels) against the servo-bus emulator in its own
process, closed loop: a test client enables the arm, sends targets, measures the
fingertip from joint_states; e-stop, a killed emulator, an unplugged adapter, bad
parameters and bad targets.

The node runs as its own process with `--ros-args --params-file`, as `ros2 launch` would
start it. The launch file itself runs only on a ROS 2 installation (`launch`/`ros2launch`
are not on PyPI); its logic is params.launch_parameters, tested here.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from soarm import REPO_ROOT, config
from soarm.robot.bus import FeetechBus
from soarm.robot.emulator_process import EmulatorProcess

ROS_PKG = REPO_ROOT / "ros2_ws" / "src" / "so_arm_policy"
REFERENCE_POLICY = REPO_ROOT / "data" / "policies" / "reach.onnx"

from tests.ros_harness import Client, NodeProcess, diag_with  # noqa: E402  (sets the ROS environment first)
from so_arm_policy import params  # noqa: E402

pytestmark = pytest.mark.bus


# ------------------------------------------------------------------ no ROS needed
def test_config_file_holds_every_parameter_with_its_default():
    raw = yaml.safe_load((ROS_PKG / "config" / "reach.yaml").read_text())["/**"]["ros__parameters"]
    flat = {}
    for k, v in raw.items():
        flat.update({f"{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
    declared = {name: default for name, default, _ in params.declarations()}
    assert set(flat) == set(declared)
    for name, default in declared.items():
        if name not in ("port", "policy", "calibration"):
            assert flat[name] == default, name


def test_colcon_builds_the_package(tmp_path):
    """colcon (from PyPI) builds the ament_python package as on a ROS 2 machine and installs
    what `ros2 run` / `ros2 launch` look for."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROS_PKG, tmp_path / "src" / "so_arm_policy")
    r = subprocess.run([str(Path(sys.executable).parent / "colcon"), "build"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    inst = tmp_path / "install" / "so_arm_policy"
    for rel in ("lib/so_arm_policy/reach_node", "share/ament_index/resource_index/packages/so_arm_policy",
                "share/so_arm_policy/package.xml", "share/so_arm_policy/launch/reach.launch.py",
                "share/so_arm_policy/config/reach.yaml", "share/so_arm_policy/config/reach.rviz",
                "share/so_arm_policy/udev/99-so-arm101.rules"):
        assert (inst / rel).is_file(), rel


def test_launch_arguments_map_onto_parameters():
    assert params.launch_parameters({"port": "", "policy": " ", "rate": ""}) == {}
    got = params.launch_parameters({"port": "/dev/so_arm101", "policy": "p.onnx", "calibration": "c.json",
                                    "rate": "50"})
    assert got == {"port": "/dev/so_arm101", "policy": "p.onnx", "calibration": "c.json", "rate_hz": 50.0}
    with pytest.raises(config.ConfigError, match="rate:='fast'"):
        params.launch_parameters({"rate": "fast"})


def test_launch_with_the_emulator_points_the_node_at_it():
    """use_emulator:=true: the node's port is the emulator's link, its calibration the one the
    emulator writes (or the user's, which the emulator only reads), the policy the shipped one."""
    got = params.launch_parameters({"use_emulator": "true"}, "/tmp/x/calibration.json")
    assert got == {"port": params.EMULATOR_LINK, "calibration": "/tmp/x/calibration.json",
                   "policy": str(REFERENCE_POLICY)}
    cmd = params.emulator_command({}, "/tmp/x/ready.json", "/tmp/x/calibration.json")
    assert cmd[:2] == ["soarm", "emulate"] and cmd[cmd.index("--link") + 1] == params.EMULATOR_LINK
    assert cmd[cmd.index("--calibrate") + 1] == "/tmp/x/calibration.json"
    mine = params.emulator_command({"calibration": "mine.json"}, "/tmp/x/ready.json", "/tmp/x/calibration.json")
    assert "--calibrate" not in mine and mine[mine.index("--calibration") + 1] == "mine.json"
    assert params.launch_parameters({"use_emulator": "true", "calibration": "mine.json"}, "")["calibration"] == \
        "mine.json"
    with pytest.raises(config.ConfigError, match="exclude each other"):
        params.launch_parameters({"use_emulator": "true", "port": "/dev/ttyACM0"})
    with pytest.raises(config.ConfigError, match="rviz:='yes': true or false"):
        params.launch_switch({"rviz": "yes"}, "rviz")
    assert params.launch_switch({}, "rviz") is False


def test_the_emulator_says_it_answers_in_the_words_the_launch_waits_for(tmp_path):
    """reach.launch.py use_emulator:=true starts the node on this line of `soarm emulate`."""
    import subprocess
    import sys

    cmd = params.emulator_command({}, str(tmp_path / "ready.json"), str(tmp_path / "cal.json"))
    cmd = [str(Path(sys.executable).parent / "soarm"), *cmd[1:], "--no-compile"]
    cmd[cmd.index("--link") + 1] = str(tmp_path / "link")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if params.EMULATOR_READY in line or len(lines) > 20:
                break
        assert params.EMULATOR_READY in lines[-1], lines
        assert (tmp_path / "ready.json").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_parameters_are_validated_at_the_edge():
    with pytest.raises(config.ConfigError, match="'policy' is required"):
        params.to_cfg({"port": "/dev/x", "calibration": "c.json"})
    with pytest.raises(config.ConfigError, match="safety.max_step"):
        params.to_cfg({"port": "/dev/x", "policy": "p", "calibration": "c", "safety.max_step": "fast"})
    with pytest.raises(config.ConfigError, match=r"safety.max_step: 100.0 is outside 0.0001..0.25"):
        params.to_cfg({"port": "/dev/x", "policy": "p", "calibration": "c", "safety.max_step": 100.0})
    assert params.to_cfg({"port": "/dev/x", "policy": "p", "calibration": "c", "rate_hz": 30}).rate_hz == 30.0
    need = {"port": "/dev/x", "policy": "p", "calibration": "c"}
    cfg, own = params.from_overrides({**need, "use_sim_time": False, "autostart": False})   # ROS's own keys pass
    assert cfg.port == "/dev/x" and own == {"autostart": False}
    with pytest.raises(config.ConfigError, match="unknown key 'safety.max_speed'"):
        params.from_overrides({**need, "safety.max_speed": 1.0, "use_sim_time": False})
    with pytest.raises(config.ConfigError, match="autostart: expected bool"):
        params.from_overrides({**need, "autostart": "yes"})


@pytest.fixture
def client():
    c = Client()
    yield c
    c.close()


@pytest.fixture
def rig(request, tmp_path, tiny_policy):
    """emulator process + node process; yields a function that starts the node. Eager
    physics (quick to start) unless the test is marked `compiled_physics` (real time to
    spare on a busy 2-core machine, for the accuracy figures)."""
    fast_start = request.node.get_closest_marker("compiled_physics") is None
    plant = getattr(request, "param", "armsim")               # the emulated arm's physics
    args = ("--plant", plant, *(("--no-compile",) if fast_start else ()))
    emu = EmulatorProcess(tmp_path / "calibration.json", seed=5, args=args)
    nodes = []

    def start(**overrides):
        values = {"port": emu.port, "policy": str(tiny_policy), "calibration": str(emu.calibration),
                  "log_dir": str(tmp_path / "logs"), **overrides}
        nodes.append(NodeProcess(tmp_path, values))
        return nodes[-1]
    yield emu, start
    for n in nodes:
        n.stop()
    emu.stop()


@pytest.mark.compiled_physics
@pytest.mark.parametrize("rig", ["armsim", "mujoco"], indirect=True)
def test_closed_loop_reach_through_ros_sdk_and_emulator(rig, client, tmp_path, request):
    """20 fixed targets through ROS + SDK + emulator vs the same policy on the same plant
    without ROS: the embedded sim for our plant, the transfer suite's MuJoCo plant for the
    published MJCF."""
    from soarm.description import load_robot
    from soarm.dynamics import ArmDynamics
    from soarm.export.runtime import PolicyRuntime
    from soarm.reach import CommandCfg, ReachCfg, full_pose, sample_targets
    from soarm.logs import read_log
    from soarm.robot.replay import replay_decisions

    assert REFERENCE_POLICY.is_file(), f"{REFERENCE_POLICY}: the shipped reference policy is missing"
    emu, start = rig
    node = start(policy=str(REFERENCE_POLICY))
    client.wait_for(diag_with(client, "state", "disabled"))
    robot = load_robot()
    dyn = ArmDynamics(robot, dtype=torch.float64)
    targets = sample_targets(dyn, CommandCfg(), 20, torch.Generator().manual_seed(7)).float()
    rt = PolicyRuntime(REFERENCE_POLICY)
    window = 2.0                                          # s per target, as in training

    r = client.call("enable")
    assert r.success, r.message
    # First out of the power-on slump to the home fingertip position, where every episode
    # in the simulator starts (not measured).
    home = dyn.fingertip(full_pose(dyn, torch.tensor(robot.home, dtype=torch.float64)[None]))[0]
    client.send(home.tolist())
    time.sleep(window)
    errors = []
    for target in targets:
        client.send(target.tolist())
        time.sleep(window)
        q = torch.tensor([client.joints[-1][1]], dtype=torch.float64)
        tip = dyn.fingertip(q)[0].float()                  # joint_states holds every joint
        errors.append(float((tip - target).norm()))
    assert client.call("disable").success
    client.wait_for(diag_with(client, "state", "disabled"), timeout=30)     # parked, torque off
    ros_mean = float(np.mean(errors))

    # The same plant without ROS, bus or emulator: the transfer suite's runner (the robot's
    # own decision step), nominal, one arm through the same 20 targets.
    from soarm.robot.safety import SafetyCfg
    from soarm.calibration.transfer import PLANTS, SuiteContext, run_plant

    task = config.load(ReachCfg, REPO_ROOT / "configs" / "task" / "reach.yaml")
    plant = request.node.callspec.params["rig"]
    ctx = SuiteContext.of(task)
    spec = PLANTS["nominal" if plant == "armsim" else "mujoco"]
    sim = run_plant(rt, spec, ctx, targets.numpy(), 20, 7, SafetyCfg())
    ratio = ros_mean / sim["mean_error_m"]
    print(json.dumps({"plant": plant, "closed_loop_ros_mean_error_m": ros_mean,
                      "without_ros_mean_error_m": sim["mean_error_m"], "ratio": ratio, "errors_m": errors}))
    # With the actuator-randomized policy the MuJoCo rig gave 1.37 and 1.71 in two runs (armsim
    # ~1.0): the live path's timing costs it 1-2 mm there, not yet understood (see the
    # session note), so the bound is 2.0 until it is.
    assert ratio <= 2.0, f"through ROS {ros_mean * 1000:.1f} mm vs {sim['mean_error_m'] * 1000:.1f} mm without"

    # The node's encoder log replays through the same pipeline to the same commands.
    logs = sorted((tmp_path / "logs").glob("*.mcap"))
    assert len(logs) == 1
    header, ticks = read_log(logs[0])
    report = replay_decisions(header, ticks, rt)
    assert report["ticks"] > 20 * window * 25 and report["ticks_differing"] == 0 and report["events_differing"] == 0
    d = client.diag[-1]
    # The node's rate is measured in benchmarks/ros_node_tick.py; here a loop that cannot hold
    # it at all fails (a stalled plant or policy overruns nearly every tick). On a 2-core
    # machine, 1.2 % of ticks overran with two CPU-bound processes beside the suite, 6.2 % with
    # four (tests/under_load.py's two on top), so the bound is 25 %.
    assert int(d["overruns"]) <= int(d["ticks"]) // 4, d
    assert node.proc.poll() is None


def reaching(start, client, target, seconds: float, **overrides):
    """A node started (parameters `overrides`), enabled and reaching for `target` for `seconds`."""
    node = start(**overrides)
    client.wait_for(diag_with(client, "state", "disabled"))
    assert client.call("enable").success
    client.send(target)
    time.sleep(seconds)
    return node


def test_estop_mid_motion_stops_within_one_tick(rig, client):
    emu, start = rig
    node = reaching(start, client, [0.25, 0.1, 0.2], 0.7, rate_hz=30)      # an integer rate is a rate
    r = client.call("estop")
    assert r.success, r.message + node.output()
    latency_ms = float(r.message.split("torque off ")[1].split(" ms")[0])
    rate = float(client.diag[-1]["rate_hz"])
    assert rate == 30.0
    assert latency_ms <= 1000.0 / rate + 5.0, r.message      # one tick, plus the torque-off writes
    d = client.wait_for(diag_with(client, "state", "fault"))
    assert "e-stop" in d["message"] and d["level"] == 2
    assert node.proc.poll() is None
    assert client.call("enable").success                     # enable is the reset
    assert node.stop(signal.SIGINT) == 0                     # Ctrl-C with torque on ...
    bus = FeetechBus(emu.port, {f"j{sid}": sid for sid in range(1, 7)})
    bus.connect()
    assert all(bus.read("Torque_Enable", sid) == 0 for sid in range(1, 7))   # ... ends with torque off
    bus.close()


@pytest.mark.parametrize("how", ["kill", "unplug"])
def test_losing_the_bus_ends_in_torque_off_and_a_diagnostic_error(rig, client, how):
    emu, start = rig
    node = reaching(start, client, [0.22, 0.0, 0.15], 0.5)
    emu.kill() if how == "kill" else emu.unplug()
    d = client.wait_for(diag_with(client, "state", "fault"), timeout=10)
    assert d["level"] == 2 and "watchdog_torque_off" in d["message"] and "adapter" in d["message"]
    r = client.call("enable")
    assert not r.success and r.message                       # refuses, says why, stays up
    time.sleep(2.0)
    assert node.proc.poll() is None, node.output()           # no crash (loop)
    assert node.stop() == 0, node.output()
    out = node.output()
    assert "Traceback" not in out and "stopped; torque off" in out


def test_bad_targets_are_refused_with_a_warning(rig, client):
    emu, start = rig
    node = start()
    d = client.wait_for(diag_with(client, "state", "disabled"))
    # One at a time: targets are coalesced, so one sent right after another replaces it.
    for xyz, frame, why in (([0.22, 0.0, 0.15], "world", "frame 'world', expected the robot base frame 'base_link'"),
                            ([math.nan, 0.0, 0.15], "base_link", "not a finite 3-D point"),
                            ([2.0, 0.0, 0.15], "base_link", "outside the trained workspace")):
        client.send(xyz, frame=frame)
        assert client.wait_for(lambda: why in node.output()), node.output()
    client.send([0.22, 0.0, 0.15])
    d = client.wait_for(lambda: next((d for d in reversed(client.diag) if d.get("target")), None))
    assert d["target"].startswith("[0.2199")
    assert node.stop() == 0


def test_a_flood_of_targets_is_coalesced_to_the_newest(rig, client):
    """Targets are taken at most once per poll, the newest winning: the executor's work does
    not grow with the message rate (benchmarks/ros_node_tick.py measures the tick rate)."""
    from so_arm_policy.reach_node import TARGET_POLL_S

    emu, start = rig
    node = start()
    client.wait_for(diag_with(client, "state", "disabled"))
    sent, newest = 500, [0.2, 0.05, 0.15]
    t0 = time.monotonic()
    for _ in range(sent - 1):
        client.send([0.22, 0.0, 0.15])
    client.send(newest)
    window = time.monotonic() - t0
    d = client.wait_for(lambda: next((d for d in reversed(client.diag) if d.get("target")
                                      and np.allclose(json.loads(d["target"]), newest, atol=1e-6)), None))
    polls = window / TARGET_POLL_S + 2                       # polls in the window, and the one after it
    assert 1 <= int(d["targets"]) <= polls, (d["targets"], sent, window)
    assert node.stop() == 0


@pytest.mark.parametrize("case", ["missing_policy", "foreign_policy", "foreign_calibration", "bad_type",
                                  "misspelled_key", "out_of_range", "missing_port"])
def test_bad_configuration_is_one_error_and_the_node_stays_disabled(rig, client, tmp_path, tiny_policy, case):
    emu, start = rig
    if case == "missing_policy":
        node, expect = start(policy=str(tmp_path / "nope.onnx")), "no such policy file"
    elif case == "foreign_policy":                         # trained for an arm with other joints
        import onnx

        model = onnx.load(str(tiny_policy))
        for prop in model.metadata_props:
            if prop.key == "soarm.contract":
                terms = json.loads(prop.value)
                terms["joint_names"] = ["base", "shoulder", "elbow", "wrist_pitch", "wrist_roll"]
                prop.value = json.dumps(terms)
        onnx.save(model, str(tmp_path / "other_arm.onnx"))
        node, expect = start(policy=str(tmp_path / "other_arm.onnx")), "unsupported policy contract"
    elif case == "foreign_calibration":
        cal = json.loads(Path(emu.calibration).read_text())
        cal["elbow_flex"]["homing_offset"] += 100
        path = tmp_path / "other_arm.json"
        path.write_text(json.dumps(cal))
        node, expect = start(calibration=str(path)), "recalibrate or use the right file"
    elif case == "bad_type":
        node, expect = start(**{"safety.max_step": "fast"}), "safety.max_step"
    elif case == "misspelled_key":
        node, expect = start(**{"safety.max_speed": 1.0}), "unknown key 'safety.max_speed'"
    elif case == "out_of_range":
        node, expect = start(**{"safety.max_step": 100.0}), "safety.max_step: 100.0 is outside"
    else:                                                  # configure's bus check: through ErrorProcessing
        node, expect = start(port=str(tmp_path / "no_adapter")), str(tmp_path / "no_adapter")
    d = client.wait_for(lambda: next((d for d in reversed(client.diag) if d["level"] == 2), None))
    assert expect in d["message"] and d["state"] == "unconfigured" and d["lifecycle"] == "unconfigured"
    r = client.call("enable")
    assert not r.success and expect in r.message
    assert node.proc.poll() is None
    errors = [line for line in node.output().splitlines() if "[ERROR]" in line]
    assert len(errors) >= 1 and expect in errors[0]


# ------------------------------------------------------------------ ROS conventions (issue 21)
def lifecycle(client, transition: int | None = None):
    """The node's lifecycle state label, or whether `transition` succeeded (lifecycle_msgs)."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState, GetState

    if transition is None:
        return client.call("/so_arm_policy/get_state", srv_type=GetState).current_state.label
    request = ChangeState.Request(transition=Transition(id=transition))
    return client.call("/so_arm_policy/change_state", srv_type=ChangeState, request=request, timeout=30).success


def arm_near(client, pose, within: float):
    """The latest joint_states has every arm joint within `within` rad of `pose`."""
    from soarm.description import load_robot

    arm = load_robot().arm_index
    return lambda: bool(client.joints) and np.abs(np.array(client.joints[-1][1])[arm] - pose).max() < within


def test_lifecycle_transitions_and_joint_space_commands(rig, client):
    """configure -> activate -> home, a trajectory, a target (the policy resumes), park ->
    deactivate (parks, torque off) -> cleanup, through lifecycle_msgs as a manager would."""
    from builtin_interfaces.msg import Duration
    from lifecycle_msgs.msg import Transition
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    from soarm.description import load_robot

    robot = load_robot()
    emu, start = rig
    node = start(autostart=False)
    client.wait_for(diag_with(client, "state", "unconfigured"))
    assert lifecycle(client) == "unconfigured"
    assert lifecycle(client, Transition.TRANSITION_CONFIGURE)
    assert lifecycle(client) == "inactive" and client.wait_for(diag_with(client, "state", "disabled"))
    assert lifecycle(client, Transition.TRANSITION_ACTIVATE)
    client.wait_for(diag_with(client, "state", "enabled"))

    r = client.call("home")
    assert r.success, r.message
    client.wait_for(arm_near(client, robot.home, 0.08), timeout=60)

    pub = client.node.create_publisher(JointTrajectory, "joint_trajectory", 10)
    goal = robot.home.copy()
    goal[2] += 0.3                                          # elbow_flex
    goal[3] -= 0.3                                          # wrist_flex
    traj = JointTrajectory(joint_names=["elbow_flex", "wrist_flex"], points=[
        JointTrajectoryPoint(positions=[goal[2], robot.home[3]], time_from_start=Duration(sec=1)),
        JointTrajectoryPoint(positions=[goal[2], goal[3]], time_from_start=Duration(sec=2))])
    pub.publish(traj)
    client.wait_for(diag_with(client, "move", "trajectory"))
    client.wait_for(arm_near(client, goal, 0.08), timeout=60)
    pub.publish(JointTrajectory(joint_names=["gripper"], points=[JointTrajectoryPoint(positions=[0.5])]))

    client.send([0.22, 0.0, 0.15])                         # a target hands the arm back to the policy
    client.wait_for(lambda: client.diag and client.diag[-1]["move"] == "" and client.diag[-1]["target"])
    r = client.call("park")
    assert r.success, r.message
    client.wait_for(arm_near(client, robot.park, 0.15), timeout=60)

    assert lifecycle(client, Transition.TRANSITION_DEACTIVATE)     # parks (already there), torque off
    assert lifecycle(client) == "inactive"
    d = client.wait_for(diag_with(client, "state", "disabled"))
    assert "torque off" in d["message"]
    assert lifecycle(client, Transition.TRANSITION_CLEANUP)
    client.wait_for(diag_with(client, "state", "unconfigured"))
    assert node.stop() == 0, node.output()
    out = node.output()
    assert "trajectory refused" in out and "the gripper is held" in out and "Traceback" not in out


def test_description_states_diagnostics_and_parameter_descriptors(rig, client):
    import xml.etree.ElementTree as ET

    from rcl_interfaces.srv import DescribeParameters
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from soarm.description import load_robot

    robot = load_robot()
    emu, start = rig
    node = start()
    client.wait_for(diag_with(client, "state", "disabled"))
    urdf = []                                               # joins after the node published: transient local
    client.node.create_subscription(String, "robot_description", lambda m: urdf.append(m.data), QoSProfile(
        depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE))
    client.wait_for(lambda: urdf)
    root = ET.fromstring(urdf[0])
    joints = {j.get("name") for j in root.findall("joint") if j.get("type") == "revolute"}
    assert joints == set(robot.names)
    for j in robot.joints:                                  # every moving link is drawn
        link = next(li for li in root.findall("link") if li.get("name") == j.link)
        assert link.findall("visual"), j.link

    client.wait_for(lambda: client.velocities and len(client.velocities[-1]) == len(robot.names))
    names = {f"so_arm_policy: servo {i + 1} ({n})" for i, n in enumerate(robot.names)}
    client.wait_for(lambda: names <= set(client.servo_diag), timeout=30)
    servo = client.servo_diag["so_arm_policy: servo 3 (elbow_flex)"]
    assert servo["level"] == 0 and servo["error_bits"] == "0x00" and float(servo["voltage_v"]) > 5

    r = client.call("/so_arm_policy/describe_parameters", srv_type=DescribeParameters,
                    request=DescribeParameters.Request(names=["safety.max_step", "safety.hold_after", "port"]))
    step, hold, port = r.descriptors
    assert (step.floating_point_range[0].from_value, step.floating_point_range[0].to_value) == (1e-4, 0.25)
    assert (hold.integer_range[0].from_value, hold.integer_range[0].to_value) == (1, 300)
    assert "serial port" in port.description and port.read_only
    assert node.stop() == 0, node.output()
