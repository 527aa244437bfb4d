import dataclasses

import numpy as np
import pytest

from soarm import CONFIG_DIR, config
from soarm.config import ConfigError
from soarm.reach import ReachCfg


def _write(tmp_path, text):
    p = tmp_path / "task.yaml"
    p.write_text(text)
    return p


def test_default_task_loads(task_cfg):
    assert task_cfg.substeps == 6 and task_cfg.episode_steps == 240 and task_cfg.window_steps == 60


@pytest.mark.parametrize("text, words", [
    ("control_hz: 30\nrewrd:\n  position_l2: 1\n", ["task.yaml", "rewrd"]),
    ("reward:\n  positon_l2: 1\n", ["task.yaml", "reward.positon_l2"]),
    ("control_hz: fast\n", ["task.yaml", "control_hz", "number"]),
    ("command:\n  radius: 0.3\n", ["task.yaml", "command.radius", "list"]),
    ("control_hz: [1\n", ["task.yaml", "malformed YAML"]),
    ("substeps: 0\n", ["task.yaml", "substeps"]),
    ("physics_dt: 0.0056\n", ["task.yaml", "unknown key 'physics_dt'"]),
])
def test_bad_task_config_is_one_line_error(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        config.load(ReachCfg, _write(tmp_path, text))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(ReachCfg, tmp_path / "nope.yaml")


def test_overrides_are_validated():
    cfg = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml", {"reward.position_l2": -2.0})
    assert cfg.reward.position_l2 == -2.0
    with pytest.raises(ConfigError, match="reward.nope"):
        config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml", {"reward.nope": 1})
    with pytest.raises(ConfigError, match="'control_hz' is 30.0, not a section"):
        config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml", {"control_hz.x": 1})


def test_a_dumped_config_loads_back_the_same(tmp_path):
    cfg = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml", {"action.max_relative_target": 0.3})
    assert config.load(ReachCfg, config.dump(cfg, tmp_path / "task.yaml")) == cfg


def test_train_overrides_reach_the_task_and_a_resumed_run_keeps_its_own(tmp_path):
    from soarm.training.train import DEFAULT_CONFIG, load_cfg

    cfg, task = load_cfg(DEFAULT_CONFIG, {"ppo.epochs": 3, "task.reward.joint_limit": -6.0}, None)
    assert cfg.ppo.epochs == 3 and task.reward.joint_limit == -6.0
    with pytest.raises(ConfigError, match="reward.nope"):
        load_cfg(DEFAULT_CONFIG, {"task.reward.nope": 1}, None)
    trained = config.dump(task, tmp_path / "task.yaml")
    resume = {"path": "model_5.pt", "cfg": dataclasses.asdict(cfg), "task": dataclasses.asdict(task)}
    _, resumed = load_cfg(DEFAULT_CONFIG, {"task.episode_s": 4.0}, resume)
    assert resumed.reward.joint_limit == -6.0 and resumed.episode_s == 4.0
    with pytest.raises(ConfigError, match="a resumed run keeps its task"):
        load_cfg(DEFAULT_CONFIG, {"task": str(trained)}, resume)


def test_each_physical_constant_is_defined_once():
    """The physics step, the control rate and the servo file are the task's (configs/task/
    reach.yaml, ReachCfg): no code holds a copy that could drift (the emulator once integrated
    at 0.0056 s while training stepped 1/180 s)."""
    import re

    from soarm import REPO_ROOT
    from soarm.calibration.windows import whole_logs
    from soarm.description import load_robot
    from soarm.logs import MotionLog
    from soarm.robot.emulator_physics import build_plant

    task = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")
    robot = load_robot()
    q0 = robot.home_pose.tolist()
    assert build_plant(robot, q0, False, "armsim", None).dt == task.physics_dt == 1 / 180
    t = np.arange(300) / 30
    goal = np.asarray(robot.home)[None] + 0.1 * np.sin(t)[:, None]
    log = MotionLog("x.mcap", list(robot.arm_joints), t, goal, goal, np.ones(300, dtype=bool), 30.0)
    assert whole_logs([log], robot, task.physics_dt).dt == task.physics_dt
    code = [p for d in ("soarm", "training", "export", "robot", "calibration", "ros2_ws", "benchmarks")
            for p in (REPO_ROOT / d).rglob("*.py")]
    for pattern, home_of in ((r"sts3215_7v4", "soarm/reach.py"), (r"0\.0056|1(\.0)? / 180\b", None),
                             (r"control_hz: float = ", "soarm/reach.py")):
        found = sorted(str(p.relative_to(REPO_ROOT)) for p in code if re.search(pattern, p.read_text()))
        assert found == ([home_of] if home_of else []), (pattern, found)
