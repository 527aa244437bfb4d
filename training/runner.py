"""The training loop: rollouts, PPO updates, logging, checkpoints, resume, multi-process.

    Runner(cfg, run_dir).learn()

One process per device; under `torchrun` each process runs its own environments and the
PPO update averages gradients, KL and normalizer statistics over all of them (NCCL on
GPUs, gloo on CPU). Rank 0 logs and writes checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from soarm import CONFIG_DIR, REPO_ROOT, config
from soarm.reach import ReachCfg
from soarm.training import checkpoint, workers
from soarm.training.env import ReachEnv
from soarm.training.modules import ActorCritic, PolicyCfg
from soarm.training.ppo import PPO, PPOCfg
from soarm.files import atomic_write


@dataclass
class RunCfg:
    # Environments of the run. With `processes` > 1 on a CPU they are split evenly over that many
    # worker processes (training/workers.py); under torchrun, this many per process.
    num_envs: int = 4096
    processes: int = 1                   # CPU worker processes of one run (gloo); ignored on CUDA
    iterations: int = 400
    seed: int = 0
    device: str = "cpu"
    sim: str = "embedded"                # embedded (soarm/sim.py) | isaaclab (Isaac Lab 3 + Newton)
    threads: int = 0                     # torch CPU threads in all; 0 = one per core
    compile: bool = True
    save_every: int = 50                 # iterations between checkpoints (and one at the end)
    print_every: int = 10                # iterations between summary lines
    eval_targets: int = 512              # evaluation at the end; 0 skips it
    out_dir: str = "runs"                # relative to the repository
    name: str = "reach"

    def validate(self) -> None:
        if min(self.num_envs, self.iterations, self.save_every, self.print_every, self.processes) < 1:
            raise ValueError("run.num_envs/iterations/save_every/print_every/processes: must be at least 1")
        if self.num_envs % self.processes:
            raise ValueError(f"run.num_envs: {self.num_envs} environments do not split evenly over "
                             f"run.processes {self.processes}")
        if self.sim not in ("embedded", "isaaclab"):
            raise ValueError(f"run.sim: '{self.sim}', expected 'embedded' or 'isaaclab'")

    @property
    def cpu_workers(self) -> bool:
        """Whether the run is split over its own CPU worker processes: more than one asked for,
        on a CPU, for the embedded simulator (Isaac Lab runs its own)."""
        return self.processes > 1 and self.device == "cpu" and self.sim == "embedded"

    def local_envs(self, world: int) -> int:
        """This process's environments: its share where the run's own CPU workers split them."""
        return self.num_envs // world if self.cpu_workers else self.num_envs


@dataclass
class TrainCfg:
    task: str = "task/reach.yaml"        # relative to configs/
    run: RunCfg = field(default_factory=RunCfg)
    policy: PolicyCfg = field(default_factory=PolicyCfg)
    ppo: PPOCfg = field(default_factory=PPOCfg)


class TrainingDiverged(RuntimeError):
    pass


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    group: object = None

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> tuple[Dist, str]:
    """Join the torchrun process group if there is one; NCCL for CUDA, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank, world, torch.distributed.group.WORLD), device


def close_distributed() -> None:
    """Leave the process group together (rank 0 may still be evaluating or saving) and
    destroy it."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


class PhaseTimer:
    """Seconds spent per phase; CUDA events on a GPU, so timing never syncs mid-iteration."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def laps(self) -> list[float]:
        """Seconds between consecutive marks; clears them."""
        m, self.marks = self.marks, []
        if self.cuda:
            m[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:])]
        return [b - a for a, b in zip(m, m[1:])]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def isaaclab_env(task: ReachCfg, num_envs: int, device: str, seed: int):
    """The Isaac Lab backend, or a one-line ConfigError that says how to get it."""
    import sys

    try:
        from soarm.training.isaac.vec_env import IsaacReachEnv
    except ImportError as e:
        raise config.ConfigError(
            f"run.sim: isaaclab needs Isaac Lab 3 (Python 3.12) and cannot import it here "
            f"(Python {sys.version_info.major}.{sys.version_info.minor}: {e.name or e}); "
            "set it up with `make isaaclab` and run .venv-isaaclab/bin/soarm train --sim isaaclab") from None
    import tempfile

    task_file = config.dump(task, Path(tempfile.mkdtemp(prefix="soarm-task-")) / "task.yaml")
    return IsaacReachEnv(str(task_file), num_envs, device, seed)


class Runner:
    def __init__(self, cfg: TrainCfg, run_dir: Path, resume: dict | None = None, progress: bool = True,
                 task: ReachCfg | None = None):
        """`task`: the task to train (default: cfg.task's file, or a resumed run's own task)."""
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.dist, device = init_distributed(cfg.run.device)
        self.device = torch.device(device)
        if self.dist.world > 1 and cfg.run.cpu_workers:
            if cfg.run.processes != self.dist.world:
                raise config.ConfigError(f"run.processes: {cfg.run.processes} worker processes in a group of "
                                         f"{self.dist.world} (under torchrun, set run.processes=1)")
            torch.set_num_threads(workers.threads_per_worker(cfg.run.threads, cfg.run.processes))
        elif cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.num_envs = cfg.run.local_envs(self.dist.world)
        seed = cfg.run.seed + 1000 * self.dist.rank
        torch.manual_seed(seed)
        if task is None:
            task = checkpoint.task_cfg(resume) if resume is not None else config.load(ReachCfg, CONFIG_DIR / cfg.task)
        self.task = task
        if cfg.run.sim == "isaaclab":
            self.env = isaaclab_env(task, self.num_envs, device, seed)
        else:
            self.env = ReachEnv(self.task, self.num_envs, device=device, seed=seed, check_actions=False)
            if cfg.run.compile:
                self.env.sim.compile()
        self.model = ActorCritic(self.env.num_obs, self.env.num_actions, cfg.policy,
                                 self.env.num_privileged).to(self.device)
        if self.dist.world > 1:
            for t in self.model.state_dict().values():
                torch.distributed.broadcast(t, src=0)
        self.ppo = PPO(self.model, cfg.ppo, self.num_envs, self.device, compile=cfg.run.compile,
                       group=self.dist.group)
        self.iteration, self.total_steps, self.elapsed = 0, 0, 0.0
        self.commit = git_commit()
        if resume is not None:
            self._restore(resume)
        else:
            self.env.stagger(cfg.ppo.num_steps)
        self.writer = None

    # ------------------------------------------------------------- the loop
    def learn(self) -> dict:
        cfg, env, ppo = self.cfg, self.env, self.ppo
        T = cfg.ppo.num_steps
        steps_per_iter = T * self.num_envs * self.dist.world
        timer = PhaseTimer(self.device)
        if self.dist.main:
            self._open_logs()
        bar = tqdm(range(self.iteration, cfg.run.iterations), initial=self.iteration, total=cfg.run.iterations,
                   desc="train", disable=not (self.progress and self.dist.main), dynamic_ncols=True)
        obs = env.obs
        row: dict = {}
        for it in bar:
            t_start = time.perf_counter()
            timer.mark()
            if cfg.ppo.schedule == "linear":
                ppo.set_linear_lr(it / cfg.run.iterations)
            ppo.cap_std((it + 1) / cfg.run.iterations, cfg.policy.init_std)
            ppo.begin_rollout()
            with torch.no_grad():
                for t in range(T):
                    action = ppo.act(t, obs)
                    obs, reward, terminated, truncated, info = env.step(action)
                    ppo.record(t, reward, terminated, truncated, info["final_obs"])
            timer.mark()                    # returns count as update, as in rsl_rl's timing
            ppo.compute_returns(obs)
            stats = ppo.update()
            ppo.update_normalizer()
            timer.mark()
            self.elapsed += time.perf_counter() - t_start
            row = self._summarize(it, stats, timer.laps(), steps_per_iter)
            self.iteration = it + 1
            if self.dist.main:
                self._log(row)
                bar.set_postfix_str(f"err {row.get('task/fingertip_error', float('nan')) * 1000:.1f} mm, "
                                    f"ok@1cm {row.get('task/success_1cm', float('nan')) * 100:.0f} %, "
                                    f"{row['perf/total_steps_per_s'] / 1000:.0f}k steps/s")
                if self.progress and ((it + 1) % cfg.run.print_every == 0 or it + 1 == cfg.run.iterations):
                    bar.write(_line(row))
                if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations:
                    self.save()
        bar.close()
        if self.dist.main:
            self._close_logs()
        return row

    def _summarize(self, it: int, stats: dict, laps: list[float], steps_per_iter: int) -> dict:
        """One host sync: statistics, finiteness of loss and weights, env episode stats."""
        params_ok = torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all()
        keys = list(stats)
        values = torch.stack([stats[k].float() for k in keys] + [params_ok.float()]).tolist()
        if not all(v == v and abs(v) != float("inf") for v in values) or values[-1] != 1.0:
            last = checkpoint.resolve(self.run_dir) if any(self.run_dir.glob("model_*.pt")) else None
            raise TrainingDiverged(f"non-finite loss or weights at iteration {it}; training stopped, "
                                   f"last good checkpoint: {last or 'none yet'}")
        collect, update = laps
        self.total_steps += steps_per_iter
        row = {"iteration": it, "env_steps": self.total_steps, "wall_s": self.elapsed}
        row.update({("loss/" if k.endswith("loss") else "policy/") + k: v for k, v in zip(keys, values)})
        for k, v in self.env.pop_stats().items():
            group = "reward/" if k.startswith("term/") else "task/" if k in _TASK_KEYS else "episode/"
            row[group + k.removeprefix("term/")] = v
        row.update({"perf/collection_s": collect, "perf/update_s": update,
                    "perf/collection_steps_per_s": steps_per_iter / collect,
                    "perf/update_steps_per_s": steps_per_iter / update,
                    "perf/total_steps_per_s": steps_per_iter / (collect + update)})
        return row

    # ---------------------------------------------------------- checkpoints
    def state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": checkpoint.FORMAT,
            "iteration": self.iteration,
            "model": self.model.state_dict(),
            "optimizer": self.ppo.optimizer.state_dict(),
            "lr": self.ppo.lr.clone(),
            "cfg": dataclasses.asdict(self.cfg),
            "task": dataclasses.asdict(self.task),
            "rng": rng,
            "env": self.env.state_dict(),
            "counters": {"env_steps": self.total_steps, "wall_s": self.elapsed},
            "commit": self.commit,
        }

    def save(self) -> Path:
        path = self.run_dir / f"model_{self.iteration}.pt"
        checkpoint.save(self.state(), path)
        return path

    def _restore(self, state: dict) -> None:
        path = state["path"]
        # A checkpoint holds rank 0's environments and random streams: the other ranks of a
        # multi-process run go on with environments and streams of their own (not rank 0's
        # again, which would give the update the same samples twice).
        main = self.dist.main
        try:
            self.model.load_state_dict(state["model"])
            self.ppo.optimizer.load_state_dict(state["optimizer"])
            if main:
                self.env.load_state_dict(state["env"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise checkpoint.CheckpointError(f"{path}: cannot resume from it ({str(e).splitlines()[0]})") from None
        # load_state_dict copied the saved lr in; keep the optimizer on our device tensor.
        self.ppo.lr.copy_(state["lr"])
        for g in self.ppo.optimizer.param_groups:
            g["lr"] = self.ppo.lr
        if main:
            torch.set_rng_state(state["rng"]["torch"].cpu())
            if "cuda" in state["rng"] and self.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        else:
            torch.manual_seed(self.cfg.run.seed + 1000 * self.dist.rank + state["iteration"])
        self.iteration = state["iteration"]
        self.total_steps = state["counters"]["env_steps"]
        self.elapsed = state["counters"]["wall_s"]

    # -------------------------------------------------------------- logging
    def _open_logs(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(self.cfg), indent=2) + "\n")
        self.metrics = self.run_dir / "metrics.jsonl"
        # A resumed run continues the curves from its checkpoint: drop rows logged after it.
        if self.metrics.exists():
            rows = [r for r in read_metrics(self.metrics) if r["iteration"] < self.iteration]
            atomic_write(self.metrics, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))
        self.writer = SummaryWriter(str(self.run_dir), purge_step=self.iteration or None)

    def _log(self, row: dict) -> None:
        for k, v in row.items():
            if "/" in k:
                self.writer.add_scalar(k, v, row["iteration"])
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _close_logs(self) -> None:
        self.writer.close()
        from soarm.training.plots import plot_training

        plot_training(read_metrics(self.metrics), self.run_dir / "training.png")


_TASK_KEYS = {"fingertip_error", "success_1cm", "success_5mm"}


def _line(row: dict) -> str:
    g = row.get
    return (f"it {row['iteration'] + 1:5d}  steps {row['env_steps'] / 1e6:7.2f} M  "
            f"err {g('task/fingertip_error', float('nan')) * 1000:6.1f} mm  "
            f"ok@1cm {g('task/success_1cm', float('nan')) * 100:5.1f} %  "
            f"return {g('episode/mean_return', float('nan')):7.2f}  kl {row['policy/kl']:.4f}  "
            f"lr {row['policy/learning_rate']:.1e}  std {row['policy/action_std']:.3f}  "
            f"{row['perf/total_steps_per_s'] / 1000:5.0f}k steps/s  {row['wall_s']:6.0f} s")


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break                      # a line cut by a crash: keep what came before
    return rows
