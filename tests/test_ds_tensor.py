"""DeepSpeed's `param.ds_tensor` (zero.stage3.shard): this rank's share of a stage-3 parameter, and every
way DeepSpeed code writes one - `ds_tensor.data = t`, `ds_tensor.copy_(t)`, `ds_tensor.data.copy_(t)`,
in-place methods - reaches the partition: the next gather (forward, GatheredParameters) sees the new
values, with the partition in memory and on NVMe, on one rank and on two; an optimizer step then
overwrites the 16-bit partition from the fp32 master, as DeepSpeed's does."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from dist_helpers import run_on_ranks
from engine_helpers import DATA, TINY, make_model
from engine_helpers import s3_config as engine_s3_config
from stage3_helpers import MLP, s3_config

import zero
import zero.utils as ds_utils
from offload.config import load_config
from zero.examples.models import get_batch
from zero.stage3 import GatheredParameters, Stage3Partitioner
from zero.stage3.quant import quantization_plan

TIERS = ["cpu", "nvme"]


def _attached(tier, tmp_path, **zero_extra):
    torch.manual_seed(0)
    model = MLP()
    part = Stage3Partitioner(s3_config(tier, tmp_path, **zero_extra))
    part.attach(model)
    return model, part


def _gathered(p):
    with GatheredParameters([p]):
        return p.detach().clone()


@pytest.mark.parametrize("tier", TIERS)
def test_sizes_and_location(tier, tmp_path):
    model, part = _attached(tier, tmp_path)
    for p in model.parameters():
        t = p.ds_tensor
        assert t.ds_numel == p.ds_numel  # one rank: ceil(numel / 1)
        assert t.final_location == ("nvme" if tier == "nvme" else None)
        assert t.numel() == (0 if tier == "nvme" else p.ds_numel) and t.dtype == torch.float32
        # copied or saved: a plain tensor of the values (as DeepSpeed's), writing nowhere
        c = copy.deepcopy(t)
        assert type(c) is torch.Tensor and torch.equal(c, t) and c.ds_numel == t.ds_numel
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf), t)
    part.close()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("how", ["data_assign", "copy_", "data_copy_"])
def test_a_write_reaches_the_next_gather_and_forward(tier, how, tmp_path):
    model, part = _attached(tier, tmp_path)
    w = model.hidden[1].weight
    new = torch.linspace(-1.0, 1.0, w.ds_numel)
    if how == "data_assign":
        w.ds_tensor.data = new.view(w.ds_shape)  # any shape with the share's element count
    elif how == "copy_":
        w.ds_tensor.copy_(new)
    else:
        w.ds_tensor.data.copy_(new)
    assert torch.equal(_gathered(w).reshape(-1), new)
    if tier == "cpu":  # the shard still views the partition (not rebound to `new`'s storage)
        assert torch.equal(w.ds_tensor, new) and w.ds_tensor.data_ptr() != new.data_ptr()
    torch.manual_seed(0)
    plain = MLP()
    with torch.no_grad():
        plain.hidden[1].weight.copy_(new.view(w.ds_shape))
    x = torch.randn(3, 16)
    assert torch.equal(model(x), plain(x))
    part.close()


@pytest.mark.parametrize("tier", TIERS)
def test_in_place_methods(tier, tmp_path):
    model, part = _attached(tier, tmp_path)
    b = model.out.bias
    before = _gathered(b)
    if tier == "nvme":  # no values in memory to work on: refused, the partition left as it was
        with pytest.raises(RuntimeError, match="not in memory.*NVMe"):
            b.ds_tensor.add_(1.0)
        assert torch.equal(_gathered(b), before)
    else:
        out = b.ds_tensor.add_(1.0)
        assert out is b.ds_tensor
        assert torch.equal(_gathered(b), before + 1.0)
        torch.nn.init.constant_(b.ds_tensor, 2.0)
        b.ds_tensor[0] = 9.0
        assert torch.equal(_gathered(b), torch.tensor([9.0, 2.0, 2.0, 2.0]))
    part.close()


@pytest.mark.parametrize("tier", TIERS)
def test_gathered_copies_follow(tier, tmp_path):
    """A unit gathered while its ds_tensor is written gets the new share in its full buffer: kept gathered
    (persistent; on the host tier gathered from a copy read ahead, not the partition itself) and held
    inside a GatheredParameters block."""
    model, part = _attached(tier, tmp_path, stage3_param_persistence_threshold=10**6)
    part.read_ahead = True  # host partitions are copied ahead even on the CPU: the full buffer is a copy
    w, b = model.hidden[0].weight, model.hidden[0].bias
    x = torch.randn(2, 16)
    torch.manual_seed(0)
    plain = MLP()
    with torch.no_grad():
        model(x)  # persistent units stay gathered after their first use
        assert w.ds_status is zero.ZeroParamStatus.AVAILABLE
        assert w.data_ptr() != w.ds_tensor.data_ptr() or tier == "nvme"
        w.ds_tensor.data = torch.full((w.ds_numel,), 0.25)
        plain.hidden[0].weight.fill_(0.25)
        if tier == "cpu":  # an in-place method as well
            b.ds_tensor.mul_(2.0)
            plain.hidden[0].bias.mul_(2.0)
        assert torch.equal(model(x), plain(x))
    with GatheredParameters([w]):
        w.ds_tensor.copy_(torch.full((w.ds_numel,), -0.5))
        assert bool((w == -0.5).all())
    assert bool((_gathered(w) == -0.5).all())
    part.close()


def test_bad_writes_are_refused(tmp_path):
    model, part = _attached("nvme", tmp_path)
    w = model.out.weight
    before = _gathered(w)
    with pytest.raises(ValueError, match=r"'out.weight'.*160 elements, got a tensor of 3"):
        w.ds_tensor.data = torch.ones(3)
    assert torch.equal(_gathered(w), before)
    part.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.ds_tensor.data = torch.ones(w.ds_numel)


@pytest.mark.parametrize("param", ["none", "nvme"])
def test_engine_forward_sees_the_write_and_the_step_follows_the_master(param, tmp_path):
    engine, *_ = zero.initialize(model=make_model(), config=engine_s3_config(param, "cpu", tmp_path))
    p = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
    new = torch.randn(p.ds_numel, generator=torch.Generator().manual_seed(1)) * 0.05
    p.ds_tensor.data = new
    plain = make_model()
    with torch.no_grad():
        dict(plain.named_parameters())["blocks.0.fc.weight"].copy_(new.view(p.ds_shape))
    x, y = get_batch(DATA, 4, TINY.seq_len, 0)
    loss = engine(x, y)
    want = plain(x, y)
    assert abs(loss.item() - want.item()) < 1e-5  # the forward computed with the written values
    engine.backward(loss)
    engine.step()
    # DeepSpeed's step writes the fp32 master into the 16-bit partition: the write does not survive it
    master = ds_utils.safe_get_full_fp32_param(p)
    assert torch.equal(_gathered(p), master.to(p.dtype))
    assert not torch.allclose(_gathered(p).reshape(-1), new, atol=1e-2)
    engine.close()


def _two_ranks(rank, world_size, nvme_dir, out_dir):
    res = {}
    for tier in TIERS:
        torch.manual_seed(0)
        model = MLP()
        part = Stage3Partitioner(s3_config(tier, nvme_dir))
        part.attach(model)
        w = model.hidden[2].weight
        res[tier, "sizes"] = {
            n: (p.ds_tensor.ds_numel, p.ds_partition_range) for n, p in model.named_parameters()
        }
        w.ds_tensor.data = torch.full((w.ds_tensor.ds_numel,), float(rank + 1))  # each rank its own share
        res[tier, "gathered"] = _gathered(w)
        res[tier, "out"] = model(torch.ones(2, 16))
        part.close()
    return res


def test_two_ranks(tmp_path):
    (r0, r1), _ = run_on_ranks(_two_ranks, tmp_path)
    for tier in TIERS:
        w_numel = 40 * 40
        (n0, (a0, z0)), (n1, (a1, z1)) = (
            r0[tier, "sizes"]["hidden.2.weight"],
            r1[tier, "sizes"]["hidden.2.weight"],
        )
        assert n0 + n1 == w_numel and (a0, z1) == (0, w_numel) and z0 == a1
        want = torch.cat([torch.full((n0,), 1.0), torch.full((n1,), 2.0)]).view(40, 40)
        for r in (r0, r1):
            assert torch.equal(r[tier, "gathered"], want), tier
        torch.manual_seed(0)
        plain = MLP()
        with torch.no_grad():
            plain.hidden[2].weight.copy_(want)
        ref = plain(torch.ones(2, 16))
        assert torch.equal(r0[tier, "out"], ref) and torch.equal(r1[tier, "out"], ref), tier


def test_a_partition_stored_quantized(tmp_path):
    """A weight stored int8 (ZeRO-Inference's weight_quantization): its ds_tensor is a placeholder; a write
    re-encodes only the written parameter, the unit's other parameters keep their stored values."""
    cfg = s3_config("cpu", tmp_path)
    cfg["weight_quantization"] = {"quantized_initialization": {"num_bits": 8}}
    torch.manual_seed(0)
    model = MLP()
    part = Stage3Partitioner(cfg)
    part.set_quantization(quantization_plan(model, load_config(cfg).weight_quantization))
    part.attach(model)
    w, b = model.hidden[0].weight, model.hidden[0].bias
    assert part.codec(w.ds_unit) is not None and w.ds_tensor.numel() == 0
    w_before = _gathered(w)
    b.ds_tensor.data = torch.arange(40.0)
    assert torch.equal(_gathered(b), torch.arange(40.0)) and torch.equal(_gathered(w), w_before)
    w.ds_tensor.copy_(torch.full((w.ds_numel,), 0.5))  # a constant group is exact in int8
    assert bool((_gathered(w) == 0.5).all()) and torch.equal(_gathered(b), torch.arange(40.0))
    part.close()
