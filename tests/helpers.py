"""What several test modules share (imported as `tests.helpers`; fixtures live in conftest.py)."""

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from soarm.training.modules import PolicyCfg
from soarm.training.ppo import PPOCfg
from soarm.training.runner import RunCfg, TrainCfg


def tiny_cfg(iterations: int, **run) -> TrainCfg:
    """A training config that runs in a second: the code path of a real one."""
    return TrainCfg(
        run=RunCfg(num_envs=32, iterations=iterations, compile=False, save_every=2, eval_targets=0, **run),
        policy=PolicyCfg(actor_hidden=(32, 32), critic_hidden=(32, 32)),
        ppo=PPOCfg(num_steps=8, epochs=2, minibatches=2),
    )


def wait_until(pred, timeout: float = 5.0, every: float = 0.02) -> bool:
    """Poll `pred` until it holds (True) or `timeout` s pass (False): no fixed sleeps."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(every)
    return False


class SoarmRun:
    """`soarm run ARGS...` in a process of its own, started as a terminal starts it: SIGINT at
    its default, so `interrupt()` is a Ctrl-C (a shell without job control starts background
    jobs, pytest under CI's script say, with SIGINT ignored, and every child inherits that).
    Its stdout is collected line by line into `seen`."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "soarm.cli", "run", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.seen: list[str] = []

    def printed(self, words: str) -> bool:
        """Whether a line printed so far holds `words`."""
        while not self._lines.empty():
            self.seen.append(self._lines.get())
        return any(words in line for line in self.seen)

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


@contextlib.contextmanager
def calibrated_arm(robot, seed: int):
    """An emulated SO-101 calibrated by the scripted LeRobot procedure, its bus connected:
    yields (emulator, bus, calibration)."""
    from soarm.calibration.calibration import calibrate_emulated
    from soarm.robot.bus import FeetechBus
    from soarm.robot.emulator import ServoBusEmulator

    with ServoBusEmulator(seed=seed) as emu:
        bus = FeetechBus(emu.port, {n: i + 1 for i, n in enumerate(robot.names)})
        bus.connect()
        try:
            yield emu, bus, calibrate_emulated(emu, bus, robot)
        finally:
            bus.close()
