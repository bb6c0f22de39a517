"""The estimator's GPU and pinned bytes against what the engine holds on a real GPU.

tests/test_estimate_engine.py checks pinned host and swap-file bytes on the CPU, where the "GPU" tier is
host memory and the CUDA-only copy-back slots do not exist. Here the engine runs on CUDA: after two steps
(activations freed) `torch.cuda.memory_allocated` is what the engine keeps on the GPU, and its peak over the
steps adds the working set (stage 3: gathered layers and the gradient bucket) and transfer temporaries.
Skipped on machines without CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch

import zero
from offload.estimate import SwapBufferSettings, TrainingSetup, count_parameters, estimate

# tests/conftest.py: the GPU case of the `device` fixture only (engines compute there; skipped without CUDA).
pytestmark = pytest.mark.parametrize("device", ["cuda"], indirect=True)

WIDTH = 2048
SUB_GROUP = 4_000_000
# stage 2's gradient bucket: smaller than the model (16.8M) and than its largest parameter (8.4M), which
# passes through it in pieces
BUCKET = 2_000_000
# flat-buffer padding, a few scalars (loss scale, step counters), the input batch, allocator rounding
PADDING = 2 << 20


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH)
    )


def _config(tmp_path, stage: int, optim: str, param: str) -> dict:
    zo: dict = {
        "stage": stage,
        "sub_group_size": SUB_GROUP,
        "offload_optimizer": {
            "device": optim,
            "nvme_path": str(tmp_path),
            "buffer_count": 4,
            "max_in_cpu": 0,
        },
    }
    if stage == 2:
        zo["reduce_bucket_size"] = BUCKET
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
        zo["offload_param"] = {
            "device": param,
            "nvme_path": str(tmp_path),
            "max_in_cpu": 0,
            "buffer_count": 3,
            "buffer_size": 10_000_000,
        }
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zo,
    }


def _measure(tmp_path, device: torch.device, stage: int, optim: str, param: str):
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()  # cuBLAS's workspace exists before the baseline, not inside the engine's bytes
    del a
    gc.collect()  # an earlier test's engine freed during this one would show up as negative bytes
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    model = _model()
    count = count_parameters(model)
    engine = zero.initialize(model=model, config=_config(tmp_path, stage, optim, param))[0]
    try:
        x = torch.randn(2, WIDTH, dtype=torch.bfloat16, device=device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            engine.backward(engine(x).float().square().mean())
            engine.step()
        torch.cuda.synchronize()
        steady = torch.cuda.memory_allocated(device) - base
        peak = torch.cuda.max_memory_allocated(device) - base
        pinned = engine.pinned_bytes
        grads = engine.gradient_memory()
    finally:
        engine.close()
    buffers = SwapBufferSettings(
        optimizer_buffer_count=4,
        sub_group_size=SUB_GROUP,
        param_buffer_count=3,
        param_buffer_size=10_000_000,
        param_max_in_cpu=0,
        reduce_bucket_size=BUCKET,
    )
    setup = TrainingSetup(
        count.params, count.largest_layer_params, precision="bf16", optimizer="adamw", buffers=buffers
    )
    est = estimate(setup, stage, optim, param)
    return count, steady, peak, pinned, est, grads


@pytest.mark.parametrize("optim", ["none", "cpu", "nvme"])
def test_stage2_gpu_and_pinned_bytes(tmp_path, device, optim):
    count, steady, peak, pinned, est, grads = _measure(tmp_path, device, 2, optim, "none")
    # Stage 2 keeps the whole model's 16-bit weights, one gradient bucket and, without offload, the rank's
    # gradient partition (bf16) and the optimizer's partition on the GPU - no gradient buffer of the model.
    # Between steps the step's fp32 copy of the gradient partition (estimated, without offload) is freed.
    assert grads.full_buffer_bytes == 0 and grads.bucket_bytes == BUCKET * 2 and grads.buckets_reduced > 0
    assert 0 <= grads.device_bytes - est.gpu["grads_16bit"] <= PADDING, (grads, est.gpu)
    assert abs(steady - (est.per_gpu_bytes - est.gpu["grads_fp32"])) <= PADDING, (steady, est.gpu)
    if optim != "none":  # on the GPU: 2 bytes/param of weights plus the bucket
        assert steady <= count.params * 2 + BUCKET * 2 + PADDING, (steady, est.gpu)
    # Transient the estimate leaves out: during backward autograd's new gradient of one parameter before it
    # is copied into the bucket (the buckets reach the host in bf16: no fp32 conversion on the GPU).
    autograd = count.largest_layer_params * 2
    assert peak <= est.per_gpu_bytes + autograd + PADDING, (peak, est.gpu)
    if optim != "none":  # copy-back slots and the bucket's pinned staging exist on CUDA: all estimated
        assert 0 <= pinned - est.per_cpu_pinned_bytes <= 64 * 1024, (pinned, est.cpu_pinned)


@pytest.mark.parametrize("param, optim", [(p, o) for p in ("none", "cpu", "nvme") for o in ("cpu", "nvme")])
def test_stage3_gpu_bytes(tmp_path, device, param, optim):
    count, steady, peak, pinned, est, _ = _measure(tmp_path, device, 3, optim, param)
    # The estimate is the step's peak: resident partitions plus the working set. Between steps the
    # working set may be released, so what stays lies between the resident part and the peak.
    assert peak <= est.per_gpu_bytes + PADDING, (peak, est.gpu)
    assert peak >= 0.75 * est.per_gpu_bytes, (peak, est.gpu)
    assert steady <= peak
