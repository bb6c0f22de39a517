"""Progress bars (offload/progress.py) on long work: each bar counts exactly the bytes its work reads or
writes, the bars are drawn on stderr in bytes with a rate, and they stay silent when stderr is not a
terminal, off rank 0, or when turned off (`ZO_DISABLE_PROGRESS=1`, `disable_progress_bars()`)."""

from __future__ import annotations

import os

import pytest
import torch
import tqdm

import offload.progress as progress_module
import zero
from offload.progress import (
    DISABLE_ENV,
    are_progress_bars_disabled,
    disable_progress_bars,
    enable_progress_bars,
)
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


@pytest.fixture
def bars(monkeypatch):
    """Every bar made through offload.progress, as {desc: (total, n, disabled)} when it is closed."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    seen = {}

    class Recording(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.record = (kwargs["desc"], kwargs["total"], self.disable)  # a disabled bar keeps no desc

        def close(self):
            desc, total, silent = self.record
            seen[desc] = (total, self.n, silent)
            super().close()

    monkeypatch.setattr(progress_module, "tqdm", Recording)
    yield seen
    progress_module._forced = None  # back to the terminal's choice


def _engine(tmp_path, stage, offload_param="none"):
    zo = {
        "stage": stage,
        "sub_group_size": 4096,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
    }
    if offload_param != "none":
        zo["offload_param"] = {"device": offload_param, "nvme_path": str(tmp_path), "max_in_cpu": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zo,
    }
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(CFG), config=cfg)
    x, y = get_batch(corpus_bytes(), 2, CFG.seq_len, 0)
    engine.backward(engine(x, y))
    engine.step()
    return engine


def test_policy_quiet_off_a_terminal_and_when_asked(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    try:
        assert are_progress_bars_disabled()  # pytest's stderr is not a terminal
        enable_progress_bars()
        assert not are_progress_bars_disabled()
        monkeypatch.setenv(DISABLE_ENV, "1")  # the environment wins over enable_progress_bars()
        assert are_progress_bars_disabled()
        monkeypatch.setenv(DISABLE_ENV, "0")
        assert not are_progress_bars_disabled()
        disable_progress_bars()
        assert are_progress_bars_disabled()
    finally:
        progress_module._forced = None


def test_checkpoint_bars_count_the_bytes_of_the_files(tmp_path, bars, capfd):
    enable_progress_bars()
    engine = _engine(tmp_path, stage=3, offload_param="nvme")
    info = engine.optimizer_state_info()
    part_bytes = sum(u.part_nbytes for u in engine.layout.partitioner.units)
    # the first placement: every parameter partition and the whole optimizer state written to NVMe
    assert bars["zero: writing parameters to NVMe"] == (part_bytes, part_bytes, False)
    state_total = bars["zero: writing the optimizer state to NVMe"][0]
    assert state_total == info.numel * 4 * 3  # fp32 master + two AdamW states
    assert bars["zero: writing the optimizer state to NVMe"][1] == state_total

    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    optim = os.path.getsize(tmp_path / "ckpt" / "t" / "optim_rank0.bin")
    params = os.path.getsize(tmp_path / "ckpt" / "t" / "param_rank0.bin")
    assert bars["save_checkpoint: optimizer state"] == (optim, optim, False)
    assert bars["save_checkpoint: parameters"] == (params, params, False)

    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert bars["load_checkpoint: optimizer state"] == (optim, optim, False)
    assert bars["load_checkpoint: parameters"] == (params, params, False)
    verified = bars["load_checkpoint: verifying"]
    assert verified[0] == verified[1] >= optim + params

    from zero.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t")
    names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    params_bytes = sum(v.numel() * 4 for v in {id(v): v for k, v in sd.items() if k in names}.values())
    total, n, _ = bars["zero-to-fp32: reading"]
    assert total == n == params_bytes
    engine.close()
    err = capfd.readouterr().err
    assert "save_checkpoint: optimizer state" in err and "B/s" in err  # bytes, with a rate


def test_quiet_by_default_when_stderr_is_not_a_terminal(tmp_path, bars, capfd):
    engine = _engine(tmp_path, stage=2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    engine.close()
    assert bars and all(disabled for _, _, disabled in bars.values())
    assert "checkpoint:" not in capfd.readouterr().err


def test_disabled_by_the_environment(tmp_path, bars, capfd, monkeypatch):
    enable_progress_bars()
    monkeypatch.setenv(DISABLE_ENV, "1")
    engine = _engine(tmp_path, stage=2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    engine.close()
    assert bars["save_checkpoint: optimizer state"][2] is True
    assert "save_checkpoint" not in capfd.readouterr().err


def test_from_pretrained_bar_counts_the_checkpoint_bytes(tmp_path, bars):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    enable_progress_bars()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    model.save_pretrained(tmp_path / "gpt2", max_shard_size=12_000)
    (tmp_path / "nvme").mkdir()
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "max_in_cpu": 0},
        },
    }
    engine = zero.from_pretrained(str(tmp_path / "gpt2"), config=cfg, swap_cache=True)
    read = engine.load_report.checkpoint_bytes_read
    assert bars["zero.from_pretrained: building the swap cache"] == (read, read, False)
    assert "zero: writing parameters to NVMe" not in bars or bars["zero: writing parameters to NVMe"][2]
    engine.close()
