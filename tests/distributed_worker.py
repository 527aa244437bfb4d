"""One rank of the gloo test in test_runner.py (run by torchrun): train a tiny config for
two iterations, then dump what must agree (or differ) between ranks."""

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))          # the repository: `tests` is a package there
from tests.helpers import tiny_cfg  # noqa: E402

from soarm.training.runner import Runner, close_distributed  # noqa: E402


def main(out: Path) -> None:
    torch.set_num_threads(1)
    runner = Runner(tiny_cfg(2), out / "run", progress=False)
    runner.learn()
    torch.save({
        "params": torch.cat([p.detach().reshape(-1) for p in runner.model.parameters()]),
        "norm_mean": runner.model.normalizer.mean, "norm_count": runner.model.normalizer.count,
        "lr": runner.ppo.lr, "obs": runner.env.obs,
    }, out / f"rank{runner.dist.rank}.pt")


# The runner holds the process group: free it (cycles included) before the group is destroyed,
# since a group left to interpreter teardown can abort in gloo's threads (seen once in CI).
main(Path(sys.argv[1]))
gc.collect()
close_distributed()
