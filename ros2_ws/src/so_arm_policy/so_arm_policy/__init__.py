"""ROS 2 wiring of the soarm robot layer: the reach node and its launch file."""
