"""DeepSpeed 0.19 config keys honoured or refused with what to use: data_types.grad_accum_dtype (checked
against the gradients the engine really accumulates), gradient_allreduce_op, the stage3_* field names
without their prefix, sub_group_size below the engine's minimum, zenflow."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model

import zero
import zero.utils as ds_utils
from offload.config import MIN_SUB_GROUP_SIZE, ConfigError, load_config
from zero.examples.models import get_batch


def _error(config, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    return str(info.value)


# --------------------------------------------------------------------------------- grad_accum_dtype
def test_grad_accum_dtype_is_honoured_where_the_engine_accumulates_in_it(caplog):
    fp32 = {"data_types": {"grad_accum_dtype": "float32"}}
    assert load_config(fp32).data_types.grad_accum_dtype == "fp32"  # an fp32 model
    for stage, device in ((2, "cpu"), (3, "nvme")):
        cfg = {
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": stage,
                "offload_optimizer": {"device": device, "nvme_path": "/tmp"},
            },
        }
        assert load_config({**cfg, **fp32}).data_types.grad_accum_dtype == "fp32"
        with caplog.at_level(logging.WARNING, logger="offload.config"):
            got = load_config({**cfg, "data_types": {"grad_accum_dtype": "bf16"}})
        assert got.data_types.grad_accum_dtype == "fp32" and "more precisely than asked" in caplog.text
    bf16_stage0 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    assert load_config(
        {**bf16_stage0, "data_types": {"grad_accum_dtype": "bf16"}}
    ).data_types.grad_accum_dtype
    msg = _error({**bf16_stage0, **fp32})
    assert msg.startswith("data_types.grad_accum_dtype in <dict>:")
    assert "stages 2-3 with zero_optimization.offload_optimizer.device cpu or nvme" in msg
    assert "accumulate in bf16" in msg
    assert "fp16 accumulation of a bf16 model" in _error(
        {**bf16_stage0, "data_types": {"grad_accum_dtype": "fp16"}}
    )
    assert "must be one of fp32, fp16, bf16" in _error({"data_types": {"grad_accum_dtype": "fp64"}})


def test_fp32_accumulation_under_bf16_is_what_the_engine_does(tmp_path):
    """bf16 at stage 2 with the optimizer on the CPU, four micro-batches: the accumulated gradient is the
    fp32 sum of the four bf16 gradients, not a bf16 sum."""
    gas = 4
    cfg = base_config("cpu", tmp_path, stage=2, bf16={"enabled": True}, gradient_accumulation_steps=gas)
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    ref = make_model().to(torch.bfloat16)
    sums = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
    for step in range(gas):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        if step < gas - 1:
            engine.step()
        ref.zero_grad()
        (ref(x, y).float() * (1.0 / gas)).backward()
        for n, p in ref.named_parameters():
            sums[n] += p.grad.float()
    names = dict(engine.module.named_parameters())
    finer = 0
    for n, want in sums.items():
        got = ds_utils.safe_get_full_grad(names[n])
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-9), n
        finer += int((got != got.bfloat16().float()).sum())
    assert finer > 0  # bits a bf16 sum could not hold
    engine.close()


# ----------------------------------------------------------------------------- gradient_allreduce_op
def test_gradient_allreduce_op():
    assert load_config({"gradient_allreduce_op": "MEAN"}).gradient_allreduce_op == "mean"
    assert load_config({"gradient_allreduce_op": "sum"}).gradient_allreduce_op == "sum"  # one rank: the same
    msg = _error({"gradient_allreduce_op": "sum", "train_micro_batch_size_per_gpu": 1}, world_size=2)
    assert "averaged over the 2 ranks" in msg and "multiply the loss by the world size" in msg
    assert "must be 'mean' or 'sum'" in _error({"gradient_allreduce_op": "max"})


# -------------------------------------------------------------------------------- stage3 short names
@pytest.mark.parametrize(
    "short, value",
    [
        ("param_persistence_threshold", 123),
        ("prefetch_bucket_size", 4567),
        ("max_live_parameters", 89000),
        ("model_persistence_threshold", 1000),
        ("max_reuse_distance", 0),
        ("gather_16bit_weights_on_model_save", True),
    ],
)
def test_stage3_fields_without_their_prefix(short, value):
    z = load_config({"zero_optimization": {"stage": 3, short: value}}).zero_optimization
    assert getattr(z, "stage3_" + short) == value
    msg = _error({"zero_optimization": {"stage": 3, short: value, "stage3_" + short: value}})
    assert f"zero_optimization.{short} and zero_optimization.stage3_{short}" in msg and "only one" in msg


def test_short_name_reaches_the_engine(tmp_path):
    cfg = base_config(stage=3)
    cfg["zero_optimization"]["param_persistence_threshold"] = 10**9  # every unit persistent
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    x, y = get_batch(DATA, 4, TINY.seq_len, 0)
    with torch.no_grad():
        engine(x, y)
    assert all(p.ds_status is zero.ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    engine.close()


# ------------------------------------------------------------------------------- sub_group_size, zenflow
def test_small_sub_group_size_trains_with_the_minimum(tmp_path, caplog):
    cfg = base_config("cpu", tmp_path, stage=1)
    cfg["zero_optimization"]["sub_group_size"] = 16
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
    assert f"= 16 is below {MIN_SUB_GROUP_SIZE}: {MIN_SUB_GROUP_SIZE} is used" in caplog.text
    assert engine.zero_sub_group_size() == MIN_SUB_GROUP_SIZE
    assert engine.optimizer_state_info().chunk_numel == MIN_SUB_GROUP_SIZE
    engine.close()


def test_zenflow_is_refused_naming_what_to_use():
    msg = _error({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})
    assert msg.startswith("zero_optimization.zenflow in <dict>:")
    assert "offload_optimizer.ratio" in msg and "pipeline_read" in msg
    assert "zero_offload.delayed_update" in msg
    # what it names is a key this config accepts
    assert load_config(
        {"zero_offload": {"delayed_update": {"enabled": True}}}
    ).zero_offload.delayed_update.enabled
    assert load_config({"zero_optimization": {"zenflow": None}}).zero_optimization.stage == 0
