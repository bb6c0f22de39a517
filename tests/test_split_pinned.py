"""Twin-Flow pins only the host share: with `offload_optimizer.ratio` below 1.0 the device share's gradient
partition and master weights are in device memory (pageable host memory on a CPU-only machine), so the
pinned bytes shrink with the ratio, and the estimator (`apply_split`) says the same.

Measured on the engine's public report (`engine.pinned_bytes`) after one step, at stages 2 and 3, fp32 (the
master is the flat parameter buffer there) and bf16.
"""

from __future__ import annotations

import pytest
import torch
from estimate_helpers import PADDING_ALLOWANCE

import zero
from offload.estimate import SwapBufferSettings, TrainingSetup, count_parameters, estimate
from offload.estimate.split import apply_split

SUB_GROUP = 20_000  # 14 sub-groups: ratio 0.5 offloads 7 of them
RATIOS = (1.0, 0.5, 0.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))


def _config(stage: int, precision: str, ratio: float) -> dict:
    zo = {
        "stage": stage,
        "sub_group_size": SUB_GROUP,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": ratio},
    }
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zo,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine_pinned(stage: int, precision: str, ratio: float) -> int:
    engine, *_ = zero.initialize(model=_model(), config=_config(stage, precision, ratio))
    try:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        engine.backward(engine(torch.randn(2, 256, dtype=dtype)).float().square().mean())
        engine.step()
        assert engine.optimizer_state_info().device_numel > 0 or ratio == 1.0
        return engine.pinned_bytes
    finally:
        engine.close()


def _estimated_pinned(stage: int, precision: str, ratio: float) -> int:
    count = count_parameters(_model())
    setup = TrainingSetup(
        count.params,
        count.largest_layer_params,
        precision=precision,
        optimizer="adamw",
        buffers=SwapBufferSettings(sub_group_size=SUB_GROUP),
    )
    est = apply_split(estimate(setup, stage, "cpu"), setup, ratio=ratio, cpu_only=True)
    # With the optimizer on the CPU the staging buffers are the GPU's: the updated 16-bit weights' copy-back
    # slots and (stage 2) the gradient buckets' pinned twins. A CPU-only engine allocates neither.
    return est.per_cpu_pinned_bytes - est.cpu_pinned.get("swap_buffers", 0)


@pytest.mark.parametrize("stage, precision", [(2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_pinned_bytes_follow_the_ratio_and_the_estimate(stage, precision):
    pinned = {r: _engine_pinned(stage, precision, r) for r in RATIOS}
    assert pinned[0.5] <= 0.6 * pinned[1.0], pinned
    assert pinned[0.0] <= pinned[0.5], pinned
    for r in RATIOS:
        est = _estimated_pinned(stage, precision, r)
        assert 0 <= pinned[r] - est <= PADDING_ALLOWANCE, (r, pinned[r], est)


def test_with_a_gpu_the_gradient_partition_stays_pinned():
    """The device share's gradients cross the bus on a GPU: the estimate keeps them in pinned memory."""
    count = count_parameters(_model())
    setup = TrainingSetup(
        count.params,
        count.largest_layer_params,
        optimizer="adamw",
        buffers=SwapBufferSettings(sub_group_size=SUB_GROUP),
    )
    full = estimate(setup, 2, "cpu")
    gpu = apply_split(full, setup, ratio=0.5)
    cpu = apply_split(full, setup, ratio=0.5, cpu_only=True)
    grads = sum(full.cpu_pinned.get(k, 0) for k in ("grads_fp32", "grads_16bit"))
    assert grads > 0
    assert sum(gpu.cpu_pinned.get(k, 0) for k in ("grads_fp32", "grads_16bit")) == grads
    assert sum(cpu.cpu_pinned.get(k, 0) for k in ("grads_fp32", "grads_16bit")) < grads
