"""Stages 0-2 over torch.distributed: two gloo ranks equal one rank with the same global batch."""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import (
    GLOBAL_BATCH,
    LOSS_ATOL,
    PARAM_ATOL,
    STEPS,
    TINY,
    make_config,
    rank_steps,
    run_on_ranks,
)

import zero
from zero.examples.models import GPT, corpus_bytes, get_batch

CASES = {
    "stage0-none": {"stage": 0, "offload": "none"},
    "stage1-cpu": {"stage": 1, "offload": "cpu"},
    "stage2-nvme-overlap": {"stage": 2, "offload": "nvme", "overlap_comm": True, "reduce_bucket_size": 3000},
    "stage2-cpu-gas2": {
        "stage": 2,
        "offload": "cpu",
        "gas": 2,
        "overlap_comm": True,
        "reduce_bucket_size": 20000,
    },
    "stage1-nvme-clip-fp16": {"stage": 1, "offload": "nvme", "clip": 0.05, "fp16": True},
}


def train_case(case, rank, world_size, nvme_dir):
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(TINY), config=make_config(case, world_size, nvme_dir))
    micro = engine.train_micro_batch_size_per_gpu()
    assert micro * engine.gradient_accumulation_steps() * world_size == GLOBAL_BATCH
    losses = []
    for step in range(STEPS):
        x, y = get_batch(corpus_bytes(), GLOBAL_BATCH, TINY.seq_len, step)
        mine = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
        x, y = x[mine], y[mine]
        total = 0.0
        for k in range(engine.gradient_accumulation_steps()):
            loss = engine(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / engine.gradient_accumulation_steps())
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    engine.close()
    return losses, params


def checkpoint_case(rank, world_size, nvme_dir, ckpt_dir):
    """Stage 2, NVMe: save after 3 steps, resume in a new engine on CPU offload, compare bit for bit."""
    case = {"stage": 2, "offload": "nvme", "overlap_comm": True, "reduce_bucket_size": 5000}

    torch.manual_seed(0)
    full, *_ = zero.initialize(model=GPT(TINY), config=make_config(case, world_size, nvme_dir))
    want = rank_steps(full, rank, 0, 5)
    want_params = [p.detach().clone() for p in full.module.parameters()]
    full.close()
    torch.manual_seed(0)
    first, *_ = zero.initialize(model=GPT(TINY), config=make_config(case, world_size, nvme_dir))
    rank_steps(first, rank, 0, 3)
    first.save_checkpoint(ckpt_dir)
    first.close()
    torch.manual_seed(7)
    resumed, *_ = zero.initialize(
        model=GPT(TINY), config=make_config({**case, "offload": "cpu"}, world_size, nvme_dir)
    )
    path, _ = resumed.load_checkpoint(ckpt_dir)
    got = rank_steps(resumed, rank, 3, 2)
    same = got == want[3:] and all(
        torch.equal(a, p.detach()) for a, p in zip(want_params, resumed.parameters())
    )
    resumed.close()
    return {"same": same, "files": sorted(os.listdir(path))}


def _rank_main(rank, world_size, nvme_dir, out_dir):
    results = {name: train_case(case, rank, world_size, nvme_dir) for name, case in CASES.items()}
    results["checkpoint"] = checkpoint_case(rank, world_size, nvme_dir, os.path.join(out_dir, "ckpt"))
    return results


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    results, nvme = run_on_ranks(_rank_main, tmp_path_factory.mktemp("dist"))
    assert os.listdir(nvme) == []  # both ranks removed their swap directories
    return results


def test_two_rank_checkpoint_resumes_bit_identically(two_rank_results):
    for r in range(2):
        res = two_rank_results[r]["checkpoint"]
        assert res["same"], f"rank {r} diverged after resuming"
    assert two_rank_results[0]["checkpoint"]["files"] == [
        "manifest.json",
        "model_states.pt",
        "optim_rank0.bin",
        "optim_rank1.bin",
        "rank0_states.pt",
        "rank1_states.pt",
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank(tmp_path, two_rank_results, name):
    case = CASES[name]
    ref_losses, ref_params = train_case(case, 0, 1, tmp_path)
    r0_losses, r0_params = two_rank_results[0][name]
    r1_losses, r1_params = two_rank_results[1][name]
    # Every rank ends with the same full parameters (all-gather after the partitioned update).
    assert torch.equal(r0_params, r1_params)
    mean_losses = [(a + b) / 2 for a, b in zip(r0_losses, r1_losses)]
    worst = max(abs(a - b) for a, b in zip(mean_losses, ref_losses))
    tol = 2e-3 if case.get("fp16") else LOSS_ATOL
    assert worst <= tol, f"{name}: two-rank mean loss differs from one rank by {worst:.3g}"
    assert (r0_params - ref_params).abs().max().item() <= (2e-3 if case.get("fp16") else PARAM_ATOL)


_TORCHRUN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import zero
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch
torch.manual_seed(0)
cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5000,
                             "offload_optimizer": {"device": "cpu"}}}
engine, *_ = zero.initialize(model=GPT(GPTConfig(seq_len=16, n_layer=1, d_model=32)), config=cfg)
assert dist.is_initialized() and engine.world_size == 2 and dist.get_backend() == "gloo"
for step in range(3):
    x, y = get_batch(corpus_bytes(), 4, 16, step)
    x, y = x[engine.rank * 2 : engine.rank * 2 + 2], y[engine.rank * 2 : engine.rank * 2 + 2]
    engine.backward(engine(x, y))
    engine.step()
total = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]).double().sum().item()
# one write(2) of the whole line: the two ranks share the pipe, and print() may split text and newline
os.write(1, f"rank {engine.rank} checksum {total!r}\\n".encode())
engine.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    """Launched by torchrun, the engine starts the gloo process group itself."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = sorted(line.split()[-1] for line in proc.stdout.splitlines() if "checksum" in line)
    assert len(sums) == 2 and sums[0] == sums[1], (proc.stdout[-2000:], proc.stderr[-2000:])
