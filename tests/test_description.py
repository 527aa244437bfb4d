import numpy as np
import pytest
import torch

from soarm.config import ConfigError
from soarm.description import load_robot

LIMITS = {"shoulder_pan": (-1.91986, 1.91986), "shoulder_lift": (-1.74533, 1.74533),
          "elbow_flex": (-1.69, 1.69), "wrist_flex": (-1.65806, 1.65806),
          "wrist_roll": (-2.74385, 2.84121), "gripper": (-0.174533, 1.74533)}


def test_reference_points_at_zero(robot, dyn64):
    q = torch.zeros(1, 6, dtype=torch.float64)
    R, p = dyn64.fk(q)
    assert np.allclose(p[0, robot.index("wrist_roll")].numpy(), [0.2932, -0.0002, 0.2344], atol=6e-5)
    assert np.allclose(dyn64.fingertip(q)[0].numpy(), [0.3914, 0.0000, 0.2265], atol=6e-5)


def test_joint_limits_and_order(robot):
    assert robot.names == list(LIMITS)
    for j in robot.joints:
        assert (j.lower, j.upper) == pytest.approx(LIMITS[j.name])
    assert robot.arm_joints == ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll")


def _copy(tmp_path, urdf_edit=None, yaml_edit=None):
    from soarm import CONFIG_DIR
    urdf = (CONFIG_DIR / "robot" / "so101.urdf").read_text()
    meta = (CONFIG_DIR / "robot" / "so101.yaml").read_text()
    (tmp_path / "so101.urdf").write_text(urdf_edit(urdf) if urdf_edit else urdf)
    (tmp_path / "so101.yaml").write_text(yaml_edit(meta) if yaml_edit else meta)
    return tmp_path / "so101.yaml"


@pytest.mark.parametrize("edit, words", [
    (lambda u: u.replace('<mass value="0.103"/>', '<mass value="heavy"/>'), ["so101.urdf", "upper_arm_link", "mass"]),
    (lambda u: u.replace('lower="-1.69" upper="1.69"', 'lower="1.69" upper="-1.69"'),
     ["so101.urdf", "elbow_flex", "limit"]),
    (lambda u: u.replace("</robot>", ""), ["so101.urdf", "malformed"]),
    (lambda u: u.replace('<axis xyz="0 0 1"/>', '<axis xyz="1 0 0"/>', 1), ["so101.urdf", "shoulder_pan", "axis"]),
])
def test_malformed_urdf_names_file_and_field(tmp_path, edit, words):
    with pytest.raises(ConfigError) as e:
        load_robot(_copy(tmp_path, urdf_edit=edit))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.replace("home: [0.0, -0.6, 0.6, 0.9, 0.0]", "home: [0.0]"), ["so101.yaml", "home"]),
    (lambda m: m.replace("wrist_roll]", "wrist_rol]"), ["so101.yaml", "wrist_rol"]),
    (lambda m: m + "\nextra: 1\n", ["so101.yaml", "extra"]),
])
def test_malformed_yaml_names_file_and_field(tmp_path, edit, words):
    with pytest.raises(ConfigError) as e:
        load_robot(_copy(tmp_path, yaml_edit=edit))
    assert all(w in str(e.value) for w in words), str(e.value)
