"""LR schedules: the lr sequence against values worked out by hand from DeepSpeed's formulas."""

from __future__ import annotations

import math
from typing import List

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from offload.config import ConfigError, load_config
from zero.optimizer.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def make_optimizer(lr: float = 1.0, groups: int = 1, cls=torch.optim.Adam) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return cls(params, lr=lr)


def lr_sequence(sched, steps: int, group: int = 0) -> List[float]:
    """The lr in force before the first step, then after each of ``steps`` scheduler steps."""
    out = [sched.optimizer.param_groups[group]["lr"]]
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        out.append(sched.optimizer.param_groups[group]["lr"])
    return out


# --- WarmupLR --------------------------------------------------------------------------------------------


def test_warmup_lr_linear() -> None:
    # N = 4, lr(it) = it / 4 for it < 4; construction applies it = -1 (the minimum).
    sched = WarmupLR(
        make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"
    )
    assert lr_sequence(sched, 6) == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0], abs=1e-15)


def test_warmup_lr_log() -> None:
    # lr(it) = 0.1 + 0.9 * log(it + 1) / log(4): it 0 -> 0.1, 1 -> 0.1 + 0.45, 2 -> 0.1 + 0.9 * log 3 / log 4.
    sched = WarmupLR(make_optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=4)
    expected = [0.1, 0.1, 0.55, 0.1 + 0.9 * math.log(3) / math.log(4), 1.0, 1.0]
    assert lr_sequence(sched, 5) == pytest.approx(expected, rel=1e-14)


def test_warmup_lr_max_defaults_to_optimizer_lr_and_one_step_acts_as_two() -> None:
    # warmup_num_steps 1 is clamped to 2, so lr(1) = 1/2 of the way, not already the maximum.
    sched = WarmupLR(make_optimizer(lr=0.4), warmup_num_steps=1, warmup_type="linear")
    assert lr_sequence(sched, 3) == pytest.approx([0.0, 0.0, 0.2, 0.4], abs=1e-15)


def test_warmup_lr_per_group_values() -> None:
    opt = make_optimizer(groups=2)
    sched = WarmupLR(
        opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2, warmup_type="linear"
    )
    assert lr_sequence(sched, 3, group=0) == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.2])
    assert sched.get_last_lr() == pytest.approx([1.0, 0.2])
    with pytest.raises(ValueError, match="expected 2 values"):
        WarmupLR(make_optimizer(groups=2), warmup_min_lr=[0.0, 0.1, 0.2])


def test_warmup_arguments_checked() -> None:
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(make_optimizer(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(make_optimizer(), warmup_type="cosine")
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        WarmupLR(object())  # type: ignore[arg-type]


# --- WarmupDecayLR ---------------------------------------------------------------------------------------


def test_warmup_decay_lr_linear() -> None:
    # N = 2, T = 6: warmup 0, 0.5; then (6 - it) / 4 for it = 2..6; clamped at 0 afterwards.
    sched = WarmupDecayLR(
        make_optimizer(),
        total_num_steps=6,
        warmup_min_lr=0.0,
        warmup_max_lr=1.0,
        warmup_num_steps=2,
        warmup_type="linear",
    )
    assert lr_sequence(sched, 8) == pytest.approx([0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0], abs=1e-15)


def test_warmup_decay_lr_decays_towards_min() -> None:
    # min 0.2, max 1.0: after warmup lr = 0.2 + 0.8 * (6 - it) / 4.
    sched = WarmupDecayLR(
        make_optimizer(),
        total_num_steps=6,
        warmup_min_lr=0.2,
        warmup_max_lr=1.0,
        warmup_num_steps=2,
        warmup_type="linear",
    )
    assert lr_sequence(sched, 7)[3:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2], abs=1e-15)


# --- WarmupCosineLR --------------------------------------------------------------------------------------


def test_warmup_cosine_lr() -> None:
    # lr 2.0, N = 2 (linear), w = 0.1, c = 0.0, T = 6.
    # it -1: 0; it 0: 0.1; it 1: 0.1 + 0.5 * 0.9 = 0.55; then p = (it - 1) / 4, ratio = (1 + cos(pi p)) / 2.
    sched = WarmupCosineLR(
        make_optimizer(lr=2.0),
        total_num_steps=6,
        warmup_min_ratio=0.1,
        warmup_num_steps=2,
        cos_min_ratio=0.0,
        warmup_type="linear",
    )
    half_sqrt2 = math.sqrt(2) / 2
    ratios = [0.0, 0.1, 0.55, (1 + half_sqrt2) / 2, 0.5, (1 - half_sqrt2) / 2, 0.0, 0.0, 0.0]
    assert lr_sequence(sched, 8) == pytest.approx([2.0 * r for r in ratios], abs=1e-15)


def test_warmup_cosine_lr_floor() -> None:
    # With cos_min_ratio 0.1 the ratio ends at 0.1 and stays there past total_num_steps.
    sched = WarmupCosineLR(make_optimizer(lr=1.0), total_num_steps=4, warmup_num_steps=2, cos_min_ratio=0.1)
    seq = lr_sequence(sched, 8)
    assert seq[2] == pytest.approx(math.log(2) / math.log(2))  # log warmup reaches 1.0 at it = 1
    assert seq[3] == pytest.approx(0.1 + 0.9 * 0.5)  # p = 1/2
    assert seq[4:] == pytest.approx([0.1] * 5)


# --- OneCycle --------------------------------------------------------------------------------------------


def test_one_cycle_lr_and_momentum() -> None:
    # min 0.01, max 0.1, both halves 2 steps: scale over it = 0..3 is 0.5, 1, 0.5, 0; then the cycle ends.
    opt = make_optimizer()
    opt.param_groups[0]["betas"] = (0.9, 0.95)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)  # starts at cycle_min_mom; beta2 untouched
    lrs, moms = [], []
    for _ in range(6):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"])
    assert lrs == pytest.approx([0.055, 0.1, 0.055, 0.01, 0.01, 0.01], abs=1e-15)
    assert [b[0] for b in moms] == pytest.approx([0.85, 0.8, 0.85, 0.9, 0.9, 0.9], abs=1e-15)
    assert all(b[1] == 0.95 for b in moms)


def test_one_cycle_post_cycle_decay() -> None:
    # Total cycle 4 steps; afterwards d = it - 3:
    # lr = 0.01 / (1 + 1.0 * d / 2), beta1 = 0.9 * (1 + 0.1 * d / 2).
    opt = make_optimizer()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=2,
        decay_lr_rate=1.0,
        decay_step_size=2,
        decay_mom_rate=0.1,
    )
    seq = lr_sequence(sched, 7)
    assert seq[5:] == pytest.approx([0.01 / 1.5, 0.01 / 2.0, 0.01 / 2.5], rel=1e-14)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 * (1 + 0.1 * 3 / 2))


def test_one_cycle_asymmetric_with_stairs() -> None:
    # First half 4 steps in 2 stairs, second half 2 steps (stairs default to the first count):
    # it 0..5 sits at scale 0, 0.5, 0.5, 1, 0.5, 0 -> lr = 0 + 1.0 * scale.
    sched = OneCycle(
        make_optimizer(),
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_second_step_size=2,
        cycle_first_stair_count=2,
        cycle_momentum=False,
    )
    assert lr_sequence(sched, 6)[1:] == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.0], abs=1e-15)


def test_one_cycle_without_betas_disables_momentum() -> None:
    opt = make_optimizer(cls=torch.optim.SGD)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert sched.cycle_momentum is False
    assert lr_sequence(sched, 2) == pytest.approx([0.01, 0.055, 0.1])
    assert "betas" not in opt.param_groups[0]


# --- LRRangeTest -----------------------------------------------------------------------------------------


def test_lr_range_test() -> None:
    cont = LRRangeTest(make_optimizer(), lr_range_test_min_lr=0.1, lr_range_test_step_size=2)
    assert lr_sequence(cont, 3) == pytest.approx([0.1, 0.15, 0.2, 0.25])
    stairs = LRRangeTest(
        make_optimizer(), lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_staircase=True
    )
    assert lr_sequence(stairs, 4) == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.3])


# --- torch compatibility and state ------------------------------------------------------------------------


def test_is_a_torch_lr_scheduler_with_deepspeed_counting() -> None:
    sched = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    assert isinstance(sched, LRScheduler)
    assert sched.last_batch_iteration == -1 and sched.last_epoch == 0
    sched.step()
    sched.step()
    assert sched.last_batch_iteration == 1 and sched.last_epoch == 2
    assert sched.get_last_lr() == [0.25] and sched.get_lr() == [0.25]
    sched.step(3)  # jump, as DeepSpeed's step(last_batch_iteration) does
    assert sched.get_last_lr() == [0.75]


def test_state_dict_resume_continues_the_sequence() -> None:
    def build(opt):
        return WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=5)

    ref = build(make_optimizer())
    full = lr_sequence(ref, 12)

    first = build(make_optimizer())
    lr_sequence(first, 7)
    state = first.state_dict()
    assert state == {"last_batch_iteration": 6}  # DeepSpeed's format

    opt = make_optimizer()
    resumed = build(opt)
    resumed.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == full[7]
    assert lr_sequence(resumed, 5) == full[7:]
    with pytest.raises(KeyError, match="last_batch_iteration"):
        resumed.load_state_dict({})


def test_tensor_lr_is_updated_in_place() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(1.0))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == 0.5


# --- build_scheduler from the config -----------------------------------------------------------------------


def test_build_scheduler_from_loaded_config() -> None:
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}},
        }
    )
    opt = make_optimizer(lr=cfg.optimizer.params["lr"])
    sched = build_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupLR)
    assert lr_sequence(sched, 3) == pytest.approx([0.0, 0.0, 0.25, 0.5])  # warmup_max_lr = optimizer lr


@pytest.mark.parametrize(
    "config, cls",
    [
        ({"type": "WarmupLR"}, WarmupLR),
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}, WarmupDecayLR),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}, WarmupCosineLR),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1}}, OneCycle),
        ({"type": "LRRangeTest"}, LRRangeTest),
    ],
)
def test_build_scheduler_every_type(config, cls) -> None:
    sched = build_scheduler(config, make_optimizer())
    assert type(sched) is cls
    sched.step()


def test_build_scheduler_validates_dicts() -> None:
    assert build_scheduler(None, make_optimizer()) is None
    with pytest.raises(ConfigError, match="unknown key 'scheduler.params.warmup_max'"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_max": 1.0}}, make_optimizer())
    with pytest.raises(TypeError):
        build_scheduler(42, make_optimizer())
