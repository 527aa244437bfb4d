"""Single-observation latency of the exported policy: onnxruntime (1 intra-op thread) against
the same actor in plain torch (1 thread), measured in the same run.

    python benchmarks/policy_latency.py [CHECKPOINT_OR_RUN] [--calls 20000]

Both run the same actor: the checkpoint's, or without one the default network of
configs/train/reach.yaml with random weights (latency depends on the architecture, not on
the training). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soarm import CONFIG_DIR, config  # noqa: E402
from soarm.export.exporter import DeployedActor, to_onnx  # noqa: E402
from soarm.reach import ACTION_DIM, OBS_DIM  # noqa: E402
from soarm.training import checkpoint  # noqa: E402
from soarm.training.modules import ActorCritic  # noqa: E402
from soarm.training.runner import TrainCfg  # noqa: E402


def percentiles(fn, obs: list, calls: int) -> dict:
    for o in obs[:200]:
        fn(o)
    times = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn(obs[i % len(obs)])
        times[i] = time.perf_counter_ns() - t0
    us = times / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", type=Path, default=None, help="checkpoint or run directory")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    import onnxruntime as ort

    torch.set_num_threads(1)
    if args.source is None:
        cfg = config.load(TrainCfg, CONFIG_DIR / "train" / "reach.yaml")
        model = ActorCritic(OBS_DIM, ACTION_DIM, cfg.policy).eval()
    else:
        model = checkpoint.build_model(checkpoint.load(args.source))
    actor = DeployedActor(model.policy_normalizer(), model.actor).eval()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(to_onnx(actor, OBS_DIM), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(1, OBS_DIM)).astype(np.float32) for _ in range(1000)]
    ort_stats = percentiles(lambda o: sess.run(["actions"], {"obs": o}), obs, args.calls)
    tobs = [torch.from_numpy(o) for o in obs]
    with torch.inference_mode():
        torch_stats = percentiles(actor, tobs, args.calls)
    hidden = [m.out_features for m in model.actor if isinstance(m, torch.nn.Linear)][:-1]
    print(json.dumps({"policy": str(args.source or "default network, random weights"), "actor_hidden": hidden,
                      "onnxruntime_1_thread": ort_stats, "torch_1_thread": torch_stats,
                      "p99_ratio_torch_over_onnxruntime": torch_stats["p99_us"] / ort_stats["p99_us"],
                      "onnxruntime": ort.__version__, "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
