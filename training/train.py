"""Entry point of the training stage: `soarm train` (single process or under torchrun).

    soarm train                                   # configs/train/reach.yaml
    soarm train --iterations 50 --num-envs 1024 --set ppo.entropy_coef=0.01
    soarm train --resume runs/reach/latest --iterations 400
    soarm train --set task.action.max_relative_target=0.3 --set task.reward.joint_limit=-6
    soarm train --set run.processes=1              # one process (CPU threads: run.threads)
    torchrun --nproc_per_node=2 -m soarm.cli train --device cuda

Writes runs/<name>/<time>/ (TensorBoard events, metrics.jsonl, training.png, model_N.pt,
eval.json, task.yaml: the task as trained) and points runs/<name>/latest at it.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch

from soarm import CONFIG_DIR, REPO_ROOT, config
from soarm.reach import ReachCfg
from soarm.training import checkpoint, workers
from soarm.training.evaluate import evaluate, summary, write_report
from soarm.training.runner import Runner, TrainCfg, close_distributed

DEFAULT_CONFIG = CONFIG_DIR / "train" / "reach.yaml"


def load_cfg(path: Path, overrides: dict[str, Any], resume: dict | None) -> tuple[TrainCfg, ReachCfg]:
    """The run's config and its task: from the YAML files, or a resumed run's own (the task as
    it trained, whatever its file says now); CLI overrides on top. `task.KEY` overrides go to
    the task, `task=FILE` picks another task file."""
    task_set = {k.removeprefix("task."): v for k, v in overrides.items() if k.startswith("task.")}
    own = {k: v for k, v in overrides.items() if not k.startswith("task.")}
    if resume is None:
        cfg = config.load(TrainCfg, path, own)
        return cfg, config.load(ReachCfg, CONFIG_DIR / cfg.task, task_set)
    if "task" in own:
        raise config.ConfigError("--set task: a resumed run keeps its task; change its keys with --set task.KEY=VALUE")
    raw, task_raw = copy.deepcopy(resume["cfg"]), copy.deepcopy(resume["task"])
    for key, value in own.items():
        config._set_dotted(raw, key, value)
    for key, value in task_set.items():
        config._set_dotted(task_raw, key, value)
    return (config.from_dict(TrainCfg, raw, f"{resume['path']} (config)"),
            config.from_dict(ReachCfg, task_raw, f"{resume['path']} (task)"))


def run_dir_for(cfg: TrainCfg, resume: dict | None) -> Path:
    if resume is not None:
        return Path(resume["path"]).resolve().parent
    root = REPO_ROOT / cfg.run.out_dir / cfg.run.name
    return root / time.strftime("%Y-%m-%d_%H-%M-%S")


def point_latest(run_dir: Path) -> None:
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / ".latest.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def train(config_path: Path, overrides: dict[str, Any], resume_path: Path | None = None,
          progress: bool = True, run_dir: Path | None = None) -> dict:
    """One training run; with run.processes > 1 on a CPU, in that many worker processes
    (training/workers.py), each of which runs this function again."""
    resume = checkpoint.load(resume_path) if resume_path is not None else None
    cfg, task = load_cfg(config_path, overrides, resume)
    run_dir = run_dir or run_dir_for(cfg, resume)
    if workers.wanted(cfg.run):
        return workers.run(train, cfg.run.processes, config_path, overrides, resume_path, progress, run_dir)
    t0 = time.time()
    runner = Runner(cfg, run_dir, resume, progress=progress, task=task)
    main = runner.dist.main
    if main:
        start = f"resuming at iteration {runner.iteration}" if resume else "starting"
        print(f"train: {start}; {runner.num_envs} envs x {runner.dist.world} process(es) on {runner.device}, "
              f"{cfg.run.iterations} iterations of {cfg.ppo.num_steps} steps -> {run_dir}")
        print(f"train: set-up (env, compile) took {time.time() - t0:.0f} s")
        if resume is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            point_latest(run_dir)
        config.dump(task, run_dir / "task.yaml")         # the task as trained: --set task=<this file>
    last = runner.learn()
    out = {"run_dir": str(run_dir), "iterations": runner.iteration, "env_steps": runner.total_steps,
           "train_wall_s": runner.elapsed, "last_iteration": last}
    if main:
        print(f"train: {runner.iteration} iterations, {runner.total_steps / 1e6:.1f} M env steps "
              f"in {runner.elapsed:.0f} s of training ({time.time() - t0:.0f} s with set-up); "
              f"curves {run_dir / 'training.png'}")
        if cfg.run.eval_targets:
            policy = runner.model.eval().act_deterministic
            with torch.no_grad():
                result = evaluate(policy, runner.task, targets=cfg.run.eval_targets, progress=progress,
                                  device=runner.device)
            result.update(policy=str(checkpoint.resolve(run_dir)), wall_s=time.time() - t0)
            write_report(result, run_dir / "eval.json")
            print(f"evaluate: {summary(result)}  [report {run_dir / 'eval.json'}]")
            out["eval"] = result
    close_distributed()
    return out
