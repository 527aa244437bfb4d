"""Our PPO against rsl_rl 5.5 on the same embedded reach env, in one run, interleaved.

Ours runs as `make` ships it: configs/train/reach.yaml's precision and its `run.processes`
worker processes, started as `soarm train` starts them and driven from here. Peers: rsl_rl as
it ships (fp32) and rsl_rl with its own bf16 autocast of the update (`use_mixed_precision`),
each in this process with all of the run's threads (rsl_rl has no CPU multi-process mode).
All trainers get the same env (same seed, physics compiled for each), the run's environments
in all, the network sizes, rollout length, epochs, minibatches, PPO coefficients and
observation normalization of the config, and the same device and CPU threads in all. Rounds
alternate (ours, rsl_rl, rsl_rl_bf16, ours, ...) so drifts of the machine hit every side. Each
side's collection and update times come from its own runner's timers.

    python benchmarks/ppo_vs_rsl_rl.py [--envs 4096] [--rounds 3] [--iterations 4] [--device cuda]
    python benchmarks/ppo_vs_rsl_rl.py --learn --seeds 0 1 2 --learn-iterations 150 [--sides ours rsl_rl]

Prints JSON: env-steps/s (collection, update, total) for each, our/peer ratios overall and
per round (the acceptance figure is the median round's total ratio), each side's precision;
with --learn, the final evaluation of each seed at equal env steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm import CONFIG_DIR, config  # noqa: E402
from soarm.reach import ReachCfg  # noqa: E402
from soarm.training.evaluate import evaluate  # noqa: E402
from soarm.training.rsl_rl_cfg import rsl_rl_train_cfg  # noqa: E402
from soarm.training.runner import Runner, TrainCfg  # noqa: E402


# ------------------------------------------------------------------ rsl_rl side
def rsl_rl_runner(cfg: TrainCfg, env_seed: int, mixed_precision: bool = False):
    from rsl_rl.env import VecEnv
    from rsl_rl.runners import OnPolicyRunner
    from tensordict import TensorDict

    from soarm.training.env import ReachEnv

    class Adapter(VecEnv):
        """Our ReachEnv behind rsl_rl's VecEnv interface (time-outs in extras)."""

        def __init__(self, env: ReachEnv):
            self.env, self.num_envs, self.num_actions = env, env.num_envs, env.num_actions
            self.max_episode_length, self.device, self.cfg = env.cfg.episode_steps, env.device, {}

        @property
        def episode_length_buf(self):
            return self.env.task.state.steps

        @episode_length_buf.setter
        def episode_length_buf(self, value):
            self.env.task.state.steps = value

        def _td(self, obs):
            return TensorDict({"policy": obs[:, :self.env.num_obs], "critic": obs}, batch_size=[self.num_envs])

        def get_observations(self):
            return self._td(self.env.obs)

        def step(self, actions):
            obs, reward, terminated, truncated, _ = self.env.step(actions)
            return self._td(obs), reward, terminated | truncated, {"time_outs": truncated, "log": {}}

    task = config.load(ReachCfg, CONFIG_DIR / cfg.task)
    env = ReachEnv(task, cfg.run.num_envs, device=cfg.run.device, seed=env_seed, check_actions=False)
    env.sim.compile()
    train_cfg = {**rsl_rl_train_cfg(cfg, mixed_precision, task.critic_physics), "save_interval": 10**9,
                 "check_for_nan": False}
    runner = OnPolicyRunner(Adapter(env), train_cfg, log_dir=None, device=cfg.run.device)
    timings: list[tuple[float, float]] = []
    log = runner.logger.log

    def record(*args, **kw):
        timings.append((kw["collect_time"], kw["learn_time"]))
        return log(*args, **kw)
    runner.logger.log = record
    env.stagger(cfg.ppo.num_steps)
    return runner, env, timings


def rsl_rl_policy(runner, num_obs: int):
    """rsl_rl's deterministic policy as a function of our env's observation batch (the
    policy's `num_obs` columns first)."""
    from tensordict import TensorDict

    policy = runner.get_inference_policy()
    return lambda obs: policy(TensorDict({"policy": obs[:, :num_obs]}, batch_size=[obs.shape[0]]))


# -------------------------------------------------------------------- helpers
def rates(timings: list[tuple[float, float]], steps: int) -> dict:
    c = statistics.median(t[0] for t in timings)
    u = statistics.median(t[1] for t in timings)
    return {"collection_steps_per_s": steps / c, "update_steps_per_s": steps / u, "total_steps_per_s": steps / (c + u),
            "collection_s": c, "update_s": u, "iterations_timed": len(timings)}


def quiet(fn, *a, **k):
    """rsl_rl prints a report every iteration; keep stdout for our JSON."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **k)


def our_worker(cfg: TrainCfg, run_dir: Path, commands, replies) -> None:
    """One rank of our trainer in the layout `make` ships (run.processes workers): on each
    command n, every rank learns n more iterations; rank 0 replies with their timings."""
    from soarm.training.runner import close_distributed

    runner = Runner(cfg, run_dir, progress=False)
    main = runner.dist.main
    if main:
        replies.put("bf16" if runner.ppo.bf16 else "fp32")
    while True:
        n = [commands.get() if main else None]
        if runner.dist.world > 1:
            torch.distributed.broadcast_object_list(n, src=0)
        if n[0] is None:
            break
        runner.cfg.run.iterations += n[0]
        runner.learn()
        if main:
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            replies.put([(x["perf/collection_s"], x["perf/update_s"]) for x in rows[-n[0]:]])
    del runner
    import gc

    gc.collect()                    # free the group's tensors before the group (tests/distributed_worker.py)
    close_distributed()


class OurSide:
    """Our trainer in its own worker processes (training/workers.py), as `soarm train` runs it,
    driven from here so that its rounds interleave with rsl_rl's."""

    def __init__(self, cfg: TrainCfg, run_dir: Path):
        import multiprocessing
        import threading

        from soarm.training import workers

        ctx = multiprocessing.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        cfg = copy.deepcopy(cfg)
        cfg.run.iterations = 0
        self.processes = cfg.run.processes if workers.wanted(cfg.run) else 1
        self.thread = threading.Thread(target=workers.run, daemon=True,
                                       args=(our_worker, self.processes, cfg, run_dir, self.commands, self.replies))
        self.thread.start()
        self.precision = self.replies.get(timeout=900)
        self.timings: list[tuple[float, float]] = []

    def __call__(self, n: int) -> None:
        self.commands.put(n)
        self.timings.extend(self.replies.get(timeout=3600))

    def close(self) -> None:
        self.commands.put(None)
        self.thread.join(timeout=120)


def throughput(cfg: TrainCfg, rounds: int, iterations: int, warmup: int) -> dict:
    steps = cfg.ppo.num_steps * cfg.run.num_envs
    tmp = Path(tempfile.mkdtemp(prefix="ppo_bench_"))
    cfg.run.eval_targets, cfg.run.save_every = 0, 10**9
    t0 = time.time()
    ours = OurSide(cfg, tmp / "ours")
    print(f"ours: set-up {time.time() - t0:.0f} s ({ours.processes} process(es), precision {ours.precision})",
          file=sys.stderr)
    sides = {"ours": (ours, ours.timings)}
    # rsl_rl as it ships (fp32), and with its own bf16 autocast of the update switched on; one
    # process with every thread the run has (--threads), the run's environments in all.
    for name, mixed in (("rsl_rl", False), ("rsl_rl_bf16", True)):
        t0 = time.time()
        runner, _, timings = quiet(rsl_rl_runner, cfg, cfg.run.seed, mixed)
        sides[name] = (lambda n, r=runner: quiet(r.learn, n), timings)
        print(f"{name}: set-up {time.time() - t0:.0f} s", file=sys.stderr)
    for run, timings in sides.values():      # warm-up (compile, caches): not timed
        run(warmup)
        timings.clear()
    per_round = []
    for r in range(rounds):
        for run, _ in sides.values():
            run(iterations)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {steps / sum(t[-1]):.0f}" for k, (_, t) in sides.items())
              + " env-steps/s", file=sys.stderr)
        # This round's ratios too: the machine's speed drifts between rounds, and not by
        # the same factor for every side.
        now = {k: rates(t[-iterations:], steps) for k, (_, t) in sides.items()}
        per_round.append({f"{phase}_ours_over_{peer}": now["ours"][f"{phase}_steps_per_s"]
                          / now[peer][f"{phase}_steps_per_s"]
                          for peer in ("rsl_rl", "rsl_rl_bf16") for phase in ("update", "total")})
    ours.close()
    out = {k: rates(t, steps) for k, (_, t) in sides.items()}
    out["rounds"] = per_round
    out["precision"] = {"ours": PRECISION[ours.precision], "rsl_rl": "fp32 throughout",
                        "rsl_rl_bf16": "bf16 autocast of the update (use_mixed_precision); rollout in fp32"}
    out["processes"] = {"ours": ours.processes, "rsl_rl": 1, "rsl_rl_bf16": 1}
    for peer in ("rsl_rl", "rsl_rl_bf16"):
        out[f"ratio_ours_over_{peer}"] = {k.replace("_steps_per_s", ""): out["ours"][k] / out[peer][k]
                                          for k in out["ours"] if k.endswith("steps_per_s")}
        out[f"median_round_total_ours_over_{peer}"] = statistics.median(
            r[f"total_ours_over_{peer}"] for r in per_round)
    return out


PRECISION = {"bf16": "bf16 matmuls in the hidden layers (rollout and update), fp32 output layers, losses, "
                     "optimizer and weights (ppo.precision auto on a CPU with native bf16)",
             "fp32": "fp32 throughout"}


def learning(cfg: TrainCfg, seeds: list[int], iterations: int, targets: int, sides: list[str]) -> dict:
    out: dict = {"iterations": iterations, "env_steps": iterations * cfg.ppo.num_steps * cfg.run.num_envs}
    out.update({side: {} for side in sides})
    task = config.load(ReachCfg, CONFIG_DIR / cfg.task)
    for seed in seeds:
        run = copy.deepcopy(cfg)
        run.run.seed, run.run.iterations, run.run.eval_targets, run.run.save_every = seed, iterations, 0, 10**9
        for side in sides:
            t0 = time.time()
            if side == "ours":
                ours = Runner(run, Path(tempfile.mkdtemp(prefix="ppo_learn_")), progress=False)
                ours.learn()
                act = ours.model.eval().act_deterministic
            else:
                torch.manual_seed(seed)
                rsl, env, _ = quiet(rsl_rl_runner, run, seed)
                quiet(rsl.learn, iterations)
                act = rsl_rl_policy(rsl, env.num_obs)
            with torch.no_grad():
                res = evaluate(act, task, targets=targets, progress=False)
            out[side][seed] = {**res, "wall_s": time.time() - t0}
            print(f"seed {seed}: {side} {res['mean_error_m'] * 1000:.2f} mm in {time.time() - t0:.0f} s",
                  file=sys.stderr)
    for side in sides:
        errs = [r["mean_error_m"] for r in out[side].values()]
        out[side]["mean_over_seeds_m"] = statistics.fmean(errs)
        # Outcomes at a fixed step count scatter from seed to seed (and with rounding): the
        # standard error says how far apart two such means can fall by chance alone.
        if len(errs) > 1:
            out[side]["standard_error_m"] = statistics.stdev(errs) / len(errs) ** 0.5
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CONFIG_DIR / "train" / "reach.yaml")
    ap.add_argument("--envs", type=int, default=None, help="default: the config's num_envs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per round and side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--learn", action="store_true", help="compare final accuracy at equal env steps instead")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--learn-iterations", type=int, default=150)
    ap.add_argument("--targets", type=int, default=512)
    ap.add_argument("--sides", nargs="+", choices=["ours", "rsl_rl"], default=["ours", "rsl_rl"],
                    help="with --learn: which trainers to run (rsl_rl's outcome per seed is deterministic)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config.load(TrainCfg, args.config)
    cfg.run.threads, cfg.run.device = args.threads, args.device
    if args.envs:
        cfg.run.num_envs = args.envs
    import rsl_rl  # noqa: F401 - fail early if the bench extra is missing

    from importlib.metadata import version

    head = {"num_envs": cfg.run.num_envs, "steps_per_env": cfg.ppo.num_steps, "epochs": cfg.ppo.epochs,
            "minibatches": cfg.ppo.minibatches, "actor": list(cfg.policy.actor_hidden),
            "critic": list(cfg.policy.critic_hidden), "obs_normalization": True, "threads": args.threads,
            "device": args.device, "torch": torch.__version__, "rsl_rl_version": version("rsl-rl-lib")}
    if args.learn:
        result = {**head, **learning(cfg, args.seeds, args.learn_iterations, args.targets, args.sides)}
    else:
        result = {**head, **throughput(cfg, args.rounds, args.iterations, args.warmup)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
