"""The engines on a CUDA device: numerics against torch AdamW on the same GPU, every tier, checkpoints.

The default suite runs the engines on the CPU (tests/conftest.py); these tests ask for the GPU themselves and
exercise what only exists there: gradients copied from device to pinned host memory, updated weights copied
back on a side stream, stage-3 partitions gathered from host memory or NVMe through pinned staging slots into
device memory, and the stage-2 device-resident optimizer. Skipped on machines without CUDA.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from engine_helpers import DATA, STEPS, TINY, base_config, make_model, s3_config

import zero
from zero.examples.models import get_batch

# tests/conftest.py: the GPU case of the `device` fixture only (engines compute there, TF32 off; skipped
# without CUDA).
pytestmark = pytest.mark.parametrize("device", ["cuda"], indirect=True)

TIERS = ["none", "cpu", "nvme"]
# The GPU's fp32 matmuls and AdamW round differently from the CPU kernel: a few ulps per step, far below
# what one wrong, skipped or mis-scaled step moves (~1e-3; tests/test_engine.py shows that margin).
LOSS_ATOL = 2e-5
PARAM_ATOL = 2e-5


def batch(step: int, device: torch.device, size: int = 4):
    x, y = get_batch(DATA, size, TINY.seq_len, step)
    return x.to(device), y.to(device)


@functools.cache
def _torch_adamw(device: torch.device):
    """torch AdamW on `device`: per-step losses and the final weights (on the CPU). Run once per device."""
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.named_parameters()}


@pytest.fixture
def cuda_reference(device):
    """The reference on the test's device, computed with its settings (TF32 off)."""
    return _torch_adamw(device)


def train(engine, steps: int, start: int = 0):
    losses = []
    for step in range(start, start + steps):
        loss = engine(*batch(step, engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_matches(losses, params, reference):
    ref_losses, ref_params = reference
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_ATOL, f"loss trajectories differ by {worst:.3g}"
    for name, want in ref_params.items():
        diff = (params[name].float().cpu() - want.float()).abs().max().item()
        assert diff <= PARAM_ATOL, f"{name}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("offload", TIERS)
@pytest.mark.parametrize("stage", [0, 2])
def test_stage_0_2_on_cuda_matches_torch(tmp_path, cuda_reference, stage, offload, device):
    engine, *_ = zero.initialize(model=make_model(), config=base_config(offload, tmp_path, stage=stage))
    assert engine.device.type == device.type
    assert all(p.is_cuda for p in engine.module.parameters())
    losses = train(engine, STEPS)
    assert_matches(losses, dict(engine.module.named_parameters()), cuda_reference)
    rep = engine.last_report
    if offload != "none":  # every gradient went down to the host and the new weights came back up
        numel = sum(p.numel() for p in engine.module.parameters())  # the partition's padding need not move
        assert rep.device_to_host_bytes >= numel * 4
        assert rep.host_to_device_bytes >= numel * 4
    if offload == "nvme":
        assert rep.nvme_read_bytes > 0 and rep.nvme_write_bytes == rep.nvme_read_bytes
    engine.close()


@pytest.mark.parametrize("optim", ["cpu", "nvme"])
@pytest.mark.parametrize("param", TIERS)
def test_stage3_on_cuda_matches_torch(tmp_path, cuda_reference, param, optim, device):
    engine, *_ = zero.initialize(model=make_model(), config=s3_config(param, optim, tmp_path))
    assert engine.device.type == device.type
    losses = train(engine, STEPS)
    assert_matches(losses, zero.consolidated_state_dict(engine), cuda_reference)
    if param == "nvme":
        io = engine.last_param_io
        assert io["param_nvme_read_bytes"] > 0
        assert io["param_nvme_write_bytes"] == sum(u.part_nbytes for u in engine.layout.units)
    dirs = [d for d in (engine.swap_dir, engine.partitioner.store.swap_dir) if d]
    engine.close()
    assert not any(os.path.exists(d) for d in dirs)


def test_stage3_gathers_into_device_memory(tmp_path, device):
    """Between modules nothing is whole; inside forward the gathered weights are CUDA tensors."""
    engine, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "cpu", tmp_path))
    seen = []
    qkv = engine.module.blocks[0].qkv
    hook = qkv.register_forward_pre_hook(
        lambda m, args: seen.append([(p.device.type, p.numel()) for p in m.parameters()])
    )
    engine(*batch(0, engine.device))
    hook.remove()
    assert seen == [[(device.type, qkv.weight.ds_numel), (device.type, qkv.bias.ds_numel)]]
    assert all(p.numel() == 0 for p in engine.module.parameters())
    engine.close()


@pytest.mark.parametrize("offload,stage", [("cpu", 2), ("nvme", 2), ("nvme", 3)])
def test_checkpoint_on_cuda_resumes_bit_identically(tmp_path, offload, stage, device):
    def build(seed: int):
        torch.manual_seed(seed)
        cfg = (
            base_config(offload, tmp_path, stage=stage) if stage < 3 else s3_config("nvme", offload, tmp_path)
        )
        return zero.initialize(model=make_model(seed), config=cfg)[0]

    full = build(0)
    want = train(full, 6)
    full.close()
    first = build(0)
    assert train(first, 3) == want[:3]
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    resumed = build(7)  # other initial weights: everything must come from the checkpoint
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert train(resumed, 3, start=3) == want[3:]  # exact float equality
    resumed.close()


def test_bf16_stage3_on_cuda_trains_with_fp32_master(tmp_path, device):
    cfg = s3_config("nvme", "nvme", tmp_path, bf16={"enabled": True})
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    losses = train(engine, STEPS)
    assert engine.dtype == torch.bfloat16
    master = engine.fp32_master_state_dict()
    assert all(v.dtype == torch.float32 for v in master.values())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1  # it learns
    engine.close()
