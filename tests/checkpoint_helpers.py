"""Shared by the checkpoint tests: a small GPT engine on a tier (`config`, `new_engine`), steps of training
(`run`), its parameters (`params_of`), a file's manifest entry as it is now (`digest_file`), and a
safetensors `safe_open` whose read of one tensor fails, for the tests of a load that breaks half way."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict

import torch

import zero
from zero.checkpoint._files import digest_fd
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch


def digest_file(path: str, segment: int) -> Dict[str, Any]:
    """The manifest entry of file `path` as it is now, digested in segments of `segment` bytes (what a
    checkpoint's save records), for tests that edit a checkpoint the way anyone who can write it could."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return digest_fd(fd, segment, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


def failing_safe_open(real: Callable[..., Any], failing_key: str) -> type:
    """A drop-in for `safetensors.safe_open` (`real`) that raises RuntimeError("simulated read error") when
    `failing_key` is read and behaves as `real` otherwise."""

    class Failing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.f = real(*args, **kwargs)

        def __enter__(self) -> Failing:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.f.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def get_tensor(self, key: str) -> Any:
            if key == failing_key:
                raise RuntimeError("simulated read error")
            return self.f.get_tensor(key)

    return Failing


# Dropout on: resuming bit for bit needs the RNG state restored too.
CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)


DATA = corpus_bytes()


def config(offload: str, nvme_dir, fp16: bool = False):
    zo = {"stage": 1, "sub_group_size": 5000}
    if offload != "none":
        zo["offload_optimizer"] = {"device": offload, "nvme_path": str(nvme_dir), "max_in_cpu": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 20}},
        "zero_optimization": zo,
    }
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2}
    return cfg


def new_engine(offload, nvme_dir, seed=0, fp16=False):
    torch.manual_seed(seed)
    engine, *_ = zero.initialize(model=GPT(CFG), config=config(offload, nvme_dir, fp16))
    return engine


def run(engine, start, steps):
    losses = []
    for step in range(start, start + steps):
        x, y = get_batch(DATA, 4, CFG.seq_len, step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def params_of(engine):
    return [p.detach().clone() for p in engine.module.parameters()]
