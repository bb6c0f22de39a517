"""CPUAdam / CPUAdamW: torch.optim.Optimizer over the C++ SIMD Adam kernel (DeepSpeedCPUAdam's interface)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple

import torch

from offload import _cpu_optim
from offload.config.optimizer import OPTIMIZER_DEFAULTS

from ._base import CPUOptimizerBase
from .functional import make_segment


def _check_hyper(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1))")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


_DEFAULT = OPTIMIZER_DEFAULTS["adam"]
_DEFAULT_W = OPTIMIZER_DEFAULTS["adamw"]


class CPUAdam(CPUOptimizerBase):
    """Adam (adamw_mode=False, L2 decay) or AdamW (adamw_mode=True, decoupled decay) on CPU tensors.

    Same constructor as DeepSpeed's DeepSpeedCPUAdam. Params may be fp32, bf16 or fp16 (updated in fp32
    and rounded once); optimizer states are fp32, or bf16 with fp32_optimizer_states=False (rounded to
    nearest even, or stochastically with stochastic_rounding=True: bits hashed from (seed + param position,
    step, element index), see docs/cpu_optimizers.md). State layout
    (`step` as a float32 tensor, `exp_avg`, `exp_avg_sq`) is torch.optim.Adam's, so state_dicts move both
    ways between this class and torch.optim.Adam/AdamW. amsgrad is not supported (ValueError).
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = _DEFAULT["lr"],
        bias_correction: bool = True,
        betas: Tuple[float, float] = _DEFAULT["betas"],
        eps: float = _DEFAULT["eps"],
        weight_decay: float = _DEFAULT["weight_decay"],
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not support amsgrad=True")
        _check_hyper(lr, betas, eps, weight_decay)
        self._check_rounding(fp32_optimizer_states, stochastic_rounding, seed)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=False,
            adamw_mode=adamw_mode,
            fp32_optimizer_states=fp32_optimizer_states,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )
        super().__init__(model_params, defaults)

    def _fill_group_defaults(self, group: dict) -> None:
        # torch.optim.Adam/AdamW record the decay flavour as decoupled_weight_decay.
        if "adamw_mode" not in group and "decoupled_weight_decay" in group:
            group["adamw_mode"] = bool(group["decoupled_weight_decay"])
        super()._fill_group_defaults(group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam/AdamW step of each parameter with a gradient in the fused CPU kernel; `closure`'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            if group.get("amsgrad", False):
                raise ValueError(f"param group {gi}: amsgrad is not supported")
            segments, states = [], []
            for p, where, pi in self._params_with_grad(gi, group):
                state = self.state[p]
                if len(state) == 0:
                    dtype = self._state_dtype(group)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype)
                step = int(state["step"].item()) + 1
                try:
                    segments.append(
                        make_segment(
                            p,
                            p.grad,
                            state["exp_avg"],
                            state["exp_avg_sq"],
                            step=step,
                            **self._rounding(group, gi, pi),
                        )
                    )
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{where}: {exc}") from None
                states.append(state)
            if not segments:
                continue
            beta1, beta2 = group["betas"]
            _cpu_optim.adam_multi(
                segments,
                float(beta1),
                float(beta2),
                float(group["eps"]),
                float(group["weight_decay"]),
                float(group["lr"]),
                bool(group["adamw_mode"]),
                bool(group["bias_correction"]),
            )
            for state in states:  # only once the update was applied
                state["step"] += 1
        return loss


class CPUAdamW(CPUAdam):
    """CPUAdam with decoupled weight decay (adamw_mode=True), the torch.optim.AdamW algorithm."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = _DEFAULT_W["lr"],
        bias_correction: bool = True,
        betas: Tuple[float, float] = _DEFAULT_W["betas"],
        eps: float = _DEFAULT_W["eps"],
        weight_decay: float = _DEFAULT_W["weight_decay"],
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adamw_mode=True,
            fp32_optimizer_states=fp32_optimizer_states,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )
