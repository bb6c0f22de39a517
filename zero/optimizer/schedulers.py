"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest).

Formulas and defaults follow deepspeed/runtime/lr_schedules.py so a DeepSpeed config trains with the same
lr sequence. The objects are ``torch.optim.lr_scheduler.LRScheduler`` instances (``step``,
``get_last_lr``, ``state_dict``/``load_state_dict``), with DeepSpeed's counting:

* ``last_batch_iteration`` starts at -1; constructing a scheduler sets the optimizer's lr to the value for
  iteration -1 (e.g. ``warmup_min_lr``), and each ``step()`` (called after ``optimizer.step()``) advances
  it by one and applies the next value. torch's ``last_epoch`` is ``last_batch_iteration + 1``.
* ``state_dict()`` is ``{"last_batch_iteration": n}``, the same as DeepSpeed's, so a DeepSpeed
  checkpoint's scheduler state loads here and the other way round.

One deliberate difference: DeepSpeed's OneCycle overwrites Adam's beta2 with 0.99 whenever it cycles
momentum; here beta2 keeps the optimizer's value and only beta1 is cycled (see docs/configuration.md).
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Mapping, Optional, Sequence, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from offload.config.optimizer import SchedulerConfig, parse_scheduler

logger = logging.getLogger(__name__)

LrSpec = Union[float, Sequence[float]]

WARMUP_TYPES = ("log", "linear")


class _IterationScheduler(LRScheduler):
    """Plumbing shared by the schedules: the iteration counter, applying lrs, and the state dict.

    torch's LRScheduler.__init__ is deliberately not called: it takes a first step at construction (which
    would shift DeepSpeed's counting by one) and wraps ``optimizer.step``; subclasses only need the public
    LRScheduler surface.
    """

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise TypeError(f"last_batch_iteration must be an int, got {last_batch_iteration!r}")
        if last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration must be >= -1, got {last_batch_iteration}")
        self.optimizer = optimizer
        self.base_lrs = [_as_float(group["lr"]) for group in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._step_count = 0
        self._last_lr: List[float] = list(self.base_lrs)

    def _start(self) -> None:
        """Called at the end of a subclass's __init__: a fresh schedule sets the iteration -1 lr now."""
        if self.last_batch_iteration == -1:
            self._apply()

    # torch's name for the counter; kept in step with DeepSpeed's.
    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        return self.last_batch_iteration + 1

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.last_batch_iteration = value - 1

    def lr_at(self, iteration: int) -> List[float]:
        """The lr per param group after ``iteration`` batches (-1: before the first)."""
        raise NotImplementedError

    def get_lr(self) -> List[float]:
        return self.lr_at(self.last_batch_iteration)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:  # type: ignore[override]
        """Advance one batch (or jump to ``last_batch_iteration``) and apply that iteration's lr."""
        self._step_count += 1
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)

    def get_last_lr(self) -> List[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the counter and re-apply its lr, so optimizer and schedule agree after a resume."""
        if "last_batch_iteration" not in state_dict:
            raise KeyError(f"scheduler state has no 'last_batch_iteration' (keys: {sorted(state_dict)})")
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()

    def _per_group(self, value: LrSpec, name: str) -> List[float]:
        n = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name}: expected {n} values (one per param group), got {len(value)}")
            return [float(v) for v in value]
        return [float(value)] * n


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        # DeepSpeed warns and falls back to "log"; a typo here silently changes the schedule, so refuse.
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
    # DeepSpeed clamps to 2 so that 1 / log(warmup_num_steps) is defined.
    return max(2, warmup_num_steps)


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far through warmup ``iteration`` is: log(it+1)/log(N) or it/N (iteration < N)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class WarmupLR(_IterationScheduler):
    """lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then stays there.

    lr(it) = min + (max - min) * g(it), g = log(it + 1) / log(N) ("log") or it / N ("linear") for it < N,
    1 afterwards; N = max(2, warmup_num_steps). ``warmup_max_lr`` None means the optimizer's lr.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: LrSpec = 0.0,
        warmup_max_lr: Optional[LrSpec] = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:
            warmup_max_lr = self.base_lrs[0]
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self._start()

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, iteration: int) -> List[float]:
        """The lr per param group after ``iteration`` batches."""
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``.

    After warmup: g(it) = max(0, (total - it) / max(1, total - N)).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: LrSpec = 0.0,
        warmup_max_lr: LrSpec = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps
            )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(
            0.0,
            float(self.total_num_steps - iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_IterationScheduler):
    """lr = the optimizer's lr times a ratio that warms up from ``warmup_min_ratio`` to 1, then follows a
    half cosine down to ``cos_min_ratio`` at ``total_num_steps`` and stays there.

    Warmup (it < N): ratio = wmin + (1 - wmin) * g(it). After: p = min(1, (it - N + 1) / max(1, total - N)),
    ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2). Before the first step (it = -1) lr is 0.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps
            )
        self._start()

    def lr_ratio(self, iteration: int) -> float:
        """The fraction of the base lr after ``iteration`` batches."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> List[float]:
        """The lr per param group after ``iteration`` batches."""
        ratio = self.lr_ratio(iteration)
        return [lr * ratio for lr in self.base_lrs]


class OneCycle(_IterationScheduler):
    """1Cycle: lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` steps,
    falls back over ``cycle_second_step_size``, then decays as min / (1 + decay_lr_rate * d / decay_step_size)
    (d = steps since the cycle ended). Momentum (Adam's beta1) moves inversely between ``cycle_max_mom`` and
    ``cycle_min_mom``, then grows as max * (1 + decay_mom_rate * d / decay_step_size). Stair counts > 0 hold
    the values flat in that many stairs per half cycle.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: LrSpec,
        cycle_max_lr: LrSpec,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: Optional[int] = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: Optional[int] = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if cycle_first_step_size <= 0 or (cycle_second_step_size is not None and cycle_second_step_size <= 0):
            raise ValueError("cycle_first_step_size and cycle_second_step_size must be positive")
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            float(cycle_second_step_size) if cycle_second_step_size is not None else self.first_step_size
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = self._per_group(cycle_min_lr, "cycle_min_lr")
        self.max_lrs = self._per_group(cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)

        self.cycle_momentum = cycle_momentum
        self.min_mom = float(cycle_min_mom)
        self.max_mom = float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        if cycle_momentum and "betas" not in optimizer.defaults:
            logger.warning(
                "OneCycle: cycle_momentum disabled because %s has no 'betas'", type(optimizer).__name__
            )
            self.cycle_momentum = False

        if last_batch_iteration == -1:
            # DeepSpeed starts the cycle at the minimum lr and (as it does) at cycle_min_mom.
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            self._last_lr = list(self.min_lrs)
            if self.cycle_momentum:
                self._set_beta1([self.min_mom] * len(optimizer.param_groups))

    def _scale_factor(self, iteration: int) -> float:
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer position in the cycle, not from ``scale``: at a half-cycle boundary
            # the float scale can land a hair under a stair and floor() would drop a whole stair.
            in_cycle = batch % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lr_at(self, iteration: int) -> List[float]:
        """The lr per param group after ``iteration`` batches."""
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay_interval = (iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * decay_interval) for lo in self.min_lrs]

    def mom_at(self, iteration: int) -> float:
        """beta1 after ``iteration`` batches."""
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor(iteration)
        if self.skip_mom_decay:
            return self.max_mom
        decay_interval = (iteration - self.total_size + 1) / self.decay_step_size
        return self.max_mom * (1 + self.decay_mom_rate * decay_interval)

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._set_beta1([self.mom_at(self.last_batch_iteration)] * len(self.optimizer.param_groups))

    def _set_beta1(self, values: List[float]) -> None:
        for group, beta1 in zip(self.optimizer.param_groups, values):
            beta2 = group["betas"][1]
            group["betas"] = (beta1, beta2)


class LRRangeTest(_IterationScheduler):
    """lr = min_lr * (1 + step_rate * interval), interval = (it + 1) / step_size (floored if staircase)."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: LrSpec = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be positive, got {lr_range_test_step_size}")
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = lr_range_test_staircase
        self._start()

    def lr_at(self, iteration: int) -> List[float]:
        """The lr per param group after ``iteration`` batches."""
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lrs]


SCHEDULERS = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(
    scheduler_config: Union[SchedulerConfig, Mapping[str, Any], None], optimizer: Optimizer
) -> Optional[_IterationScheduler]:
    """The schedule a config's ``scheduler`` section describes, attached to ``optimizer`` (None: none).

    ``scheduler_config`` is a ``SchedulerConfig`` (``cfg.scheduler``) or a raw ``{"type", "params"}`` dict,
    which is validated first with the same rules as ``load_config``.
    """
    from offload.config._reader import Context

    if scheduler_config is None:
        return None
    if isinstance(scheduler_config, Mapping):
        scheduler_config = parse_scheduler(scheduler_config, Context("<dict>"))
    if not isinstance(scheduler_config, SchedulerConfig):
        raise TypeError(f"expected a SchedulerConfig or dict, got {type(scheduler_config).__name__}")
    cls = SCHEDULERS[scheduler_config.type]
    return cls(optimizer, **scheduler_config.params)
