import importlib.util

import pytest
import torch

from soarm import CONFIG_DIR, config
from soarm.description import load_robot
from soarm.dynamics import ArmDynamics
from soarm.reach import ReachCfg

torch.set_num_threads(1)

# tests/isaac_backend/ runs inside the Isaac Lab venv (Python 3.12), started by test_isaaclab.py.
collect_ignore = [] if importlib.util.find_spec("isaaclab") else ["isaac_backend"]


@pytest.fixture(scope="session")
def robot():
    return load_robot()


@pytest.fixture(scope="session")
def dyn64(robot):
    return ArmDynamics(robot, dtype=torch.float64)


@pytest.fixture(scope="session")
def task_cfg():
    return config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory):
    """A small exported policy (2 PPO iterations): the contract and the code path of a real one."""
    from soarm.export.exporter import export
    from soarm.training.runner import Runner
    from tests.helpers import tiny_cfg

    root = tmp_path_factory.mktemp("policy")
    Runner(tiny_cfg(2), root / "run", progress=False).learn()
    export(root / "run", root / "policy.onnx", verify_count=1000)
    return root / "policy.onnx"



def pytest_collection_modifyitems(config, items):
    """SOARM_TEST_ORDER=reverse runs the tests in reverse order (tests/under_load.py uses it:
    no test may depend on another having run first)."""
    import os

    if os.environ.get("SOARM_TEST_ORDER") == "reverse":
        items.reverse()
