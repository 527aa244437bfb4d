"""`soarm arm-check`: how far a model of the arm is from the arm, on logs of the arm's own motion.

The open-loop replay of each log: the plant starts at rest at the log's first measured pose,
the logged goals drive the five arm joints (each reaching its servo when the log says; the
gripper holds), and the plant's encoder reading of each joint is compared with the arm's at
the moment that joint was read. One line per log, its mean over the joints and each joint's
RMS error (mrad), then the mean over the logs:

    soarm arm-check data/sage_so101/*                     # the project's default model of the arm
    soarm arm-check LOG... --arm nominal                  # the servo model, no identification
    soarm arm-check LOG... --arm runs/sysid/mine/arm.yaml --out report.json --plot plots/
    soarm arm-check ~/.cache/huggingface/lerobot/me/my_dataset   # a LeRobot dataset: each episode
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from soarm import CONFIG_DIR, config
from soarm.arm_params import ArmParams, load_arm
from soarm.calibration.calibration import range_mode
from soarm.calibration.sysid import Candidates, nominal, replay_rms
from soarm.calibration.windows import Windows, as_recorded, whole_logs
from soarm.description import RobotDescription, load_robot
from soarm.files import atomic_write
from soarm.logs import read_motions
from soarm.reach import ReachCfg
from soarm.servo import ServoConfig

NOMINAL = "nominal"


@dataclass
class ArmCheckCfg:
    arm: str | None = None         # an arm file; "nominal": the servo model alone; default: the task's arm
    task: Path = CONFIG_DIR / "task" / "reach.yaml"   # its physics step, servo model and default arm
    out: Path | None = None        # a JSON report: per log and joint, RMS and the replayed traces' summary
    plot: Path | None = None       # a folder: one PNG per log, model against arm per joint
    compile: bool = False          # torch.compile the physics (pays off from a few minutes of logs)
    # A LeRobot dataset recorded with use_degrees off (-100..100 per joint): the calibration
    # file it was recorded with. Default: LeRobot 0.6's degrees.
    lerobot_calibration: Path | None = None


@dataclass
class Check:
    """Per log, per arm joint: RMS of model minus arm (mrad)."""
    names: list[str]
    joints: list[str]
    rms_mrad: np.ndarray           # [S, A]
    arm: str                       # what was checked

    @property
    def per_log(self) -> np.ndarray:
        return self.rms_mrad.mean(axis=1)

    def lines(self) -> list[str]:
        rows = [f"{n} {m:.2f} " + " ".join(f"{x:.2f}" for x in r)
                for n, m, r in zip(self.names, self.per_log, self.rms_mrad)]
        return rows + [f"mean {float(self.per_log.mean()):.2f}"]


def the_arm(spec: str | None, task: ReachCfg, robot: RobotDescription) -> tuple[ArmParams | None, str]:
    """(the arm to check or None for the bare servo model, its name) from `--arm`."""
    if spec == NOMINAL or (spec is None and task.arm is None):
        return None, f"{NOMINAL} ({task.servo})"
    path = spec if spec is not None else task.arm
    return load_arm(path, robot, task.servo), str(path)


def check(windows: Windows, arm: ArmParams | None, robot: RobotDescription, servo: ServoConfig, substeps: int,
          compile: bool = False) -> tuple[np.ndarray, torch.Tensor]:
    """(RMS [S, A] mrad, the readings [S, K, A] of the better end of the play per joint)."""
    cand = nominal(len(robot.arm_joints), servo.params) if arm is None else \
        Candidates.of(arm, robot, servo.params, substeps)
    rms, readings = replay_rms(windows, cand, robot, servo, compile)
    return rms.numpy(), readings


def arm_check(logs: list[Path], cfg: ArmCheckCfg, say: Callable[[str], None] = print,
              progress: Callable[[str], None] = lambda line: None) -> Check:
    """`soarm arm-check`: the table (through `say`), the report and the plots."""
    task = config.load(ReachCfg, cfg.task)
    robot = load_robot()
    arm, what = the_arm(cfg.arm, task, robot)
    to_rad = None if cfg.lerobot_calibration is None else range_mode(cfg.lerobot_calibration)
    motions = [m for p in logs for m in read_motions(p, to_rad)]      # a LeRobot dataset: each episode
    servo = as_recorded(config.load(ServoConfig, CONFIG_DIR / task.servo), motions)
    windows = whole_logs(motions, robot, task.physics_dt)
    progress(f"arm-check: {len(motions)} log(s), {float(sum(m.t[-1] for m in motions)):.0f} s of motion, "
             f"model: {what}; columns: log, mean, " + " ".join(robot.arm_joints) + " (RMS, mrad)")
    rms, readings = check(windows, arm, robot, servo, task.substeps, cfg.compile)
    result = Check([Path(m.source).name for m in motions], list(robot.arm_joints), rms, what)
    for line in result.lines():
        say(line)
    if cfg.out is not None:
        report = {"arm": what, "logs": [m.source for m in motions], "joints": result.joints,
                  "rms_mrad": {n: dict(zip(result.joints, map(float, r))) for n, r in zip(result.names, rms)},
                  "mean_mrad": float(result.per_log.mean())}
        atomic_write(cfg.out, lambda tmp: tmp.write_text(json.dumps(report, indent=1) + "\n"))
    if cfg.plot is not None:
        for s, name in enumerate(result.names):
            plot(windows, readings, s, result, Path(cfg.plot) / f"{name}.png")
    return result


def plot(w: Windows, readings: torch.Tensor, s: int, result: Check, path: Path) -> Path:
    """One panel per arm joint: the arm's reading and the model's over the log, its error below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = w.valid[s]
    A = len(result.joints)
    fig, axes = plt.subplots(A, 1, figsize=(10, 1.9 * A), sharex=True, squeeze=False)
    for j, (ax, name) in enumerate(zip(axes[:, 0], result.joints)):
        t = (w.at[s][k, j] * w.dt).numpy()
        arm, model = w.measured[s, k, j].numpy(), readings[s, k, j].numpy()
        ax.plot(t, arm, "k", lw=1.0, label="arm")
        ax.plot(t, model, "tab:blue", lw=0.8, label=f"model ({result.rms_mrad[s, j]:.1f} mrad RMS)")
        ax.set_ylabel(f"{name}\n(rad)", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
        err = ax.twinx()
        err.plot(t, 1000 * (model - arm), "tab:red", lw=0.5, alpha=0.6)
        err.set_ylabel("model - arm\n(mrad)", fontsize=7, color="tab:red")
    axes[-1, 0].set_xlabel("s")
    fig.suptitle(f"{result.names[s]}: {result.arm}", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=80, format="png"))
    plt.close(fig)
    return path

