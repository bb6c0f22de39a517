"""Loss scaling: scale sequences for scripted overflow patterns, worked out by hand from DeepSpeed's rules."""

from __future__ import annotations

import math
from typing import List

import pytest
import torch

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
