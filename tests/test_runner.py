"""The training runner: resume continuity, NaN handling, checkpoints, the CLI's bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from soarm import REPO_ROOT, cli
from soarm.training import checkpoint
from soarm.training.runner import Runner, TrainingDiverged
from tests.helpers import tiny_cfg


def params(runner):
    return torch.cat([p.detach().reshape(-1) for p in runner.model.parameters()])


def test_resume_continues_the_same_run(tmp_path):
    straight = Runner(tiny_cfg(4), tmp_path / "a", progress=False)
    straight.learn()

    first = Runner(tiny_cfg(2), tmp_path / "b", progress=False)
    first.learn()
    state = checkpoint.load(tmp_path / "b")
    assert state["iteration"] == 2
    resumed = Runner(tiny_cfg(4), tmp_path / "b", resume=state, progress=False)
    resumed.learn()

    assert torch.equal(params(straight), params(resumed))
    assert torch.equal(straight.model.normalizer.mean, resumed.model.normalizer.mean)
    assert float(straight.ppo.lr) == float(resumed.ppo.lr)
    assert straight.total_steps == resumed.total_steps
    rows_a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows_b] == [0, 1, 2, 3]
    for ra, rb in zip(rows_a, rows_b):
        assert ra["loss/value_loss"] == rb["loss/value_loss"] and ra.get("task/fingertip_error") == rb.get(
            "task/fingertip_error")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
def test_a_cpu_checkpoint_resumes_on_the_gpu(tmp_path):
    """A checkpoint is read on the CPU; every part of the environment's state must land on
    the run's device (the sim's and the episode statistics' once stayed on the CPU)."""
    Runner(tiny_cfg(2), tmp_path, progress=False).learn()
    resumed = Runner(tiny_cfg(4, device="cuda"), tmp_path, resume=checkpoint.load(tmp_path), progress=False)
    resumed.learn()
    assert resumed.iteration == 4
    assert resumed.env.sim.q.is_cuda and resumed.env.sim.physics.gain_scale.is_cuda
    assert resumed.env.task.episodes.ret.is_cuda


def test_nan_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    runner = Runner(tiny_cfg(2), tmp_path, progress=False)
    runner.learn()
    good = (tmp_path / "model_2.pt").read_bytes()
    with torch.no_grad():
        runner.model.critic[0].weight[0, 0] = float("nan")
    runner.cfg.run.iterations = 4
    with pytest.raises(TrainingDiverged, match="non-finite.*model_2.pt"):
        runner.learn()
    assert (tmp_path / "model_2.pt").read_bytes() == good
    assert not (tmp_path / "model_4.pt").exists()


def test_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    runner = Runner(tiny_cfg(2), tmp_path, progress=False)
    runner.learn()
    before = (tmp_path / "model_2.pt").read_bytes()

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        runner.save()
    assert (tmp_path / "model_2.pt").read_bytes() == before


@pytest.mark.parametrize("content", [None, b"", b"not a checkpoint at all", "truncated"])
def test_resume_of_a_bad_checkpoint_fails_cleanly(tmp_path, capsys, content):
    path = tmp_path / "model_5.pt"
    if content == "truncated":
        runner = Runner(tiny_cfg(2), tmp_path / "run", progress=False)
        runner.learn()
        data = (tmp_path / "run" / "model_2.pt").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif content is not None:
        path.write_bytes(content)
    assert cli.main(["train", "--resume", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err


def test_foreign_torch_file_is_refused(tmp_path):
    path = tmp_path / "model_1.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(checkpoint.CheckpointError, match="not a soarm PPO checkpoint"):
        checkpoint.load(path)


def test_mistyped_train_config_key_is_named(tmp_path, capsys):
    bad = tmp_path / "train.yaml"
    bad.write_text("ppo:\n  epoch: 5\n")
    assert cli.main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "ppo.epoch" in err and str(bad) in err


def test_evaluate_a_checkpoint_from_the_cli(tmp_path, capsys):
    Runner(tiny_cfg(2), tmp_path / "run", progress=False).learn()
    out = tmp_path / "eval.json"
    assert cli.main(["evaluate", str(tmp_path / "run"), "--targets", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["targets"] == 16 and 0 <= result["success_1cm"] <= 1
    assert {"mean_error_m", "median_error_m", "p95_error_m", "success_5mm"} <= set(result)


@pytest.mark.slow
def test_distributed_training_on_gloo(tmp_path):
    """torchrun, 2 processes on CPU: identical weights on both ranks, merged normalizer,
    checkpoints from rank 0 only."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    # --standalone: torchrun picks a free port itself, so parallel runs cannot collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).parent / "distributed_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.equal(ranks[0]["norm_mean"], ranks[1]["norm_mean"])
    assert float(ranks[0]["lr"]) == float(ranks[1]["lr"])
    cfg = tiny_cfg(2)
    assert float(ranks[0]["norm_count"]) == 2 * 2 * cfg.ppo.num_steps * cfg.run.num_envs
    assert sorted(p.name for p in (tmp_path / "run").glob("model_*.pt")) == ["model_2.pt"]
    # the two ranks ran different environments
    assert not torch.equal(ranks[0]["obs"], ranks[1]["obs"])


@pytest.mark.slow
def test_run_processes_split_the_environments_over_workers(tmp_path):
    """run.processes=2 on a CPU: `train` starts two workers (training/workers.py) that share
    the run's environments, rank 0 writes the checkpoints and hands back its result; a
    worker's error reaches the caller as the error it raised."""
    from soarm import config
    from soarm.training.train import train

    cfg = tiny_cfg(2, processes=2, out_dir=str(tmp_path), name="split")
    path = config.dump(cfg, tmp_path / "train.yaml")
    out = train(path, {}, progress=False)
    assert out["env_steps"] == 2 * cfg.ppo.num_steps * cfg.run.num_envs          # 2 x 16 envs = the run's 32
    run_dir = Path(out["run_dir"])
    assert sorted(p.name for p in run_dir.glob("model_*.pt")) == ["model_2.pt"]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def _fails_on_rank_one() -> int:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 refused")
    return 7


def test_a_workers_error_reaches_the_caller_as_raised():
    from soarm.training import workers

    with pytest.raises(ValueError, match="rank 1 refused"):
        workers.run(_fails_on_rank_one, 2)
