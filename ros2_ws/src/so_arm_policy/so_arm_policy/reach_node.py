"""The reach node: ROS 2 wiring of soarm's ReachDriver, and nothing else.

    ros2 launch so_arm_policy reach.launch.py port:=/dev/ttyACM0 policy:=policy.onnx \
        calibration:=so101.json
    ros2 lifecycle set /so_arm_policy activate          # or: ros2 service call /enable std_srvs/srv/Trigger
    ros2 topic pub --once /target geometry_msgs/msg/PointStamped \
        "{header: {frame_id: base_link}, point: {x: 0.2, y: 0.0, z: 0.15}}"

A managed (lifecycle) node, as ros2_control's hardware components are:
    configure    load the policy and the calibration, open the port, check the servos
                 (at start-up unless autostart is false)
    activate     Goal := Present, torque on: the policy runs once a target arrives
    deactivate   park the arm at a safe speed, then torque off
    cleanup      release the port; shutdown likewise
A configuration or bus error in a transition goes through ErrorProcessing back to
unconfigured, with the reason in /diagnostics. A fault while active (watchdog, servo error,
e-stop) turns torque off at once and the node follows to inactive. The Trigger services
enable, disable and estop are aliases (enable also configures first where needed).

Publishes  joint_states (sensor_msgs/JointState, rad and rad/s, every tick),
           robot_description (std_msgs/String, transient local: the URDF with visuals),
           /diagnostics (diagnostic_msgs/DiagnosticArray, 1 Hz: the node, and each servo).
Subscribes target (geometry_msgs/PointStamped, robot base frame; others are refused),
           joint_trajectory (trajectory_msgs/JointTrajectory: arm joints, through the same
           clamps; the policy resumes at the next target).
Services   enable, disable, estop, home, park (std_srvs/Trigger); the lifecycle services.
"""

from __future__ import annotations

import sys
import time

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PointStamped
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.callback_groups import CallbackGroup, MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from std_msgs.msg import String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory

from so_arm_policy import params
from soarm.description import load_robot
from soarm.export.runtime import PolicyError
from soarm.robot.driver import DISABLED, ENABLED, FAULT, PARKING, JointSample, ReachDriver, Trajectory
from soarm.robot.urdf_visual import robot_description

SUCCESS, FAILURE, ERROR = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE, \
    TransitionCallbackReturn.ERROR
CONNECT_TIMEOUT_S = 15.0        # configure waits this long for the bus thread's first verdict
SWITCH_INTERVAL_S = 0.0005       # s; the GIL handed on this often (Python's default: 0.005)
TARGET_POLL_S = 0.01             # s; a target is taken at most this late (a control tick: 33 ms)


class Polled(CallbackGroup):
    """A group the executor never waits on or runs: its subscriptions keep the latest message
    in the middleware (depth 1) and a timer takes it. A flood of messages then costs the
    middleware's own threads, not the executor's Python work beside the bus thread."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


class ReachNode(LifecycleNode):
    def __init__(self):
        super().__init__("so_arm_policy")
        self.robot = load_robot()
        self.driver: ReachDriver | None = None
        self.cfg, self.error, self.message = None, "", ""
        autostart = True
        try:        # parameters are read once, here: a bad one is one line and the node stays unconfigured
            self.cfg, own = params.from_overrides(self._parameter_overrides)
            autostart = own["autostart"]
        except ValueError as e:
            self.error = str(e).splitlines()[0]
            self.get_logger().error(f"not configured: {self.error}")
        self._declare_parameters(use_overrides=self.cfg is not None)
        urgent = MutuallyExclusiveCallbackGroup()   # served while a transition waits for the arm to park
        self.joints = self.create_publisher(JointState, "joint_states", 10)
        self.diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        latched = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL,
                             reliability=ReliabilityPolicy.RELIABLE)
        self.create_publisher(String, "robot_description", latched).publish(
            String(data=robot_description(self.robot)))
        self.targets = self.create_subscription(PointStamped, "target", self._on_target, 1,
                                                callback_group=Polled())
        self.create_timer(TARGET_POLL_S, self._take_target)
        self.create_subscription(JointTrajectory, "joint_trajectory", self._on_trajectory, 10)
        for name, fn in (("enable", self._enable), ("disable", self._disable), ("home", self._home),
                         ("park", self._park)):
            self.create_service(Trigger, name, fn)
        self.create_service(Trigger, "estop", self._estop, callback_group=urgent)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=urgent)
        self.create_timer(0.1, self._follow_driver)
        if self.cfg is not None and autostart:
            self.trigger_configure()

    def _declare_parameters(self, use_overrides: bool) -> None:
        bounds = params.ranges()
        for name, default, text in params.declarations() + params.NODE_PARAMETERS:
            d = ParameterDescriptor(description=text, read_only=True, dynamic_typing=isinstance(default, float),
                                    additional_constraints="read at start-up; restart the node to change it")
            if name in bounds:
                lo, hi = bounds[name]
                if isinstance(default, float):
                    d.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(hi), step=0.0)]
                elif isinstance(default, int) and not isinstance(default, bool):
                    d.integer_range = [IntegerRange(from_value=int(lo), to_value=int(hi), step=1)]
            self.declare_parameter(name, default, d, ignore_override=not use_overrides)

    def state_label(self) -> str:
        return self._state_machine.current_state[1]

    # -------------------------------------------------------------- lifecycle
    def on_configure(self, state) -> TransitionCallbackReturn:
        if self.cfg is None:
            return ERROR
        try:
            self.driver = ReachDriver(self.cfg, on_state=self._publish_joints, on_event=self._log)
        except ValueError as e:
            self.error = str(e).splitlines()[0]
            self.get_logger().error(f"not configured: {self.error}")
            return ERROR
        if not self.driver.start().wait_ready(CONNECT_TIMEOUT_S):
            self.error = f"no verdict from the bus thread within {CONNECT_TIMEOUT_S:g} s"
            return ERROR
        if self.driver.state == FAULT:
            self.error = self.driver.reason
            return ERROR
        d = self.driver
        self.get_logger().info(f"configured: port {d.cfg.port}, policy {d.cfg.policy}, {d.rate:g} Hz, "
                               f"target frame '{d.runtime.frame}'")
        return SUCCESS

    # The callbacks below read `self.driver` once: Ctrl-C releases it from the main thread
    # while an executor thread may still be inside one of them.
    def on_activate(self, state) -> TransitionCallbackReturn:
        d = self.driver
        if d is None:
            return FAILURE
        ok, self.message = d.enable()
        return SUCCESS if ok else FAILURE

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        d = self.driver
        if d is None:
            return SUCCESS
        ok, self.message = d.disable()
        t_end = time.monotonic() + d.cfg.park_timeout_s + 2.0
        while d.state == PARKING and time.monotonic() < t_end:
            time.sleep(0.02)
        if d.state == DISABLED:
            self.message = d.reason
        return SUCCESS

    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._release()
        return SUCCESS

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self._release()
        return SUCCESS

    def on_error(self, state) -> TransitionCallbackReturn:
        self._release()
        self.get_logger().error(f"error processing, back to unconfigured: {self.error}")
        return SUCCESS

    def _release(self) -> None:
        driver, self.driver = self.driver, None
        if driver is not None:
            driver.on_state = lambda s: None
            driver.close()                         # parks if enabled, torque off, port closed

    def _follow_driver(self) -> None:
        """Keep the lifecycle state where the arm is: a fault turns torque off in the driver,
        and the node follows to inactive; enable_on_start enables it, and the node follows."""
        d = self.driver
        if d is None:
            return
        label, arm = self.state_label(), d.state
        if label == "active" and arm in (DISABLED, FAULT):
            self.trigger_deactivate()
        elif label == "inactive" and arm == ENABLED:
            self.trigger_activate()

    # -------------------------------------------------------------- ROS -> driver
    def _take_target(self) -> None:
        """The newest target message since the last call, if any (targets are coalesced)."""
        sub = self.targets
        with sub.handle:
            taken = sub.handle.take_message(sub.msg_type, sub.raw)
        if taken is not None:
            self._on_target(taken[0])

    def _on_target(self, msg: PointStamped) -> None:
        d = self.driver
        if d is None:
            self.get_logger().warn("target ignored: the node is not configured")
            return
        try:
            d.set_target([msg.point.x, msg.point.y, msg.point.z], msg.header.frame_id)
        except PolicyError as e:
            self.get_logger().warn(f"target refused: {e}")

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        d = self.driver
        if d is None:
            self.get_logger().warn("trajectory ignored: the node is not configured")
            return
        traj = Trajectory(list(msg.joint_names), [list(p.positions) for p in msg.points],
                          [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points])
        ok, text = d.follow(traj)
        (self.get_logger().info if ok else self.get_logger().warn)(text)

    def _enable(self, request, response):
        if self.state_label() == "unconfigured" and self.trigger_configure() != SUCCESS:
            return self._answer(response, False, f"not configured: {self.error}")
        if self.state_label() == "active":                      # a fault not followed yet: the driver decides
            return self._call(response, lambda d: d.enable())
        ok = self.trigger_activate() == SUCCESS
        return self._answer(response, ok, self.message)

    def _disable(self, request, response):
        if self.state_label() == "active":
            self.trigger_deactivate()
            return self._answer(response, True, self.message)
        return self._call(response, lambda d: d.disable())

    def _estop(self, request, response):
        return self._call(response, lambda d: d.estop())

    def _home(self, request, response):
        return self._call(response, lambda d: d.move_to("home"))

    def _park(self, request, response):
        return self._call(response, lambda d: d.move_to("park"))

    def _call(self, response, fn):
        driver = self.driver
        if driver is None:
            return self._answer(response, False, f"not configured: {self.error}")
        return self._answer(response, *fn(driver))

    @staticmethod
    def _answer(response, ok: bool, message: str):
        response.success, response.message = ok, message
        return response

    # -------------------------------------------------------------- driver -> ROS
    def _publish_joints(self, sample: JointSample) -> None:
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name, msg.position, msg.velocity = sample.names, sample.positions, sample.velocities
        self.joints.publish(msg)

    def _log(self, level: str, message: str) -> None:
        # One call site per severity: rclpy refuses a severity change at one call site.
        if level == "error":
            self.get_logger().error(message)
        elif level == "warn":
            self.get_logger().warn(message)
        else:
            self.get_logger().info(message)

    def _publish_diagnostics(self) -> None:
        msg = DiagnosticArray(status=self._statuses())
        msg.header.stamp = self.get_clock().now().to_msg()
        self.diag.publish(msg)

    def _statuses(self) -> list[DiagnosticStatus]:
        label = self.state_label()
        status = DiagnosticStatus(name="so_arm_policy: reach", hardware_id="so_arm101")
        driver = self.driver
        if driver is None:
            status.level, status.message = DiagnosticStatus.ERROR, f"not configured: {self.error}"
            status.values = [KeyValue(key="state", value="unconfigured"), KeyValue(key="lifecycle", value=label)]
            return [status]
        d = driver.diagnostics()
        status.hardware_id = driver.cfg.port
        status.level = DiagnosticStatus.ERROR if d["state"] == FAULT else DiagnosticStatus.OK
        status.message = f"{d['state']}: {d['reason']}"
        tick = d["tick"]
        values = {"state": d["state"], "lifecycle": label, "enabled": d["state"] == ENABLED, "rate_hz": d["rate_hz"],
                  "reconnects": d["reconnects"], "move": (d["move"] or {}).get("name", ""),
                  "ticks": tick["ticks"], "overruns": tick["overruns"],
                  "tick_ms_p50": round(tick["tick_ms_p50"], 3), "tick_ms_p99": round(tick["tick_ms_p99"], 3),
                  "tick_ms_max": round(tick["tick_ms_max"], 3), "read_failures": tick["read_failures"],
                  "write_failures": tick["write_failures"], "policy_errors": tick["policy_errors"],
                  "tripped": d["tripped"] or "", "target": d["target"] or "", "targets": d["targets"]}
        values.update({f"clamp.{k}": n for k, n in d["clamps"].items()})
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        out = [status]
        names = {c.id: n for n, c in driver.cal.items()}
        for sid, s in sorted(d["servos"].items()):
            faults = driver.safety.servo_faults(s["error_bits"], s["temperature_c"], s["voltage_v"])
            out.append(DiagnosticStatus(
                name=f"so_arm_policy: servo {sid} ({names.get(sid, '?')})", hardware_id=driver.cfg.port,
                level=DiagnosticStatus.ERROR if faults else DiagnosticStatus.OK,
                message=" and ".join(faults) or "ok",
                values=[KeyValue(key="temperature_c", value=str(s["temperature_c"])),
                        KeyValue(key="voltage_v", value=str(s["voltage_v"])),
                        KeyValue(key="load", value=str(s["load"])),
                        KeyValue(key="error_bits", value=f"0x{s['error_bits']:02x}")]))
        return out

    def close(self) -> None:
        """Park if enabled, torque off and release the port (Ctrl-C, SIGTERM)."""
        self._release()


def main(args=None) -> None:
    # The bus thread waits on the serial port many times a tick and must take the GIL back
    # after each wait; with the executor threads busy (a flood of target messages) every
    # take-back waited out the default 5 ms switch interval (docs/robot.md).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    rclpy.init(args=args)
    node = ReachNode()
    executor = MultiThreadedExecutor(num_threads=3)
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.close()
        node.get_logger().info("stopped; torque off")
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
