"""Shared by tests/test_ros_node.py and benchmarks/ros_node_tick.py: the reach node as a
process (started as `ros2 launch` would: `--ros-args --params-file`) and a client node
with real rclpy that records joint_states and diagnostics and calls the services."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

# One DDS domain per test session, so parallel sessions on one host do not hear each other.
os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random(os.getpid()).randint(1, 200)))
os.environ.setdefault("AMENT_PREFIX_PATH", sys.prefix)
os.environ.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
# UDP on loopback only: Fast DDS's shared-memory transport keeps interprocess locks in
# /dev/shm, and a participant that dies holding one (a node killed after its stop timed out)
# can leave the next participant's creation blocked forever, a hang no test timeout reaches.
os.environ.setdefault("FASTDDS_BUILTIN_TRANSPORTS", "UDPv4")
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from geometry_msgs.msg import PointStamped  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from so_arm_policy import params  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402


class Client:
    """The test's own ROS node: records joint_states and diagnostics, calls services."""

    def __init__(self):
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx)
        self.node = rclpy.create_node("soarm_test_client", context=self.ctx)
        self.joints: list[tuple[float, list[float]]] = []
        self.velocities: list[list[float]] = []
        self.diag: list[dict] = []
        self.servo_diag: dict[str, dict] = {}          # status name -> its latest, for the per-servo entries
        self.node.create_subscription(JointState, "joint_states", self._on_joints, 50)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)
        self.target = self.node.create_publisher(PointStamped, "target", 10)
        self.services = {n: self.node.create_client(Trigger, n) for n in ("enable", "disable", "estop")}
        self.executor = SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)
        self._closing = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self):
        while not self._closing.is_set():
            self.executor.spin_once(timeout_sec=0.05)

    def _on_joints(self, msg):
        self.joints.append((time.monotonic(), list(msg.position)))
        self.velocities.append(list(msg.velocity))

    def _on_diag(self, msg):
        for s in msg.status:
            entry = {"level": int.from_bytes(s.level, "little") if isinstance(s.level, bytes) else int(s.level),
                     "message": s.message, **{kv.key: kv.value for kv in s.values}}
            if s.name == "so_arm_policy: reach":
                self.diag.append(entry)
            else:
                self.servo_diag[s.name] = entry

    def call(self, name: str, timeout: float = 15.0, srv_type=Trigger, request=None):
        """Call a service (a Trigger unless `srv_type` says otherwise) and return its response."""
        if name not in self.services:
            self.services[name] = self.node.create_client(srv_type, name)
        cli = self.services[name]
        assert cli.wait_for_service(timeout_sec=timeout), f"service {name} not available"
        fut = cli.call_async(request if request is not None else srv_type.Request())
        t_end = time.monotonic() + timeout
        while not fut.done() and time.monotonic() < t_end:
            time.sleep(0.01)
        assert fut.done(), f"service {name} did not answer"
        return fut.result()

    def send(self, xyz, frame="base_link"):
        msg = PointStamped()
        msg.header.frame_id = frame
        msg.point.x, msg.point.y, msg.point.z = (float(v) for v in xyz)
        self.target.publish(msg)

    def wait_for(self, what, timeout=30.0):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            got = what()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting; last diagnostics: {self.diag[-1:]}")

    def close(self):
        """Stop spinning first, then tear down: rclpy's executor shutdown does not wait for a
        spin in another thread, and destroying a node under a running wait races with it."""
        self._closing.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the client's spin thread did not stop"
        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.ctx)


class NodeProcess:
    def __init__(self, tmp: Path, overrides: dict):
        values = {"port": "/dev/null", "policy": "", "calibration": "", **overrides}
        self.params_file = tmp / "params.yaml"
        self.params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": params.nested(values)}}))
        self.log_path = tmp / "node.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "so_arm_policy.reach_node", "--ros-args",
                                      "--params-file", str(self.params_file)],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def diag_with(client: Client, key: str, value):
    """The newest diagnostic when it has `key` == `value`: the node's state now, not one it
    was in before (every state change is published, so the newest is the current one)."""
    return lambda: client.diag[-1] if client.diag and client.diag[-1].get(key) == value else None
