"""fp16 loss scaling with DeepSpeed's semantics (deepspeed/runtime/fp16/loss_scaler.py).

Dynamic scaling starts at ``2**initial_scale_power``. An overflowing step is skipped; the scale halves
only once ``hysteresis`` overflows have used up the tolerance (each overflow before that just spends one),
and never goes below ``min_loss_scale``. After ``loss_scale_window`` overflow-free iterations since the last
overflow the scale doubles and the tolerance refills; with ``consecutive_hysteresis`` every clean step
refills it, so only *consecutive* overflows count. ``fp16.loss_scale > 0`` selects a static scale.

The engine calls ``update_scale(overflow)`` once per optimizer step, after deciding (across ranks) whether
any gradient overflowed; ``has_overflow`` is the local check.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Iterable, Mapping, Optional

import torch

from offload.config.precision import FP16Config

logger = logging.getLogger(__name__)


class LossScaleAtMinimumError(RuntimeError):
    """Overflow while the dynamic scale is already at ``min_loss_scale``: training cannot recover by
    lowering it further (DeepSpeed stops the run here too)."""


def has_overflow(tensors: Iterable[Optional[torch.Tensor]]) -> bool:
    """True when any tensor holds an inf or NaN (None entries, e.g. absent grads, are skipped).

    Uses one reduction per tensor rather than an elementwise isfinite mask: a sum is non-finite whenever
    any element is, and reducing allocates nothing the size of the tensor. 16-bit tensors are summed in
    fp32 so that finite fp16 values cannot overflow the accumulator.
    """
    for t in tensors:
        if t is None:
            continue
        if not t.is_floating_point():
            continue
        if t.numel() == 0:
            continue
        acc_dtype = torch.float32 if t.element_size() < 4 else t.dtype
        total = float(t.sum(dtype=acc_dtype))
        if not math.isfinite(total):
            return True
    return False


class LossScalerBase:
    """Interface the engine uses: ``loss_scale``, ``scale_loss``, ``update_scale``, state dicts."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The current scale the loss is multiplied by."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current scale (what backward runs on)."""
        return loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """After a step: adjust the scale to whether its gradients overflowed."""
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state for a checkpoint."""
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved `state_dict` back."""
        raise NotImplementedError


class StaticLossScaler(LossScalerBase):
    """A fixed scale (``fp16.loss_scale > 0``, or 1.0 for fp32/bf16 where no scaling is needed)."""

    def __init__(self, scale: float = 1.0) -> None:
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"static loss scale must be a finite number > 0, got {scale}")
        super().__init__(scale)

    def update_scale(self, overflow: bool) -> None:
        """A static scale never changes; an overflowing step is still skipped by the caller."""

    def state_dict(self) -> Dict[str, Any]:
        """The fixed scale, for a checkpoint."""
        return {"dynamic": False, "cur_scale": self.cur_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved static scale back (a dynamic one is refused)."""
        if state.get("dynamic", False):
            raise ValueError("cannot load a dynamic loss scaler's state into a static one")
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scaler; argument names are the ``fp16`` config keys they come from."""

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        scale_factor: float = 2.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        if not math.isfinite(init_scale) or init_scale <= 0:
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale}")
        if not math.isfinite(min_scale) or min_scale <= 0:
            raise ValueError(f"min_scale must be a finite number > 0, got {min_scale}")
        if scale_window < 1 or hysteresis < 1:
            raise ValueError(f"scale_window and hysteresis must be >= 1, got {scale_window} and {hysteresis}")
        if scale_factor <= 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        super().__init__(init_scale)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    @classmethod
    def from_config(cls, fp16: FP16Config, **kwargs: Any) -> DynamicLossScaler:
        """From an ``FP16Config`` (``cfg.fp16``)."""
        return cls(
            init_scale=float(2**fp16.initial_scale_power),
            scale_window=fp16.loss_scale_window,
            min_scale=fp16.min_loss_scale,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            **kwargs,
        )

    def update_scale(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale for the next one."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"gradient overflow with the loss scale already at min_loss_scale ({self.min_scale});"
                        " lower fp16.min_loss_scale, or check the model for inf/NaN independent of scaling"
                    )
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.info("fp16 overflow: skipping step, loss scale %g -> %g", self.cur_scale, next_scale)
                self.cur_scale = next_scale
            else:
                logger.info(
                    "fp16 overflow: skipping step, loss scale stays %g (hysteresis %d -> %d)",
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        """Scale, iteration counters and hysteresis, for a checkpoint."""
        return {
            "dynamic": True,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "scale_factor": self.scale_factor,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the running state. The settings (window, minimum, hysteresis) stay as configured now,
        so a resumed run may change them in its config."""
        if not state.get("dynamic", False):
            raise ValueError("cannot load a static loss scaler's state into a dynamic one")
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = min(int(state["cur_hysteresis"]), self.delayed_shift)


def build_loss_scaler(fp16: FP16Config, **kwargs: Any) -> Optional[LossScalerBase]:
    """The scaler for a config's ``fp16`` section, the one place that decides it: dynamic when
    ``dynamic_loss_scale`` (``loss_scale`` 0), static at ``loss_scale`` otherwise, and none when fp16 is
    disabled (fp32 and bf16 train without scaling; the engine's ``loss_scale`` is then 1.0)."""
    if not fp16.enabled:
        return None
    if fp16.dynamic_loss_scale:
        return DynamicLossScaler.from_config(fp16, **kwargs)
    return StaticLossScaler(float(fp16.loss_scale))
