"""Loss scaling: scale sequences for scripted overflow patterns, worked out by hand from DeepSpeed's rules;
and a static `fp16.loss_scale` driven through zero.initialize (the scale the engine reports, gradients
unscaled against a torch loop, and an underflow only the configured scale survives)."""

from __future__ import annotations

import copy
import math
from typing import List

import pytest
import torch

import zero
from offload.config import load_config
from zero.optimizer.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)

# Overflow pattern used below: 4 clean steps, 3 overflows, 4 clean, overflow, clean, overflow.
PATTERN = [False] * 4 + [True] * 3 + [False] * 4 + [True, False, True]


def scales(scaler: DynamicLossScaler, pattern: List[bool]) -> List[float]:
    """The scale after each update."""
    out = []
    for overflow in pattern:
        scaler.update_scale(overflow)
        out.append(scaler.loss_scale)
    return out


def test_hysteresis_sequence() -> None:
    # window 3, hysteresis 2, start 16:
    # it 3: three clean iterations since "iteration -1" -> 32 (tolerance refilled to 2)
    # it 4: overflow spends the tolerance (2 -> 1), scale stays 32
    # it 5, 6: tolerance exhausted -> 16, 8 (it stays exhausted until the next increase)
    # it 10: three clean iterations after the overflow at 6 -> 16, tolerance back to 2
    # it 11: overflow spends it (2 -> 1); it 12 clean does not refill it; it 13: overflow -> 8
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, hysteresis=2)
    assert scaler.loss_scale == 16
    assert scales(scaler, PATTERN) == [16, 16, 16, 32, 32, 16, 8, 8, 8, 8, 16, 16, 16, 8]


def test_consecutive_hysteresis_sequence() -> None:
    # Same pattern; every clean step refills the tolerance, so the isolated overflows at 11 and 13 each only
    # spend it and never halve the scale.
    scaler = DynamicLossScaler(
        init_scale=16, scale_window=3, min_scale=1, hysteresis=2, consecutive_hysteresis=True
    )
    assert scales(scaler, PATTERN) == [16, 16, 16, 32, 32, 16, 8, 8, 8, 8, 16, 16, 16, 16]


def test_hysteresis_one_halves_on_every_overflow() -> None:
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, hysteresis=1)
    # it 0 T: 32; it 1 T: 16; it 2 F (stable 0); it 3 F (stable 1); it 4 F (stable 2 -> x2): 32.
    assert scales(scaler, [True, True, False, False, False, True]) == [32, 16, 16, 16, 32, 16]


def test_scale_doubles_every_window_without_overflow() -> None:
    scaler = DynamicLossScaler(init_scale=1, scale_window=2, hysteresis=2)
    # stable = it: doubles at it 2, 4, 6.
    assert scales(scaler, [False] * 7) == [1, 1, 2, 2, 4, 4, 8]


def test_never_below_min_and_error_at_min() -> None:
    scaler = DynamicLossScaler(init_scale=16, min_scale=3, hysteresis=1)
    assert scales(scaler, [True, True, True]) == [8, 4, 3]
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        scaler.update_scale(True)

    tolerant = DynamicLossScaler(init_scale=4, min_scale=2, hysteresis=1, raise_error_at_min_scale=False)
    assert scales(tolerant, [True, True, True]) == [2, 2, 2]


def test_state_dict_resume_gives_the_same_sequence() -> None:
    ref = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=2)
    expected = scales(ref, PATTERN)

    first = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=2)
    head = scales(first, PATTERN[:9])
    state = first.state_dict()
    resumed = DynamicLossScaler(init_scale=2**16, scale_window=3, hysteresis=2)
    resumed.load_state_dict(state)
    assert head + scales(resumed, PATTERN[9:]) == expected
    with pytest.raises(ValueError, match="static"):
        resumed.load_state_dict(StaticLossScaler(8.0).state_dict())


def test_static_scaler() -> None:
    scaler = StaticLossScaler(128.0)
    scaler.update_scale(True)
    scaler.update_scale(False)
    assert scaler.loss_scale == 128.0 and not scaler.dynamic
    loss = torch.tensor(0.5)
    assert float(scaler.scale_loss(loss)) == 64.0
    other = StaticLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == 128.0
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)
    with pytest.raises(ValueError, match="dynamic"):
        other.load_state_dict(DynamicLossScaler().state_dict())


def test_constructor_checks() -> None:
    with pytest.raises(ValueError):
        DynamicLossScaler(init_scale=math.inf)
    with pytest.raises(ValueError):
        DynamicLossScaler(min_scale=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(scale_window=0)


def test_build_from_config() -> None:
    dyn = build_loss_scaler(
        load_config(
            {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 5, "hysteresis": 3}}
        ).fp16
    )
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic
    assert (dyn.loss_scale, dyn.scale_window, dyn.delayed_shift, dyn.min_scale) == (4096.0, 5, 3, 1.0)
    static = build_loss_scaler(load_config({"fp16": {"enabled": True, "loss_scale": 256}}).fp16)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0
    assert build_loss_scaler(load_config({"bf16": {"enabled": True}}).fp16) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_has_overflow_finds_inf_and_nan(dtype: torch.dtype, bad: float) -> None:
    clean = torch.ones(1000, dtype=dtype)
    dirty = torch.ones(1000, dtype=dtype)
    dirty[637] = bad
    assert not has_overflow([clean, None, clean])
    assert has_overflow([clean, None, dirty])


def test_has_overflow_large_finite_fp16_is_not_overflow() -> None:
    # 1000 * 65504 exceeds fp16's range but not the fp32 accumulator's.
    big = torch.full((1000,), 65504.0, dtype=torch.float16)
    assert not has_overflow([big])
    assert not has_overflow([torch.zeros(0), torch.arange(10)])  # empty and integer tensors are skipped


# ----------------------------------------------------------------------------- static scale in the engine
STATIC = 128.0
LR = 1e-3


def fp16_config(offload: str, tmp_path, eps: float = 1e-8, weight_decay: float = 0.1) -> dict:
    zo: dict = {"stage": 0, "sub_group_size": 1024}
    if offload != "none":
        zo["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            zo["offload_optimizer"].update(nvme_path=str(tmp_path), max_in_cpu=0)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.95], "eps": eps, "weight_decay": weight_decay},
        },
        "zero_optimization": zo,
        "fp16": {"enabled": True, "loss_scale": STATIC},
    }


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 16, generator=g).half(), torch.randn(4, 8, generator=g).half()


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y.float()).pow(2).mean()


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_static_loss_scale_through_the_engine_matches_a_torch_loop(tmp_path, offload) -> None:
    """fp16 with `loss_scale: 128`: the engine reports 128 at every step and never changes it; its
    gradients are those of `loss * 128` in fp16, divided by 128 in fp32 (the global norm it reports equals
    the torch loop's), and its fp32 master weights follow torch.optim.AdamW stepping that loop."""
    model = mlp()
    ref_model = copy.deepcopy(model).half()
    master = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    engine, *_ = zero.initialize(model=model, config=fp16_config(offload, tmp_path))
    assert engine.loss_scale == STATIC and next(engine.module.parameters()).dtype == torch.float16
    for step in range(6):
        x, y = batch(step)
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()

        ref_loss = mse(ref_model(x), y)
        (ref_loss * STATIC).backward()
        grads = [p.grad.float() / STATIC for p in ref_model.parameters()]
        ref_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
        for m, g in zip(master, grads):
            m.grad = g
        opt.step()
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), master):
                p.copy_(m)
                p.grad = None

        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3, abs=1e-5)
        assert engine.get_global_grad_norm() == pytest.approx(ref_norm, rel=1e-5)
        rep = engine.last_report
        assert (rep.loss_scale, rep.skipped, engine.loss_scale) == (STATIC, False, STATIC)
    got = engine.optimizer.state_dict()["master"][: engine.trainable_numel]
    want = torch.cat([m.detach().reshape(-1) for m in master])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # the CPU kernels' rounding against torch
    assert engine.skipped_steps == 0
    engine.close()


def test_static_loss_scale_rescues_gradients_that_underflow_fp16(tmp_path) -> None:
    """Gradients of 2**-26 per output are 0 in fp16; scaled by 128 they are 2**-19 (a subnormal, exact),
    so only the configured scale lets this step see them. With x = 1 every weight's gradient is exactly
    4 * 2**-26 = 2**-24 after unscaling, and AdamW's first step (eps 1e-20, no decay) moves every weight by
    exactly lr; a scale of 1 would leave the gradients zero and the weights where they were."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    init = model.weight.detach().reshape(-1).clone()
    engine, *_ = zero.initialize(
        model=model, config=fp16_config("cpu", tmp_path, eps=1e-20, weight_decay=0.0)
    )
    out = engine(torch.ones(4, 8, dtype=torch.float16))
    engine.backward(out.float().sum() * 2**-26)
    engine.step()
    assert engine.last_report.loss_scale == STATIC and not engine.last_report.skipped
    assert engine.get_global_grad_norm() == pytest.approx(math.sqrt(init.numel()) * 2**-24, rel=1e-6)
    moved = engine.optimizer.state_dict()["master"][: init.numel()] - init
    torch.testing.assert_close(moved, torch.full_like(init, -LR), rtol=1e-4, atol=0)
    engine.close()
