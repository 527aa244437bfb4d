"""LeRobot-compatible SO-101 calibration and the ticks <-> joint radians mapping."""
