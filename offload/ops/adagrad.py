"""CPUAdagrad: torch.optim.Adagrad's algorithm and state layout over the C++ SIMD kernel."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from offload import _cpu_optim
from offload.config.optimizer import OPTIMIZER_DEFAULTS

from ._base import CPUOptimizerBase
from .functional import make_segment

_DEFAULT = OPTIMIZER_DEFAULTS["adagrad"]


class CPUAdagrad(CPUOptimizerBase):
    """Adagrad on CPU tensors (torch.optim.Adagrad's arguments; state `sum` and `step`).

    As in torch, state is created at construction (sum filled with initial_accumulator_value). Sparse
    grads are rejected. With fp32_optimizer_states=False the sum is bf16, rounded to nearest even or, with
    stochastic_rounding=True, stochastically (bits hashed from seed + param position, step, element index).
    """

    _state_keys = ("sum",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _DEFAULT["lr"],
        lr_decay: float = 0.0,
        weight_decay: float = _DEFAULT["weight_decay"],
        initial_accumulator_value: float = 0.0,
        eps: float = _DEFAULT["eps"],
        fp32_optimizer_states: bool = True,
        stochastic_rounding: bool = False,
        seed: int = 0,
    ) -> None:
        for name, value in (
            ("learning rate", lr),
            ("lr_decay", lr_decay),
            ("weight_decay", weight_decay),
            ("initial_accumulator_value", initial_accumulator_value),
            ("epsilon", eps),
        ):
            if not value >= 0.0:
                raise ValueError(f"Invalid {name} value: {value}")
        self._check_rounding(fp32_optimizer_states, stochastic_rounding, seed)
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            fp32_optimizer_states=fp32_optimizer_states,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            dtype = self._state_dtype(group)
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["sum"] = torch.full(p.shape, group["initial_accumulator_value"], dtype=dtype)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adagrad step of every parameter with a gradient, in the fused CPU kernel; `closure`'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            segments, states = [], []
            for p, where, pi in self._params_with_grad(gi, group):
                state = self.state[p]
                if len(state) == 0:  # a param added after construction (add_param_group)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["sum"] = torch.full(
                        p.shape, group["initial_accumulator_value"], dtype=self._state_dtype(group)
                    )
                step = float(state["step"].item()) + 1.0
                # Same expression as torch's _single_tensor_adagrad, in double precision.
                clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
                try:
                    rounding = self._rounding(group, gi, pi)
                    segments.append(make_segment(p, p.grad, state["sum"], step=int(step), lr=clr, **rounding))
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{where}: {exc}") from None
                states.append(state)
            if not segments:
                continue
            _cpu_optim.adagrad_multi(segments, float(group["eps"]), float(group["weight_decay"]))
            for state in states:
                state["step"] += 1
        return loss
