"""CPULion: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with
decoupled weight decay, over the C++ SIMD kernel."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple

import torch

from offload import _cpu_optim
from offload.config.optimizer import OPTIMIZER_DEFAULTS

from ._base import CPUOptimizerBase
from .functional import make_segment

_DEFAULT = OPTIMIZER_DEFAULTS["lion"]


class CPULion(CPUOptimizerBase):
    """Lion on CPU tensors: update = sign(beta1*m + (1-beta1)*g); param = param*(1 - lr*wd) - lr*update;
    m = beta2*m + (1-beta2)*g. State: `exp_avg`."""

    _state_keys = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _DEFAULT["lr"],
        betas: Tuple[float, float] = _DEFAULT["betas"],
        weight_decay: float = _DEFAULT["weight_decay"],
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1])")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr, betas=tuple(betas), weight_decay=weight_decay, fp32_optimizer_states=fp32_optimizer_states
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Lion step of every parameter with a gradient, in the fused CPU kernel; `closure`'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            segments = []
            for p, where, _ in self._params_with_grad(gi, group):
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros(p.shape, dtype=self._state_dtype(group))
                try:
                    segments.append(make_segment(p, p.grad, state["exp_avg"]))
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{where}: {exc}") from None
            if segments:
                beta1, beta2 = group["betas"]
                _cpu_optim.lion_multi(
                    segments, float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"])
                )
        return loss
