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


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory):
    """A small exported policy (2 PPO iterations): the contract and the code path of a real one."""
    from soarm.export.exporter import export
    from soarm.training.runner import Runner
    from test_runner import tiny_cfg

    root = tmp_path_factory.mktemp("policy")
    Runner(tiny_cfg(2), root / "run", progress=False).learn()
    export(root / "run", root / "policy.onnx", verify_count=1000)
    return root / "policy.onnx"


def calibrate_emulated(emu, bus, robot):
    """LeRobot's procedure on the emulated arm, the operator's moves scripted."""
    from soarm.calibration.calibration import calibrate

    names = list(robot.names)
    lo, hi = robot.lower, robot.upper
    path = [[0.0] * len(names)] + [[lo[j] * f if f > 0 else hi[j] * -f for j in range(len(names))]
                                   for f in (0.5, 1.0, -0.5, -1.0)] + [[0.0] * len(names)]
    step = iter(range(len(path) * 3))

    def sweep_done():
        k = next(step)
        emu.place(path[min(k // 3, len(path) - 1)])
        return k >= len(path) * 3 - 1

    return calibrate(bus, names, confirm=lambda msg: emu.place([0.0] * len(names)), sweep_done=sweep_done,
                     log=lambda msg: None)
