"""Embedded reach env throughput: env-steps/s at N environments on one CPU thread (or a GPU).

Peer, measured in the same run: MuJoCo stepping the published SO-101 model (mesh-free,
contacts off, its own position actuators) at the same control rate and physics step, one
model per environment stepped in turn, on the same single thread.

    python benchmarks/env_throughput.py [--envs 4096 65536] [--steps 90] [--no-compile] [--device cuda]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm import CONFIG_DIR, config  # noqa: E402
from soarm.reach import ReachCfg  # noqa: E402
from soarm.training.env import ReachEnv  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ours(cfg: ReachCfg, envs: int, steps: int, compile_: bool, device: str) -> dict:
    env = ReachEnv(cfg, envs, device=device, seed=0)
    compiled = False
    if compile_:
        t0 = time.time()
        compiled = env.sim.compile()
        print(f"compile: {time.time() - t0:.1f} s", file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    actions = [(torch.rand(envs, 5, generator=gen) * 2 - 1).to(device) for _ in range(8)]
    for a in actions[:3]:
        env.step(a)
    sync(device)
    t0 = time.perf_counter()
    for k in range(steps):
        env.step(actions[k % len(actions)])
    sync(device)
    dt = time.perf_counter() - t0
    return {"env_steps_per_s": envs * steps / dt, "ms_per_step": dt / steps * 1e3, "compiled": compiled}


def mujoco_peer(cfg: ReachCfg, steps: int) -> dict | None:
    try:
        import mujoco
        from tests.reference.mujoco_so101 import load_model
    except ImportError:
        return None
    model = load_model()
    if model is None:
        return None
    model.opt.timestep = 1.0 / (cfg.control_hz * cfg.substeps)
    data = mujoco.MjData(model)
    t0 = time.perf_counter()
    for k in range(steps):
        data.ctrl[:] = 0.3 if (k // 30) % 2 else -0.3
        mujoco.mj_step(model, data, nstep=cfg.substeps)
    dt = time.perf_counter() - t0
    return {"env_steps_per_s": steps / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", type=int, nargs="+", default=[4096])
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = config.load(ReachCfg, CONFIG_DIR / "task" / "reach.yaml")
    result = {"device": args.device, "threads": 1, "substeps": cfg.substeps, "control_hz": cfg.control_hz}
    peer = mujoco_peer(cfg, 3000)
    if peer:
        result["mujoco_peer"] = peer
    for envs in args.envs:
        row = {"eager": ours(cfg, envs, args.steps, compile_=False, device=args.device)}
        if not args.no_compile:
            row["compiled"] = ours(cfg, envs, args.steps, compile_=True, device=args.device)
        if peer:
            row["ratio_vs_mujoco"] = max(v["env_steps_per_s"] for v in row.values()) / peer["env_steps_per_s"]
        result[f"envs_{envs}"] = row
    result["target_env_steps_per_s"] = 250_000
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
