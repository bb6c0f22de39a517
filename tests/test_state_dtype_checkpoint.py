"""Checkpoints keep the optimizer states in the dtype they live in, and load across dtypes.

* Same dtype: bf16 states saved and loaded (NVMe or pinned host) continue bit for bit like the run that
  never stopped; the optimizer file holds 4 + 2 + 2 bytes per element (Adam), not 12.
* Across dtypes: an fp32 checkpoint into bf16 states rounds them (with a warning) and keeps the master
  exact; a bf16 checkpoint into fp32 states is exact (no warning). The same for state dicts.
* zero-to-fp32 reads only the fp32 master, whatever the states' dtype.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from engine_helpers import base_config, make_model, train

import zero
from offload import ops
from zero.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint


def config(offload: str, tmp, state_dtype: str, stage: int = 2):
    cfg = base_config(offload, tmp, stage=stage)
    cfg["optimizer"]["params"]["state_dtype"] = state_dtype
    return cfg


def snapshot(engine):
    sd = engine.optimizer.state_dict()
    weights = {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}
    return weights, sd


BYTES = {"bf16": 4 + 2 + 2, "int8": 4 + 1 + 1}


@pytest.mark.parametrize("offload,dtype", [("nvme", "bf16"), ("cpu", "bf16"), ("nvme", "int8")])
def test_same_dtype_round_trip_is_bit_exact(tmp_path, offload, dtype):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = config(offload, nvme, dtype)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, 3)
    engine.save_checkpoint(str(ckpt), tag="t3")
    saved_states = engine.optimizer.state_dict()["states"]
    want_losses = train(engine, 2, start=3)
    want = snapshot(engine)
    part = engine.optimizer_state_info().numel
    engine.close()
    scales = 2 * 4 * -(-part // 2048) if dtype == "int8" else 0  # int8: the absmax beside the codes
    assert os.path.getsize(ckpt / "t3" / "optim_rank0.bin") == part * BYTES[dtype] + scales

    engine, *_ = zero.initialize(model=make_model(seed=1), config=cfg)
    engine.load_checkpoint(str(ckpt), tag="t3")
    loaded = engine.optimizer.state_dict()["states"]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(loaded, saved_states))
    assert train(engine, 2, start=3) == want_losses
    got = snapshot(engine)
    engine.close()
    for k in want[0]:
        assert torch.equal(got[0][k], want[0][k]), k
    assert torch.equal(got[1]["master"], want[1]["master"])
    assert all(torch.equal(a, b) for a, b in zip(got[1]["states"], want[1]["states"]))


def as_dtype(states, src: str, dst: str):
    """What loading `src` states into `dst` must give, computed with offload.ops directly."""
    if src == "int8":
        states = [
            ops.dequantize_blockwise(q, a, sg) for q, a, sg in zip(states[:2], states[2:], (True, False))
        ]
    if dst == "int8":
        pairs = [ops.quantize_blockwise(v.float(), sg) for v, sg in zip(states, (True, False))]
        return [q for q, _ in pairs] + [a for _, a in pairs]
    return [v.to(torch.bfloat16 if dst == "bf16" else torch.float32) for v in states]


@pytest.mark.parametrize(
    "src,dst", [("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "int8"), ("int8", "fp32"), ("bf16", "int8")]
)
def test_checkpoint_loads_across_state_dtypes(tmp_path, src, dst):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    engine, *_ = zero.initialize(model=make_model(), config=config("nvme", nvme, src))
    train(engine, 3)
    engine.save_checkpoint(str(ckpt), tag="t")
    saved = engine.optimizer.state_dict()
    engine.close()

    engine, *_ = zero.initialize(model=make_model(seed=1), config=config("nvme", nvme, dst))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(str(ckpt), tag="t")
    rounded = [w for w in caught if "precision is lost" in str(w.message)]
    assert len(rounded) == (0 if dst == "fp32" else 1)
    if rounded:
        text = str(rounded[0].message)
        assert f"saved as {src}" in text and f"keeps them as {dst}" in text
    got = engine.optimizer.state_dict()
    assert torch.equal(got["master"], saved["master"]) and got["step"] == saved["step"] == 3
    want = as_dtype(saved["states"], src, dst)
    assert len(got["states"]) == len(want)
    for a, b in zip(got["states"], want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    train(engine, 1, start=3)  # and it trains on
    engine.close()


def test_state_dict_loads_across_state_dtypes(tmp_path):
    engine, *_ = zero.initialize(model=make_model(), config=config("cpu", tmp_path, "fp32"))
    train(engine, 2)
    saved = engine.optimizer.state_dict()
    engine.close()
    engine, *_ = zero.initialize(model=make_model(seed=1), config=config("cpu", tmp_path, "bf16"))
    with pytest.warns(UserWarning, match="precision is lost"):
        engine.optimizer.load_state_dict(saved)
    got = engine.optimizer.state_dict()
    assert torch.equal(got["master"], saved["master"])
    assert all(torch.equal(a, b.bfloat16()) for a, b in zip(got["states"], saved["states"]))
    engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_zero_to_fp32_reads_the_master_of_low_bit_states(tmp_path, dtype):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    engine, *_ = zero.initialize(model=make_model(), config=config("nvme", nvme, dtype))
    train(engine, 2)
    engine.save_checkpoint(str(ckpt), tag="t")
    want = engine.fp32_master_state_dict()
    engine.close()
    got = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
