"""Swap files are opened once: a file put in place of a swap file's path is never read or written."""

from __future__ import annotations

import os

import torch

import zero
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
DATA = corpus_bytes()


def _engine(nvme: str):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 1,
            "sub_group_size": 8192,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "max_in_cpu": 0},
        },
    }
    return zero.initialize(model=GPT(CFG), config=config)[0]


def _steps(engine, start: int, n: int):
    losses = []
    for step in range(start, start + n):
        x, y = get_batch(DATA, 2, CFG.seq_len, step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_swap_file_replaced_under_its_path_is_never_used(tmp_path):
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    dir_.mkdir()
    ref = _engine(str(ref_dir))
    want = _steps(ref, 0, 4)
    want_params = [p.detach().clone() for p in ref.module.parameters()]
    ref.close()

    engine = _engine(str(dir_))
    assert _steps(engine, 0, 2) == want[:2]
    swap_files = sorted(os.listdir(engine.swap_dir))
    assert swap_files, "the optimizer state is on NVMe: its swap files are in the engine's swap_dir"
    decoys = {}
    for name in swap_files:  # a different file renamed over each swap file's path (same size, other bytes)
        path = os.path.join(engine.swap_dir, name)
        size = os.path.getsize(path)
        decoy = os.path.join(engine.swap_dir, f".decoy-{name}")
        with open(decoy, "wb") as f:
            f.write(b"\x7f" * size)
        os.replace(decoy, path)
        decoys[path] = size
    assert _steps(engine, 2, 2) == want[2:]  # read the state written before, through the descriptors
    for a, b in zip(engine.module.parameters(), want_params):
        assert torch.equal(a, b)
    for path, size in decoys.items():  # and wrote nothing into the files now at those paths
        with open(path, "rb") as f:
            assert f.read() == b"\x7f" * size, path
    engine.close()
