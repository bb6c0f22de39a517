"""The pieces of DeepSpeed's contract that transformers, TRL, PEFT, accelerate and Lightning read, each with
DeepSpeed's meaning: the stage-3 parameter attributes (ds_numel, ds_shape, ds_id, ds_status, ds_tensor),
GatheredParameters' and Init's signatures, get_global_grad_norm, set_gradient_accumulation_boundary,
backward's scale_wrt_gas, optimizer.overflow, the 16-bit export, load_checkpoint's return value, the
client-optimizer rule, and the launcher conventions (--local_rank, LOCAL_RANK, an existing process group,
add_config_arguments)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_on_ranks
from engine_helpers import DATA, TINY, base_config, make_model, train
from stage3_helpers import MLP, s3_config
from torch import nn

import zero
from zero import deepspeed_api
from zero.examples.models import get_batch
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


# ------------------------------------------------------------------------------------ engine methods
def _torch_norms(steps, gas=1, clip=0.0, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, adamw=True):
    """Plain torch: each step's total gradient norm (clip_grad_norm_'s return value) and the losses."""
    model = make_model()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(model.parameters(), lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)
    norms, losses = [], []
    for step in range(steps):
        for k in range(gas):
            x, y = get_batch(DATA, 4, TINY.seq_len, step * gas + k)
            loss = model(x, y)
            (loss / gas).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)))
        opt.step()
        opt.zero_grad()
    return norms, losses


NORM_CASES = {
    "stage0-cpu": ({"stage": 0}, "cpu"),
    "stage2-nvme-chunks": ({"stage": 2}, "nvme"),  # 8000-element sub-groups: the norm summed per chunk
    "stage2-nvme-overlap": ({"stage": 2, "pipeline": True}, "nvme"),  # summed during backward
    "stage3-cpu-gas2": ({"stage": 3, "gas": 2}, "cpu"),
    "stage1-cpu-clip": ({"stage": 1, "clip": 0.05}, "cpu"),  # before clipping, as clip_grad_norm_
}


@pytest.mark.parametrize("case", NORM_CASES)
def test_get_global_grad_norm_equals_torchs_clip_grad_norm(case, tmp_path):
    opts, offload = NORM_CASES[case]
    gas, clip = opts.get("gas", 1), opts.get("clip", 0.0)
    cfg = base_config(offload, tmp_path, stage=opts["stage"], gradient_accumulation_steps=gas)
    if clip:
        cfg["gradient_clipping"] = clip
    if opts.get("pipeline"):
        cfg["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    want, _ = _torch_norms(3, gas=gas, clip=clip)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    assert engine.get_global_grad_norm() is None  # DeepSpeed's answer before the first step
    got = []
    for step in range(3):
        for k in range(gas):
            x, y = get_batch(DATA, 4, TINY.seq_len, step * gas + k)
            engine.backward(engine(x, y))
            engine.step()
        got.append(engine.get_global_grad_norm())
    # the overlap case: every pass was started by backward on the worker thread (how many chunks it stepped
    # before backward returned depends on timing)
    assert engine.overlap.enabled == bool(opts.get("pipeline"))
    engine.close()
    assert all(isinstance(g, float) for g in got)
    assert got == pytest.approx(want, rel=1e-4)


def test_sum_of_squares_is_accurate_for_every_gradient_dtype():
    from zero.optimizer.state import SQ_PIECE, sum_of_squares

    g = torch.randn(3 * SQ_PIECE + 12345, generator=torch.Generator().manual_seed(0)) * 1e3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = g.to(dtype)
        want = float(x.double().pow(2).sum())
        assert sum_of_squares(x) == pytest.approx(want, rel=3e-5), dtype  # one fp32 sum: up to ~1e-3
    g[SQ_PIECE + 1] = float("inf")
    assert sum_of_squares(g) == math.inf and math.isnan(sum_of_squares(g * 0))  # inf * 0: nan


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_optimizer_overflow_and_the_norm_of_a_skipped_step(offload, tmp_path):
    cfg = base_config(offload, tmp_path, fp16={"enabled": True, "initial_scale_power": 8})
    engine, opt, *_ = zero.initialize(model=make_model(), config=cfg)
    assert opt.overflow is False
    train(engine, 1)
    assert opt.overflow is False and math.isfinite(engine.get_global_grad_norm())
    x, y = get_batch(DATA, 4, TINY.seq_len, 1)
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    assert opt.overflow is True and engine.skipped_steps == 1
    assert not math.isfinite(engine.get_global_grad_norm())
    train(engine, 1, start=2)
    assert opt.overflow is False and math.isfinite(engine.get_global_grad_norm())
    engine.close()


def test_set_gradient_accumulation_boundary_as_accelerate_drives_it(tmp_path):
    """accelerate's loop: the boundary set before each backward, step() called once per window."""
    cfg = base_config("cpu", gradient_accumulation_steps=2)
    counted, *_ = zero.initialize(model=make_model(), config=cfg)
    train(counted, 6)  # step() after every micro-batch: the boundary counted from micro-batches
    driven, *_ = zero.initialize(model=make_model(), config=cfg)
    for window in range(3):
        for k in range(2):
            driven.set_gradient_accumulation_boundary(k == 1)
            assert driven.is_gradient_accumulation_boundary() == (k == 1)
            x, y = get_batch(DATA, 4, TINY.seq_len, 2 * window + k)
            driven.backward(driven(x, y))
        driven.step()
    assert driven.global_steps == counted.global_steps == 3
    for a, b in zip(counted.module.parameters(), driven.module.parameters()):
        assert torch.equal(a, b)
    assert driven.get_global_grad_norm() == counted.get_global_grad_norm()
    counted.close()
    driven.close()


def test_backward_scale_wrt_gas_false_takes_the_loss_as_given(tmp_path):
    """DeepSpeed's backward(loss, scale_wrt_gas=False): the caller divided the loss over the window itself
    (transformers' Trainer does), so the engine must not divide it by gradient_accumulation_steps again."""
    cfg = base_config("cpu", gradient_accumulation_steps=2)
    counted, *_ = zero.initialize(model=make_model(), config=cfg)
    divided, *_ = zero.initialize(model=make_model(), config=cfg)
    for step in range(4):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        counted.backward(counted(x, y))
        counted.step()
        divided.backward(divided(x, y) / 2, scale_wrt_gas=False)
        divided.step()
    assert divided.global_steps == counted.global_steps == 2
    for a, b in zip(counted.module.parameters(), divided.module.parameters()):
        assert torch.equal(a, b)
    assert divided.get_global_grad_norm() == counted.get_global_grad_norm()
    counted.close()
    divided.close()


def test_client_optimizer_wins_over_the_config_block(tmp_path, caplog):
    """DeepSpeed's rule: optimizer= and an optimizer block -> the client optimizer, with a warning."""
    model = make_model()
    client = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.8, 0.9), weight_decay=0.0)
    with caplog.at_level(logging.WARNING, logger="zero"):
        engine, opt, *_ = zero.initialize(model=model, optimizer=client, config=base_config("cpu"))
    assert "'optimizer' block (type 'adamw') is ignored" in caplog.text  # names what is ignored
    assert engine.rule.kind == "adam"
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["weight_decay"]) == (5e-4, (0.8, 0.9), 0.0)
    _, want = _torch_norms(4, lr=5e-4, betas=(0.8, 0.9), weight_decay=0.0, adamw=False)
    got = train(engine, 4)
    engine.close()
    assert max(abs(a - b) for a, b in zip(got, want)) < 2e-5  # trained by torch's Adam numbers


def test_gather_16bit_key_and_save_16bit_model(tmp_path):
    from engine_helpers import s3_config as engine_s3_config

    cfg = engine_s3_config("cpu", "cpu", tmp_path, bf16={"enabled": True})
    model = make_model()
    model.tok.weight.requires_grad_(False)  # a frozen parameter for exclude_frozen_parameters
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    assert engine.save_16bit_model(str(tmp_path / "none")) is False and not (tmp_path / "none").exists()
    engine.close()
    cfg["zero_optimization"]["stage3_gather_fp16_weights_on_model_save"] = True  # DeepSpeed's older name
    model = make_model()
    model.tok.weight.requires_grad_(False)
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    train(engine, 2)
    out = tmp_path / "export"
    assert engine.save_16bit_model(str(out)) is True
    assert engine.save_16bit_model(str(out), "trainable.bin", exclude_frozen_parameters=True) is True
    assert sorted(os.listdir(out)) == ["pytorch_model.bin", "trainable.bin"]  # no temporary file left
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    master = engine.fp32_master_state_dict()
    engine.close()
    saved = torch.load(out / "pytorch_model.bin", weights_only=True)
    fresh = make_model(seed=1).to(torch.bfloat16)
    fresh.load_state_dict(saved)  # strict: every key, right shapes
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, consolidated[name])
        if name in master:  # trained: the engine's fp32 weights cast to 16 bits
            assert torch.equal(p, master[name].to(torch.bfloat16)), name
    trainable = torch.load(out / "trainable.bin", weights_only=True)
    assert "tok.weight" not in trainable and set(trainable) == set(saved) - {"tok.weight"}


def test_16bit_export_below_stage3(tmp_path):
    engine, *_ = zero.initialize(model=make_model(), config=base_config("cpu", stage=2))
    train(engine, 1)
    with pytest.raises(ValueError, match="stage 3"):  # as DeepSpeed's
        engine._zero3_consolidated_16bit_state_dict()
    assert engine.save_16bit_model(str(tmp_path), "m.bin") is True  # no gather key needed below stage 3
    saved = torch.load(tmp_path / "m.bin", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())
    engine.close()


def test_load_checkpoint_returns_path_and_client_state(tmp_path):
    engine, *_ = zero.initialize(model=make_model(), config=base_config("cpu"))
    with pytest.warns(UserWarning, match="latest"):
        assert engine.load_checkpoint(str(tmp_path / "empty")) == (None, None)  # nothing there
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "a"), client_state={"epoch": 3})
    engine.save_checkpoint(str(tmp_path / "b"))
    path, client = engine.load_checkpoint(str(tmp_path / "a"))
    assert path == str(tmp_path / "a" / "global_step1") and client == {"epoch": 3}
    assert engine.load_checkpoint(str(tmp_path / "b"))[1] == {}  # a dict, as DeepSpeed's
    engine.close()


# ------------------------------------------------------------------------------- launcher conventions
def test_local_rank_from_args_and_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    parser = zero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--local-rank=1", "--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.local_rank, args.deepspeed, args.deepspeed_config) == (1, True, "ds.json")
    assert parser.parse_args(["--local_rank", "2"]).local_rank == 2
    assert parser.parse_args([]).local_rank == -1
    own = argparse.ArgumentParser()
    own.add_argument("--local_rank", type=int, default=-1)  # the script defines it already: kept
    assert zero.add_config_arguments(own).parse_args(["--local-rank", "3"]).local_rank == 3
    of = deepspeed_api.local_rank_of
    assert of(None) is None and of(argparse.Namespace(local_rank=-1)) is None
    assert of(argparse.Namespace(local_rank=1)) == 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert of(None) == 1 and of(argparse.Namespace(local_rank=1)) == 1
    with pytest.raises(ValueError, match="must agree"):
        of(argparse.Namespace(local_rank=0))
    with pytest.raises(ValueError, match="int"):
        of(argparse.Namespace(local_rank="1"))


def test_cuda_device_is_set_before_the_process_group_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(deepspeed_api, "accelerator_name", lambda: "cuda")
    monkeypatch.setattr(deepspeed_api, "dist_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert deepspeed_api.init_distributed(argparse.Namespace(local_rank=1)) == (3, 4, 1)
    assert calls == [("set_device", 1), ("init", "nccl")]
    calls.clear()
    # Lightning passes the device as args.device_rank
    assert deepspeed_api.init_distributed(argparse.Namespace(device_rank=0)) == (3, 4, 0)
    assert calls == [("set_device", 0), ("init", "nccl")]


def test_an_existing_process_group_is_adopted(tmp_path, monkeypatch):
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(base_config("cpu")))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:

        def refuse(*a, **k):
            raise AssertionError("the process group was started again")

        monkeypatch.setattr(dist, "init_process_group", refuse)
        monkeypatch.setenv("WORLD_SIZE", "1")
        args = argparse.Namespace(local_rank=0, deepspeed_config=str(cfg_path))
        engine, *_ = zero.initialize(args=args, model=make_model())  # the config from args
        assert engine.world_size == 1 and engine.optimizer.param_groups[0]["lr"] == 1e-3
        train(engine, 1)
        engine.close()
        with pytest.raises(ValueError, match="give one"):
            zero.initialize(args=args, model=make_model(), config=base_config("cpu"))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- two ranks
def _two_rank_contract(rank, world_size, nvme_dir, out_dir):
    cfg = s3_config("cpu")
    cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=2)  # a training config of 2 ranks
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg) as zi:
        mlp = MLP()
    res = {"ids": [p.ds_id for p in mlp.parameters()]}
    res["shares"] = {n: (p.ds_partition_range, p.ds_tensor.clone()) for n, p in mlp.named_parameters()}
    res["ds_numel"] = {n: (p.ds_numel, p.ds_tensor.ds_numel) for n, p in mlp.named_parameters()}
    w = mlp.hidden[1].weight
    with GatheredParameters([w], modifier_rank=1):
        if rank == 1:
            w.data.fill_(7.0)
    with GatheredParameters([w]):
        res["modified"] = bool((w == 7.0).all())
    zi.partitioner.close()

    zcfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    }
    engine, *_ = zero.initialize(model=make_model(), config=zcfg)
    norms = []
    for step in range(2):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    res["norms"] = norms
    sd = engine._zero3_consolidated_16bit_state_dict()
    res["sd_is_none"] = sd is None
    res["saved"] = engine.save_16bit_model(out_dir, "model.bin")
    res["sd"] = sd
    engine.close()
    return res


def test_two_ranks(tmp_path):
    (r0, r1), _ = run_on_ranks(_two_rank_contract, tmp_path)
    torch.manual_seed(0)
    plain = MLP()
    assert r0["ids"] == r1["ids"]  # the same ids on every rank
    for name, q in plain.named_parameters():
        (lo0, hi0), t0 = r0["shares"][name]
        (lo1, hi1), t1 = r1["shares"][name]
        assert (hi0 - lo0) + (hi1 - lo1) == q.numel()
        assert torch.equal(torch.cat([t0, t1]), q.detach().reshape(-1)), name  # the shares make it whole
        assert r0["ds_numel"][name][0] == q.numel() == r0["ds_numel"][name][1] + r1["ds_numel"][name][1]
    assert r0["modified"] and r1["modified"]
    want, _ = _torch_norms(2)  # one process on the global batch
    assert r0["norms"] == r1["norms"] and r0["norms"] == pytest.approx(want, rel=1e-4)
    assert r0["saved"] and r1["saved"] and r1["sd_is_none"] and not r0["sd_is_none"]
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    assert set(saved) == set(make_model().state_dict())
    assert all(torch.equal(saved[k], v) for k, v in r0["sd"].items())
