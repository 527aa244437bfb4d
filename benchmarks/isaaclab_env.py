"""Env-steps/s of the Isaac Lab reach env (Newton MuJoCo-Warp + our servo actuator).

    .venv-isaaclab/bin/python benchmarks/isaaclab_env.py [--device cpu] [--envs 16 256] [--steps 60]

Steps each environment count with random actions after a warm-up and prints JSON: env
steps/s (environments x control steps per second of wall time) for each count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm.training.isaac.reach_env import SO101ReachEnv  # noqa: E402
from soarm.training.isaac.reach_env_cfg import SO101ReachEnvCfg  # noqa: E402


def measure(num_envs: int, device: str, steps: int) -> dict:
    cfg = SO101ReachEnvCfg(device=device)
    cfg.scene.num_envs = num_envs
    env = SO101ReachEnv(cfg)
    env.reset()
    gen = torch.Generator().manual_seed(0)

    def act():
        return (torch.rand(num_envs, 5, generator=gen) * 2 - 1).to(env.device)
    for _ in range(5):                       # warm-up (kernels, graphs)
        env.step(act())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        env.step(act())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    env.close()
    return {"num_envs": num_envs, "steps": steps, "seconds": dt, "env_steps_per_s": num_envs * steps / dt,
            "vectorized_steps_per_s": steps / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    out = {"device": args.device, "torch_threads": torch.get_num_threads(), "results": []}
    for n in args.envs:
        r = measure(n, args.device, args.steps)
        print(f"{n} envs: {r['env_steps_per_s']:.0f} env-steps/s", file=sys.stderr, flush=True)
        out["results"].append(r)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
