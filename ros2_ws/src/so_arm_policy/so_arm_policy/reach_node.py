"""The reach node: ROS 2 wiring of soarm's ReachDriver, and nothing else.

    ros2 launch so_arm_policy reach.launch.py port:=/dev/ttyACM0 policy:=policy.onnx \
        calibration:=so101.json
    ros2 service call /enable std_srvs/srv/Trigger
    ros2 topic pub --once /target geometry_msgs/msg/PointStamped \
        "{header: {frame_id: base_link}, point: {x: 0.2, y: 0.0, z: 0.15}}"

Publishes  joint_states (sensor_msgs/JointState, rad, every tick),
           /diagnostics (diagnostic_msgs/DiagnosticArray, 1 Hz).
Subscribes target (geometry_msgs/PointStamped, robot base frame; others are refused).
Services   enable, disable, estop (std_srvs/Trigger).

Bad parameters, a policy that does not fit the arm or a calibration that does not match
the servos: one error line, and the node stays up but disabled (enable says why).
"""

from __future__ import annotations

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PointStamped
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from sensor_msgs.msg import JointState
from std_srvs.srv import Trigger

from so_arm_policy import params
from soarm.export.runtime import PolicyError
from soarm.robot.driver import ENABLED, FAULT, JointSample, ReachDriver


class ReachNode(Node):
    def __init__(self):
        super().__init__("so_arm_policy")
        self.driver: ReachDriver | None = None
        self.error = ""
        try:
            values = {name: self.declare_parameter(name, default, ParameterDescriptor(
                          description=text, dynamic_typing=isinstance(default, float))).value
                      for name, default, text in params.declarations()}
            # Keys in the parameter file that nothing declares: rclpy would drop them silently,
            # so they go to the config loader, which refuses an unknown key by name.
            values.update(params.undeclared(self._parameter_overrides, values))
            self.driver = ReachDriver(params.to_cfg(values), on_state=self._publish_joints, on_event=self._log)
        except (ValueError, ParameterException) as e:
            self.error = str(e).splitlines()[0]
            self.get_logger().error(f"not started, staying disabled: {self.error}")
        self.joints = self.create_publisher(JointState, "joint_states", 10)
        self.diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_subscription(PointStamped, "target", self._on_target, 10)
        for name, fn in (("enable", self._enable), ("disable", self._disable), ("estop", self._estop)):
            self.create_service(Trigger, name, fn)
        self.create_timer(1.0, self._publish_diagnostics)
        if self.driver is not None:
            self.driver.start()
            self.get_logger().info(f"port {self.driver.cfg.port}, policy {self.driver.cfg.policy}, "
                                   f"{self.driver.rate:g} Hz, target frame '{self.driver.runtime.frame}'")

    # ------------------------------------------------------------- ROS -> driver
    def _on_target(self, msg: PointStamped) -> None:
        if self.driver is None:
            self.get_logger().warn("target ignored: the node is not configured")
            return
        try:
            self.driver.set_target([msg.point.x, msg.point.y, msg.point.z], msg.header.frame_id)
        except PolicyError as e:
            self.get_logger().warn(f"target refused: {e}")

    def _enable(self, request, response):
        return self._call(response, lambda d: d.enable())

    def _disable(self, request, response):
        return self._call(response, lambda d: d.disable())

    def _estop(self, request, response):
        return self._call(response, lambda d: d.estop())

    def _call(self, response, fn):
        if self.driver is None:
            response.success, response.message = False, f"not configured: {self.error}"
        else:
            response.success, response.message = fn(self.driver)
        return response

    # ------------------------------------------------------------- driver -> ROS
    def _publish_joints(self, sample: JointSample) -> None:
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name, msg.position = sample.names, sample.positions
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
        status = DiagnosticStatus(name="so_arm_policy: reach", hardware_id="so_arm101")
        if self.driver is None:
            status.level, status.message = DiagnosticStatus.ERROR, f"not configured: {self.error}"
        else:
            d = self.driver.diagnostics()
            status.hardware_id = self.driver.cfg.port
            status.level = DiagnosticStatus.ERROR if d["state"] == FAULT else DiagnosticStatus.OK
            status.message = f"{d['state']}: {d['reason']}"
            tick = d["tick"]
            values = {"state": d["state"], "enabled": d["state"] == ENABLED, "rate_hz": d["rate_hz"],
                      "reconnects": d["reconnects"],
                      "ticks": tick["ticks"], "overruns": tick["overruns"],
                      "tick_ms_p50": round(tick["tick_ms_p50"], 3), "tick_ms_p99": round(tick["tick_ms_p99"], 3),
                      "tick_ms_max": round(tick["tick_ms_max"], 3), "read_failures": tick["read_failures"],
                      "write_failures": tick["write_failures"], "policy_errors": tick["policy_errors"],
                      "tripped": d["tripped"] or "", "target": d["target"] or ""}
            values.update({f"clamp.{k}": n for k, n in d["clamps"].items()})
            for sid, s in d["servos"].items():
                values.update({f"servo{sid}.temperature_c": s["temperature_c"],
                               f"servo{sid}.voltage_v": s["voltage_v"], f"servo{sid}.error_bits": s["error_bits"]})
            status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self.diag.publish(msg)

    def close(self) -> None:
        """Torque off and stop the bus thread (on shutdown, Ctrl-C, SIGTERM)."""
        if self.driver is not None:
            self.driver.on_state = lambda s: None      # nothing to publish to any more
            self.driver.close()


def main(args=None) -> None:
    rclpy.init(args=args)
    node = ReachNode()
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.close()
        node.get_logger().info("stopped; torque off")
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
