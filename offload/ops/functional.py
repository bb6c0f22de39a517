"""Functional optimizer updates over flat, contiguous CPU tensors (the swappers' entry points).

Every function updates its tensors in place in one pass over memory: param, optimizer state and, when
given, a 16-bit copy of the updated param. Grads are divided by `grad_scale` on the fly. The return value
is True when every grad element was finite; with `check_finite=True` a non-finite grad makes the function
return False before anything is written (a read-only pass over the grads comes first).

Inputs are checked before any work: a CUDA, sparse or non-contiguous tensor, a dtype outside the
supported set or a size mismatch raises ValueError naming the argument, so that an update can never be
written to a temporary copy and lost.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from offload import _cpu_optim

_VALUE_DTYPES = {
    torch.float32: _cpu_optim.F32,
    torch.bfloat16: _cpu_optim.BF16,
    torch.float16: _cpu_optim.F16,
}
_STATE_DTYPES = {torch.float32: _cpu_optim.F32, torch.bfloat16: _cpu_optim.BF16}
_COPY_DTYPES = {torch.bfloat16: _cpu_optim.BF16, torch.float16: _cpu_optim.F16}


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(name: str, t: object, allowed: dict, numel: Optional[int]) -> int:
    """Validates one argument; returns its dtype code."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} is a {t.layout} tensor ({_describe(t)}): only dense tensors are supported")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device} ({_describe(t)}): CPU optimizers need CPU tensors")
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{name} has dtype {t.dtype} ({_describe(t)}); supported: {names}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous ({_describe(t)}, stride {t.stride()}): the update would land in a copy"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements ({_describe(t)}) but param has {numel}")
    return allowed[t.dtype]


def _check_common(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: dict,
    param_copy: Optional[torch.Tensor],
    grad_scale: float,
) -> tuple:
    param_code = _check_tensor("param", param, _VALUE_DTYPES, None)
    n = param.numel()
    grad_code = _check_tensor("grad", grad, _VALUE_DTYPES, n)
    state_code = None
    first_state = None
    for name, t in states.items():
        code = _check_tensor(name, t, _STATE_DTYPES, n)
        if state_code is None:
            state_code, first_state = code, name
        elif code != state_code:
            raise ValueError(
                f"optimizer states must share one dtype: {first_state} is "
                f"{states[first_state].dtype}, {name} is {t.dtype}"
            )
    copy_code = _cpu_optim.NONE
    if param_copy is not None:
        copy_code = _check_tensor("param_copy", param_copy, _COPY_DTYPES, n)
    if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale!r}")
    return n, param_code, grad_code, state_code, copy_code


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_copy: Optional[torch.Tensor] = None,
    check_finite: bool = False,
) -> bool:
    """One Adam (adamw_mode=False: L2 decay added to the grad) or AdamW (decoupled decay) update.

    `step` is the step number after incrementing (1 for the first update). Math and rounding follow
    torch.optim.Adam/AdamW's single-tensor path for fp32; 16-bit tensors are computed in fp32 and rounded
    once when stored.
    """
    n, pc, gc, sc, cc = _check_common(
        param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, param_copy, grad_scale
    )
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step number after incrementing), got {step!r}")
    return _cpu_optim.adam(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        _ptr(param_copy),
        n,
        pc,
        gc,
        sc,
        cc,
        step,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw_mode),
        bool(bias_correction),
        float(grad_scale),
        bool(check_finite),
    )


def adagrad_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    param_copy: Optional[torch.Tensor] = None,
    check_finite: bool = False,
) -> bool:
    """One Adagrad update with learning rate `lr` (the caller applies lr_decay, as CPUAdagrad does)."""
    n, pc, gc, sc, cc = _check_common(param, grad, {"state_sum": state_sum}, param_copy, grad_scale)
    return _cpu_optim.adagrad(
        param.data_ptr(),
        grad.data_ptr(),
        state_sum.data_ptr(),
        _ptr(param_copy),
        n,
        pc,
        gc,
        sc,
        cc,
        float(lr),
        float(eps),
        float(weight_decay),
        float(grad_scale),
        bool(check_finite),
    )


def lion_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    param_copy: Optional[torch.Tensor] = None,
    check_finite: bool = False,
) -> bool:
    """One Lion update: param -= lr * (sign(beta1*m + (1-beta1)*g) + wd*param); m = beta2*m + (1-beta2)*g."""
    n, pc, gc, sc, cc = _check_common(param, grad, {"exp_avg": exp_avg}, param_copy, grad_scale)
    return _cpu_optim.lion(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        _ptr(param_copy),
        n,
        pc,
        gc,
        sc,
        cc,
        float(lr),
        float(beta1),
        float(beta2),
        float(weight_decay),
        float(grad_scale),
        bool(check_finite),
    )


def make_segment(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_a: torch.Tensor,
    state_b: Optional[torch.Tensor] = None,
    *,
    step: int = 1,
    lr: float = 0.0,
) -> tuple:
    """Validates one tensor of a multi-tensor step (the optimizers' batched path) and packs its pointers.

    state_a/state_b are named exp_avg/exp_avg_sq in errors; `step` (Adam) and `lr` (Adagrad) are per
    tensor. The tuple holds raw addresses: keep the tensors alive until the step has run.
    """
    states = {"exp_avg": state_a} if state_b is None else {"exp_avg": state_a, "exp_avg_sq": state_b}
    n, pc, gc, sc, _ = _check_common(param, grad, states, None, 1.0)
    return (
        param.data_ptr(),
        grad.data_ptr(),
        state_a.data_ptr(),
        _ptr(state_b),
        0,
        n,
        pc,
        gc,
        sc,
        _cpu_optim.NONE,
        int(step),
        float(lr),
    )


def grads_finite(grad: torch.Tensor) -> bool:
    """True when every element of a contiguous CPU fp32/bf16/fp16 tensor is finite (multithreaded)."""
    code = _check_tensor("grad", grad, _VALUE_DTYPES, None)
    return _cpu_optim.all_finite(grad.data_ptr(), grad.numel(), code)
