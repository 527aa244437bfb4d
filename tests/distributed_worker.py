"""One rank of the gloo test in test_runner.py (run by torchrun): train a tiny config for
two iterations, then dump what must agree (or differ) between ranks."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import tiny_cfg  # noqa: E402

from soarm.training.runner import Runner  # noqa: E402

out = Path(sys.argv[1])
torch.set_num_threads(1)
runner = Runner(tiny_cfg(2), out / "run", progress=False)
runner.learn()
torch.save({
    "params": torch.cat([p.detach().reshape(-1) for p in runner.model.parameters()]),
    "norm_mean": runner.model.normalizer.mean, "norm_count": runner.model.normalizer.count,
    "lr": runner.ppo.lr, "obs": runner.env.obs,
}, out / f"rank{runner.dist.rank}.pt")
torch.distributed.destroy_process_group()
