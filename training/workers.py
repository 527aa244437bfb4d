"""One CPU training run split over worker processes (`run.processes`), as torchrun would
start them: each worker joins a gloo group and runs its share of the environments on its
share of the cores, and the PPO update averages over them (runner.py).

Why processes and not threads: at a few thousand environments an env step is a few hundred
small tensor ops, and one Python thread dispatching them leaves the second core mostly idle;
two processes dispatch in parallel (docs/benchmarks.md gives the figures).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import sys
import traceback
from typing import Any, Callable


def wanted(run) -> bool:
    """Whether this process should start the workers of `run` (a RunCfg): a run split over CPU
    workers (RunCfg.cpu_workers), and not already inside a process group (a worker, or a
    torchrun rank)."""
    return run.cpu_workers and "WORLD_SIZE" not in os.environ


def threads_per_worker(threads: int, processes: int) -> int:
    """Each worker's torch threads: `threads` (0: every core) shared out evenly, at least one."""
    return max(1, (threads or os.cpu_count() or 1) // processes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results, fn: Callable, args: tuple, kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        out = fn(*args, **kwargs)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it as its own
        if not (isinstance(e, ValueError) or type(e).__module__.startswith("soarm")):
            traceback.print_exc()                # a bug, not a user's error: where it happened
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        results.put(("error", e))
        sys.exit(1)
    if rank == 0:
        results.put(("result", out))


def run(fn: Callable, processes: int, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) in `processes` fresh processes; rank 0's return value. The first
    error a worker raises is raised here (the others are stopped), so a worker's ConfigError
    or TrainingDiverged reads as it would from one process."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, processes, port, results, fn, args, kwargs))
             for r in range(processes)]
    for p in procs:
        p.start()
    result, error = None, None
    try:
        while error is None and all(p.exitcode in (None, 0) for p in procs) and any(p.is_alive() for p in procs):
            try:
                kind, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            result, error = (result, value) if kind == "error" else (value, error)
        while error is None:                     # what a worker sent just before it exited
            try:
                kind, value = results.get(timeout=1.0)
            except queue.Empty:
                break
            result, error = (result, value) if kind == "error" else (value, error)
        if error is not None:
            _stop(procs)                         # the others may wait on it for ever
        for p in procs:
            p.join()
    finally:
        _stop(procs)
    if error is not None:
        raise error
    codes = [p.exitcode for p in procs]
    if 130 in codes:
        raise KeyboardInterrupt
    if any(codes):
        rank = next(r for r, c in enumerate(codes) if c)
        raise WorkerFailed(f"training worker {rank} of {processes} stopped (exit code {codes[rank]})")
    return result


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()


class WorkerFailed(RuntimeError):
    pass
