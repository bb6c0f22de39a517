"""`zero_optimization.offload_optimizer.nvme_copies`: the NVMe optimizer state's disk footprint as a choice.

* 1: one copy, updated in place, half the disk. A write that fails part way through a step tears it: step,
  backward and saves raise StateCorruptedError until a checkpoint is loaded, after which training continues
  bit for bit like a run that never failed (fp32 and bf16 states).
* 2 on a disk that cannot hold two copies: an error naming the sizes, before anything is written.
* 1 with pipeline_read/pipeline_write (which drop a pass by going back to the other copy): a ConfigError.
"""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model, train
from state_helpers import fail_nth_write

import zero
from offload.config import ConfigError, load_config
from zero import StateCorruptedError
from zero.examples.models import get_batch


def config(tmp, copies, state_dtype: str = "fp32", **off):
    cfg = base_config("nvme", tmp, stage=2)
    cfg["optimizer"]["params"]["state_dtype"] = state_dtype
    cfg["zero_optimization"]["offload_optimizer"].update(nvme_copies=copies, **off)
    return cfg


def weights(engine) -> dict:
    return {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}


def test_one_copy_is_half_the_disk_and_chosen_without_warning(tmp_path):
    infos = {}
    for copies in (1, 2, "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the disk has room: no "updated in place" warning
            engine, *_ = zero.initialize(model=make_model(), config=config(tmp_path, copies))
        infos[copies] = engine.optimizer_state_info()
        engine.close()
    assert infos[1].copies == 1 and infos[2].copies == 2 and infos["auto"].copies == 2
    assert infos[2].disk_bytes == 2 * infos[1].disk_bytes == infos["auto"].disk_bytes


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_one_copy_write_error_poisons_until_a_checkpoint_is_loaded(tmp_path, state_dtype):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = config(nvme, 1, state_dtype)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    ref_losses = train(engine, 5)
    ref_w, ref_state = weights(engine), engine.optimizer.state_dict()
    engine.close()

    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    sw = engine.optimizer_state
    assert sw.copies == 1 and len(sw.chunks) >= 4
    train(engine, 2)
    engine.save_checkpoint(str(ckpt), tag="good")
    fired = fail_nth_write(sw, 3)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    engine.backward(engine(x, y))
    with pytest.raises(StateCorruptedError, match="load a checkpoint") as info:
        engine.step()
    assert fired, "the injected failure did not fire"
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    with pytest.raises(StateCorruptedError):
        engine.step()  # a retry would apply the update twice to the chunks already written
    with pytest.raises(StateCorruptedError):
        engine.backward(engine(x, y))
    with pytest.raises(StateCorruptedError):
        engine.save_checkpoint(str(ckpt), tag="torn")
    assert sorted(os.listdir(ckpt)) == ["good", "latest"]

    engine.load_checkpoint(str(ckpt), tag="good")
    assert engine.state_error is None
    losses = train(engine, 3, start=2)
    w, state = weights(engine), engine.optimizer.state_dict()
    engine.close()
    assert losses == ref_losses[2:]
    assert all(torch.equal(w[k], ref_w[k]) for k in ref_w)
    assert torch.equal(state["master"], ref_state["master"])
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(state["states"], ref_state["states"]))


def test_two_copies_on_a_short_disk_fail_with_the_sizes(tmp_path, monkeypatch):
    from zero.optimizer.tiers import build as optimizer_state

    monkeypatch.setattr(optimizer_state, "_disk_free", lambda path: 1000)
    with pytest.raises(ValueError, match=r"nvme_copies=2: .* 1000 bytes free, two copies .* need \d+ bytes"):
        zero.initialize(model=make_model(), config=config(tmp_path, 2))
    assert os.listdir(tmp_path) == []  # nothing was written
    with pytest.warns(UserWarning, match="updated in place"):
        engine, *_ = zero.initialize(model=make_model(), config=config(tmp_path, "auto"))
    assert engine.optimizer_state_info().copies == 1
    engine.close()


def test_config_values_and_the_overlap_conflict():
    off = {"device": "nvme", "nvme_path": "/tmp"}
    load = lambda **kw: load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {**off, **kw}}})  # noqa: E731
    assert load().zero_optimization.offload_optimizer.nvme_copies == "auto"
    assert load(nvme_copies=1).zero_optimization.offload_optimizer.nvme_copies == 1
    for bad in (0, 3, "two", True, 1.0):
        with pytest.raises(ConfigError, match="nvme_copies"):
            load(nvme_copies=bad)
    for key in ("pipeline_read", "pipeline_write"):
        with pytest.raises(ConfigError, match="nvme_copies.*pipeline_read/pipeline_write"):
            load(nvme_copies=1, **{key: True})
    assert load(nvme_copies=2, pipeline_read=True).zero_optimization.offload_optimizer.pipeline
