"""The pieces of DeepSpeed's contract that transformers, TRL, PEFT, accelerate and Lightning read, each with
DeepSpeed's meaning: the stage-3 parameter attributes (ds_numel, ds_shape, ds_id, ds_status, ds_tensor),
GatheredParameters' and Init's signatures."""

from __future__ import annotations

import json

import pytest
import torch
from test_stage3_helpers import MLP, s3_config
from torch import nn

import zero
from zero.stage3 import GatheredParameters, Init, PartitionStatus, Stage3Partitioner

AVAILABLE, NOT_AVAILABLE, INFLIGHT = (
    zero.ZeroParamStatus[n] for n in ("AVAILABLE", "NOT_AVAILABLE", "INFLIGHT")
)


def _partitioned_mlp(tier, tmp_path, seed=0):
    torch.manual_seed(seed)
    plain = MLP()
    torch.manual_seed(seed)
    model = MLP()
    # buffer_size: every NVMe partition fits a staging slot, so the trace can prefetch it; no unit is kept
    # gathered for its next use, so each one is fetched again every time
    cfg = s3_config(tier, tmp_path, offload_param={"buffer_size": 4000}, stage3_max_reuse_distance=0)
    part = Stage3Partitioner(cfg)
    part.attach(model)
    return plain, model, part


# ------------------------------------------------------------------------------- parameter attributes
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_partitioned_parameters_carry_deepspeeds_attributes(tier, tmp_path):
    plain, model, part = _partitioned_mlp(tier, tmp_path)
    assert zero.ZeroParamStatus is PartitionStatus
    ids = [p.ds_id for p in model.parameters()]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) for i in ids)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.numel() == 0 and p.ds_status is NOT_AVAILABLE and p.ds_status.name == "NOT_AVAILABLE"
        assert p.ds_numel == q.numel() and p.ds_shape == q.shape and isinstance(p.ds_shape, torch.Size)
        t = p.ds_tensor
        assert t.ds_numel == q.numel()  # one rank: the whole parameter is this rank's partition
        if tier == "nvme":
            assert t.numel() == 0 and t.final_location == "nvme" and t.dtype == q.dtype
        else:
            assert t.dim() == 1 and torch.equal(t, q.detach().reshape(-1)), name
    with GatheredParameters(model.parameters()):
        for p, q in zip(model.parameters(), plain.parameters()):
            assert p.ds_status is AVAILABLE and p.shape == p.ds_shape and torch.equal(p, q)
    assert all(p.ds_status is NOT_AVAILABLE and p.numel() == 0 for p in model.parameters())
    if tier == "cpu":  # ds_tensor is the partition itself: in-place changes are the parameter's
        model.out.bias.ds_tensor.fill_(3.0)
        with GatheredParameters(model.out.bias):
            assert torch.equal(model.out.bias, torch.full((4,), 3.0))
    x = torch.randn(2, 16)
    model(x)  # the first pass records the order of uses
    seen, h0 = {}, model.hidden[0].weight  # read outside a forward (inside, reading it would gather it)
    model.inp.register_forward_hook(lambda *_: seen.update(h0=h0.ds_status))
    out = model(x)
    if tier == "nvme":  # read ahead while `inp` runs: being fetched, not gathered yet
        assert seen["h0"] is INFLIGHT and seen["h0"].name == "INFLIGHT"
    else:
        assert seen["h0"] is NOT_AVAILABLE
    out.sum().backward()
    assert all(p.ds_status is NOT_AVAILABLE for p in model.parameters())
    part.close()
    assert all(p.ds_tensor.numel() == 0 for p in model.parameters())  # no view of freed memory survives


def test_gathered_parameters_takes_deepspeeds_arguments(tmp_path):
    _, model, part = _partitioned_mlp("cpu", tmp_path)
    w = model.hidden[0].weight
    with GatheredParameters(w, modifier_rank=0, enabled=False):  # a no-op
        assert w.numel() == 0 and w.ds_status is NOT_AVAILABLE
    # a generator, with duplicates and a parameter stage 3 does not manage (ignored), positionally
    stray = nn.Parameter(torch.ones(3))
    with GatheredParameters((p for p in [w, stray, w, model.out.bias]), 0, None, True):
        assert w.shape == w.ds_shape and model.out.bias.shape == (4,)
        w.data.fill_(0.5)
    assert torch.equal(w.ds_tensor, torch.full((w.ds_numel,), 0.5))  # modifier_rank: written back
    with GatheredParameters([stray]):  # nothing partitioned: nothing to do
        pass
    with GatheredParameters([model.inp.weight], fwd_module=model.out):
        pass
    assert model.inp.weight.ds_unit in part.hooks.externals[model.out]  # registered as external
    part.close()


def test_init_takes_deepspeeds_arguments(tmp_path):
    cfg = s3_config("cpu")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    built = MLP()
    want = {n: p.detach().clone() for n, p in built.named_parameters()}
    zi = Init(module=built, config_dict_or_path=str(path))  # an already built module, a JSON path
    assert all(p.numel() == 0 and p.ds_status is NOT_AVAILABLE for p in built.parameters())
    with GatheredParameters(built.parameters()):
        assert all(torch.equal(p, want[n]) for n, p in built.named_parameters())
    zi.partitioner.close()
    # DeepSpeed's positional order: module, data_parallel_group, mem_efficient_linear, remote_device, ...
    with Init(None, None, False, "cpu", False, cfg) as zi:
        lin = nn.Linear(3, 3)
    assert lin.weight.ds_numel == 9 and zi.partitioner.store.tier == "cpu"
    zi.partitioner.close()
    with Init(config_dict_or_path=cfg, enabled=False):
        lin = nn.Linear(3, 3)
    assert lin.weight.numel() == 9 and not hasattr(lin.weight, "ds_id")

    # a training config's batch sizes are checked against the data-parallel world size (mpu's here)
    training = {
        **cfg,
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
    }

    class Mpu:
        def get_data_parallel_world_size(self):
            return 2

    Init(config_dict_or_path=training, mpu=Mpu()).partitioner.close()
    with pytest.raises(Exception, match="world_size \\(1\\)"):
        Init(config_dict_or_path=training)
    for kwargs in (
        {"zero_quantized_weights": True},
        {"param_swapper": object()},
        {"zero_param_parallel_group": 1},
    ):
        with pytest.raises(NotImplementedError):
            Init(config_dict_or_path=cfg, **kwargs)
    with pytest.raises(ValueError, match="dtype"):
        Init(config_dict_or_path=cfg, dtype=torch.int8)
    with pytest.raises(ValueError, match="not both"):
        Init(config_dict_or_path=cfg, data_parallel_group=1, sequence_data_parallel_group=1)
