import pytest
import torch

from soarm import CONFIG_DIR, config
from soarm.description import load_robot
from soarm.dynamics import ArmDynamics
from soarm.reach import ReachCfg

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def robot():
    return load_robot()


@pytest.fixture(scope="session")
def dyn64(robot):
    return ArmDynamics(robot, dtype=torch.float64)


@pytest.fixture(scope="session")
def task_cfg():
    return config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")
