"""The harness of every multi-rank test: run a test body on two (or more) gloo ranks in spawned processes
and collect each rank's result. (tests/test_engine_dist.py::test_under_torchrun launches through torchrun
instead: that launch is what it tests.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# fn(rank, world_size, nvme_dir, out_dir) -> a picklable result; it must be a module-level function.
RankFn = Callable[[int, int, str, str], Any]

# The slowest caller finishes in about a minute on a CPU; a rank blocked in a collective that a failed
# peer never joins would otherwise wait for gloo's 30-minute timeout.
TIMEOUT_S = 600.0


def _worker(rank: int, fn: RankFn, world_size: int, init_file: str, nvme_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, nvme_dir, out_dir)
        torch.save(result, str(Path(out_dir) / f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_ranks(
    fn: RankFn, tmp: Path, world_size: int = 2, timeout_s: float = TIMEOUT_S
) -> Tuple[List[Any], Path]:
    """Run `fn` on `world_size` ranks; returns their results in rank order and the shared nvme dir.

    A rank that raises fails the call with its traceback (torch.multiprocessing.ProcessRaisedException). A
    rank still running after `timeout_s` (e.g. blocked in a collective that a failed peer never joins) kills
    them all and raises TimeoutError instead of hanging the test run."""
    nvme = tmp / "nvme"
    nvme.mkdir()
    args = (fn, world_size, str(tmp / "init"), str(nvme), str(tmp))
    ctx = mp.start_processes(_worker, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            done = [r for r in range(world_size) if (tmp / f"rank{r}.pt").exists()]
            raise TimeoutError(
                f"ranks not finished after {timeout_s} s (finished: {done}): a rank is blocked"
            )
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world_size)], nvme
