"""LeRobot 0.6.1's own SO-101 follower against `soarm emulate`, run in LeRobot's venv
(tests/lerobot_client/setup.sh) by tests/test_lerobot_client.py; stdin is the person at the
keyboard (Enter, or 'c' to recalibrate), as in `lerobot-calibrate`. Prints one JSON line.

    python client.py PORT CALIBRATION_DIR connect        # the file's calibration, then read and hold
    python client.py PORT CALIBRATION_DIR recalibrate    # LeRobot's calibration procedure again
    python client.py PORT CALIBRATION_DIR setup          # lerobot-setup-motors: one motor at a time
"""

import json
import sys
from pathlib import Path

from lerobot.robots.so_follower import SO101Follower, SO101FollowerConfig

ARM = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll")


def main() -> None:
    port, cal_dir, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    robot = SO101Follower(SO101FollowerConfig(port=port, id="arm", calibration_dir=cal_dir))
    out = {}
    if mode == "connect":
        robot.connect(calibrate=True)          # a file unlike the servos': LeRobot asks, Enter writes it
        out["pinged"] = {str(k): v for k, v in (robot.bus.broadcast_ping() or {}).items()}
        out["is_calibrated"] = robot.is_calibrated
        obs = robot.get_observation()
        out["degrees"] = {m: obs[f"{m}.pos"] for m in ARM}
        out["ticks"] = robot.bus.sync_read("Present_Position", list(ARM), normalize=False)
        sent = robot.send_action({f"{m}.pos": obs[f"{m}.pos"] for m in (*ARM, "gripper")})
        out["sent"] = len(sent)
        out["registers"] = {r: robot.bus.read(r, "gripper", normalize=False)
                            for r in ("Max_Torque_Limit", "Protection_Current", "Overload_Torque")}
    elif mode == "setup":
        # lerobot-setup-motors' own steps; each prompt ends its line, so the test sees it whole.
        import builtins
        ask = builtins.input
        builtins.input = lambda prompt="": (print(prompt, flush=True), ask())[1]
        robot.setup_motors()
        out["ids"] = {m: robot.bus.motors[m].id for m in robot.bus.motors}
        robot.bus.disconnect(disable_torque=False)
        print(json.dumps(out))
        return
    else:
        robot.connect(calibrate=False)
        robot.calibrate()                      # 'c': the whole procedure, the emulated operator at the arm
        out["is_calibrated"] = robot.is_calibrated
    robot.disconnect()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
