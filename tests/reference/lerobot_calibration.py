"""A calibration file as LeRobot writes it for an SO-101 follower (its `so_follower` procedure:
half-turn homing, swept ranges, the wrist roll recorded 0..4095)."""

LEROBOT_SO101 = {
    "shoulder_pan": {"id": 1, "drive_mode": 0, "homing_offset": -1470, "range_min": 758, "range_max": 3292},
    "shoulder_lift": {"id": 2, "drive_mode": 0, "homing_offset": 153, "range_min": 815, "range_max": 3226},
    "elbow_flex": {"id": 3, "drive_mode": 0, "homing_offset": 1368, "range_min": 869, "range_max": 3059},
    "wrist_flex": {"id": 4, "drive_mode": 0, "homing_offset": -1470, "range_min": 859, "range_max": 3158},
    "wrist_roll": {"id": 5, "drive_mode": 0, "homing_offset": 1140, "range_min": 0, "range_max": 4095},
    "gripper": {"id": 6, "drive_mode": 0, "homing_offset": 1250, "range_min": 2019, "range_max": 3475},
}
