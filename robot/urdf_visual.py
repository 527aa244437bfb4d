"""The URDF the ROS node publishes on `robot_description`: ours with simple visual geometry.

Our URDF is mesh-free (kinematics and inertias only), so RViz would show nothing. Each link
gets a box where its servo sits (the STS3215's case) and a cylinder from its origin to each
joint it carries (and to the fingertip), so the links are as long as the published model's.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np

from soarm.description import RobotDescription

SERVO_BOX = (0.0452, 0.0247, 0.035)    # m, STS3215 case (Feetech datasheet: 45.2 x 24.7 x 35 mm)
LINK_RADIUS = 0.012                    # m
COLOURS = {"servo": (0.1, 0.1, 0.1, 1.0), "link": (0.95, 0.75, 0.1, 1.0)}


def robot_description(robot: RobotDescription) -> str:
    """The URDF text with a <visual> per piece of geometry."""
    root = ET.parse(robot.urdf).getroot()
    for name, rgba in COLOURS.items():              # declared first, as urdfdom reads them
        material = ET.Element("material", name=name)
        ET.SubElement(material, "color", rgba=" ".join(f"{v:g}" for v in rgba))
        root.insert(0, material)
    links = {link.get("name"): link for link in root.findall("link")}
    carried: dict[str, list[np.ndarray]] = {name: [] for name in links}
    for j in robot.joints:
        parent = robot.base_link if j.parent < 0 else robot.joints[j.parent].link
        carried[parent].append(np.asarray(j.xyz, dtype=float))
    carried[robot.joints[robot.fingertip_body].link].append(np.asarray(robot.fingertip_xyz, dtype=float))
    servo_links = {j.link for j in robot.joints} | {robot.base_link}
    for name, link in links.items():
        if name in servo_links:
            _visual(link, "box", {"size": " ".join(f"{v:g}" for v in SERVO_BOX)}, np.zeros(3), (0, 0, 0), "servo")
        for v in carried[name]:
            length = float(np.linalg.norm(v))
            if length < 1e-3:
                continue
            pitch = math.atan2(math.hypot(v[0], v[1]), v[2])       # the cylinder's axis (+z) onto v
            yaw = math.atan2(v[1], v[0])
            _visual(link, "cylinder", {"radius": f"{LINK_RADIUS:g}", "length": f"{length:.6g}"}, v / 2,
                    (0.0, pitch, yaw), "link")
    return ET.tostring(root, encoding="unicode")


def _visual(link: ET.Element, shape: str, attrs: dict, xyz: np.ndarray, rpy, material: str) -> None:
    visual = ET.Element("visual")
    ET.SubElement(visual, "origin", xyz=" ".join(f"{v:.6g}" for v in xyz), rpy=" ".join(f"{v:.6g}" for v in rpy))
    ET.SubElement(ET.SubElement(visual, "geometry"), shape, attrs)
    ET.SubElement(visual, "material", name=material)
    link.insert(0, visual)
