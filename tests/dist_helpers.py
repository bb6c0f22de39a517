"""The harness of every multi-rank test: run a test body on two (or more) gloo ranks in spawned processes
and collect each rank's result. (tests/test_engine_dist.py::test_under_torchrun launches through torchrun
instead: that launch is what it tests.) Also the multi-rank engine cases: their config (`make_config`) and
steps of a rank (`rank_steps`) on the global batch split over the ranks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero.examples.models import GPTConfig, corpus_bytes, get_batch

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


TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


GLOBAL_BATCH = 4


STEPS = 8


# Two ranks sum two half-batch gradients where one rank computes the whole batch at once: the results
# differ by float rounding only (~1e-7 relative); a wrong reduction (missing average, a lost bucket, a
# stale partition) moves the loss by >1e-3.
LOSS_ATOL = 2e-5


PARAM_ATOL = 2e-5


def make_config(case, world_size, nvme_dir):
    gas = case.get("gas", 1)
    zo = {
        "stage": case["stage"],
        "sub_group_size": 4000,
        "overlap_comm": case.get("overlap_comm", False),
        "reduce_bucket_size": case.get("reduce_bucket_size", 500_000_000),
    }
    if case["offload"] != "none":
        zo["offload_optimizer"] = {"device": case["offload"], "nvme_path": str(nvme_dir), "max_in_cpu": 0}
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "gradient_clipping": case.get("clip", 0.0),
        "zero_optimization": zo,
    }
    if case.get("fp16"):
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


def rank_steps(engine, rank, start, n):
    """Steps start..start+n-1 on this rank's half of each global batch (2 ranks); the losses."""
    losses = []
    for step in range(start, start + n):
        x, y = get_batch(corpus_bytes(), GLOBAL_BATCH, TINY.seq_len, step)
        half = slice(rank * 2, rank * 2 + 2)
        loss = engine(x[half], y[half])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
