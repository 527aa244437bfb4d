"""The training stage's commands: `soarm train`, `soarm evaluate`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from soarm import CONFIG_DIR, REPO_ROOT, config


def register(sub) -> None:
    from soarm.training.runner import RunCfg

    p = sub.add_parser("train", help="train a reach policy with PPO on the embedded sim")
    p.add_argument("--config", type=Path, default=CONFIG_DIR / "train" / "reach.yaml")
    p.add_argument("--resume", type=Path, default=None, help="checkpoint file or run directory to continue")
    config.add_flags(p, RunCfg, prefix="run.", flag_prefix="")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. ppo.epochs=4 or task.action.goal_margin=0.1")
    p.set_defaults(fn=_train)

    p = sub.add_parser("evaluate", help="accuracy of a reach policy in the embedded sim")
    p.add_argument("policy", nargs="?", default="scripted",
                   help="'scripted', an exported .onnx, a checkpoint model_N.pt or a run directory")
    p.add_argument("--task", default=None, type=Path, help="task config (default: the policy's own)")
    p.add_argument("--targets", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "eval.json")
    p.set_defaults(fn=_evaluate)


def _train(args) -> int:
    import yaml

    from soarm.training.runner import RunCfg, TrainingDiverged
    from soarm.training.train import train

    overrides = config.flag_overrides(args, RunCfg, prefix="run.")
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    try:
        train(args.config, overrides, args.resume)
    except TrainingDiverged as e:
        print(f"soarm train: error: {e}", file=sys.stderr)
        return 3
    return 0


def _evaluate(args) -> int:
    import torch

    from soarm.export import policies
    from soarm.training.evaluate import evaluate, summary, write_report

    torch.set_num_threads(args.threads)
    policy = policies.load(args.policy, args.task)
    print(f"evaluating {policy.name} on {args.targets} targets")
    t0 = time.time()
    with torch.no_grad():
        result = evaluate(policy.act, policy.task, targets=args.targets, seed=args.seed)
    result["policy"] = str(args.policy)
    write_report(result, args.out)
    print(f"{summary(result)}  [{time.time() - t0:.1f} s, report {args.out}]")
    return 0
