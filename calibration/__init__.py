"""Fit the model to my arm: LeRobot's joint calibration (and the one ticks <-> radians mapping),
the excitation, identification, the servo bench fit and the transfer suite."""
