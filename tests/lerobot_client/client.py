"""LeRobot 0.6.1's own SO-101 follower against `soarm emulate`, run in LeRobot's venv
(tests/lerobot_client/setup.sh) by tests/test_lerobot_client.py; stdin is the person at the
keyboard (Enter, or 'c' to recalibrate), as in `lerobot-calibrate`. Prints one JSON line.

    python client.py PORT CALIBRATION_DIR connect        # the file's calibration, then read and hold
    python client.py PORT CALIBRATION_DIR recalibrate    # LeRobot's calibration procedure again
    python client.py PORT CALIBRATION_DIR setup          # lerobot-setup-motors: one motor at a time
    python client.py PORT CALIBRATION_DIR record         # a LeRobot dataset (CALIBRATION_DIR/dataset)
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
    elif mode == "record":
        robot.connect(calibrate=False)
        out.update(record(robot, cal_dir / "dataset"))
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


def record(robot, root: Path, episodes: int = 2, seconds: float = 4.0, fps: int = 30, reset_s: float = 1.5) -> dict:
    """What `lerobot-record` does each frame, with sine waves for a teleoperator: read the
    joints, send the action, add both to the dataset (LeRobot's own dataset code), at `fps`;
    between episodes the arm goes back to where it started, unrecorded."""
    import math
    import time

    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.utils.feature_utils import build_dataset_frame, hw_to_dataset_features

    features = {**hw_to_dataset_features(robot.action_features, "action", use_video=False),
                **hw_to_dataset_features(robot.observation_features, "observation", use_video=False)}
    dataset = LeRobotDataset.create("soarm/emulated_so101", fps, features, root=root, robot_type=robot.name,
                                    use_videos=False)
    start = robot.get_observation()
    first = None
    for _ in range(episodes):
        t_next = t0 = time.perf_counter()
        for k in range(round(seconds * fps)):
            obs = robot.get_observation()
            t = k / fps
            action = {f"{m}.pos": start[f"{m}.pos"] + 15.0 * min(t, 1.0) * math.sin(2 * math.pi * (0.3 + 0.1 * i) * t)
                      for i, m in enumerate(ARM)}
            action["gripper.pos"] = start["gripper.pos"]
            robot.send_action(action)
            dataset.add_frame({**build_dataset_frame(dataset.features, obs, prefix="observation"),
                               **build_dataset_frame(dataset.features, action, prefix="action"), "task": "sines"})
            if first is None:
                first = {"observation": [obs[f"{m}.pos"] for m in ARM], "action": [action[f"{m}.pos"] for m in ARM]}
            t_next += 1.0 / fps
            time.sleep(max(0.0, t_next - time.perf_counter()))
        dataset.save_episode()
        late = time.perf_counter() - t0 - seconds
        robot.send_action({f"{m}.pos": start[f"{m}.pos"] for m in (*ARM, "gripper")})
        time.sleep(reset_s)                    # the reset between episodes, not recorded
    dataset.finalize()
    return {"first": first, "late_s": late}


if __name__ == "__main__":
    main()
