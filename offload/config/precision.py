"""The ``"fp16"`` and ``"bf16"`` sections (DeepSpeed's keys and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._reader import Context, Section

_FP16_KEYS = (
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
    "fused_mode",
)

_BF16_KEYS = (
    "enabled",
    "check_grad_overflow",
    "immediate_grad_update",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)


@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision; ``loss_scale`` 0 selects dynamic loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale is dynamic (`loss_scale` 0)."""
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The dynamic scaler's first scale: 2 ** initial_scale_power."""
        return float(2**self.initial_scale_power)


@dataclass(frozen=True)
class BF16Config:
    """bf16 mixed precision (no loss scaling); ``check_grad_overflow`` skips steps with non-finite grads."""

    enabled: bool = False
    check_grad_overflow: bool = False


def parse_fp16(raw: Any, ctx: Context) -> FP16Config:
    """Validate the `fp16` section into an FP16Config."""
    s = Section(raw, "fp16", ctx, _FP16_KEYS)
    s.off_only(
        "fp16_master_weights_and_grads", lambda v: v is False, "keeping fp16 master weights and grads (true)"
    )
    # fused_mode picks between two DeepSpeed implementations of the same non-ZeRO fp16 optimizer.
    s.ignored_unless(
        "fused_mode", s.bool("fused_mode", True), True, "the engine has one fp16 path (fused with the update)"
    )
    return FP16Config(
        enabled=s.bool("enabled", FP16Config.enabled),
        auto_cast=s.bool("auto_cast", FP16Config.auto_cast),
        loss_scale=s.float("loss_scale", FP16Config.loss_scale, min=0.0),
        # 2**64 already exceeds fp32's exponent range for a useful scale; larger powers are typos.
        initial_scale_power=s.int("initial_scale_power", FP16Config.initial_scale_power, min=0, max=64),
        loss_scale_window=s.int("loss_scale_window", FP16Config.loss_scale_window, min=1),
        hysteresis=s.int("hysteresis", FP16Config.hysteresis, min=1),
        consecutive_hysteresis=s.bool("consecutive_hysteresis", FP16Config.consecutive_hysteresis),
        min_loss_scale=s.float("min_loss_scale", FP16Config.min_loss_scale, min=0.0, min_exclusive=True),
    )


def parse_bf16(raw: Any, ctx: Context, path: str = "bf16") -> BF16Config:
    """Validate the `bf16` (or `bfloat16`) section into a BF16Config."""
    s = Section(raw, path, ctx, _BF16_KEYS)
    s.off_only(
        "bf16_master_weights_and_grads", lambda v: v is False, "keeping bf16 master weights and grads (true)"
    )
    s.off_only("bf16_optimizer_states", lambda v: v is False, "keeping optimizer states in bf16 (true)")
    # Ordering detail of DeepSpeed's non-ZeRO bf16 optimizer; the update is the same either way.
    s.ignored_unless(
        "immediate_grad_update",
        s.bool("immediate_grad_update", False),
        False,
        "an ordering detail of DeepSpeed's non-ZeRO bf16 optimizer",
    )
    return BF16Config(
        enabled=s.bool("enabled", BF16Config.enabled),
        check_grad_overflow=s.bool("check_grad_overflow", BF16Config.check_grad_overflow),
    )
