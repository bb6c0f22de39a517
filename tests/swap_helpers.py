"""Shared by the swapper tests (tests/test_swap.py, tests/test_swap_deferred_writes.py).

A reference optimizer state and its round trip through an OptimizerSwapper (`reference_state`, `fill_from`,
`snapshot`), and `ENGINE_CHILD_PRELUDE`, the common start of the child scripts that make an optimizer-state
write fail under RLIMIT_FSIZE (process-wide, hence a child): a small GPT trained 4 steps with the optimizer
on NVMe as the reference. The prelude defines `engine()`, `fwd_bwd(e, step)`, `want` (the reference losses),
`ref_state` and `ref_params`; the swap directory comes from argv[1]. Writes that exceed the limit get EFBIG
instead of a fatal SIGXFSZ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, List, Tuple

import torch

ENGINE_CHILD_PRELUDE = textwrap.dedent(
    """
    import errno, json, resource, signal, sys, torch
    import zero
    from offload.swap.optimizer_swapper import DeferredWriteError
    from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write(), not a fatal signal
    nvme = sys.argv[1]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 0, "sub_group_size": 8192,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3, "max_in_cpu": 0},
        },
    }
    model_cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
    data = corpus_bytes()

    def engine():
        torch.manual_seed(0)
        return zero.initialize(model=GPT(model_cfg), config=cfg)[0]

    def fwd_bwd(e, step):
        x, y = get_batch(data, 2, 16, step)
        loss = e(x, y)
        e.backward(loss)
        return loss.item()

    ref = engine()
    want = []
    for s in range(4):
        want.append(fwd_bwd(ref, s))
        ref.step()
    ref_state = ref.optimizer.state_dict()
    ref_params = [p.detach().clone() for p in ref.module.parameters()]
    ref.close()
    """
)


def reference_state(numel: int, n_states: int, seed: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g), [torch.randn(numel, generator=g) for _ in range(n_states)]


def fill_from(master_ref: torch.Tensor, states_ref: List[torch.Tensor]) -> Callable:
    """A swapper `load` function that copies the reference state in."""

    def fill(start, n, master, states):
        master.copy_(master_ref[start : start + n])
        for s, r in zip(states, states_ref):
            s.copy_(r[start : start + n])

    return fill


def snapshot(sw) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The swapper's live state, read back whole."""
    master = torch.empty(sw.numel)
    states = [torch.empty(sw.numel) for _ in range(sw.n_states)]

    def take(start, n, m, st):
        master[start : start + n] = m
        for d, s in zip(states, st):
            d[start : start + n] = s

    sw.read_all(take)
    return master, states


def run_child(script: str, nvme_dir: str) -> Dict[str, Any]:
    """Run a child script with the swap directory as argv[1]; the JSON object its last line prints."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", script, nvme_dir], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train_steps(
    engine: Any, data: torch.Tensor, batch: int, seq_len: int, micro_steps: int, start: int = 0
) -> List[float]:
    """Forward, backward and step() on batches start .. start + micro_steps - 1 of `data`; the losses."""
    from zero.examples.models import get_batch

    losses = []
    for s in range(start, start + micro_steps):
        x, y = (t.to(engine.device) for t in get_batch(data, batch, seq_len, s))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
