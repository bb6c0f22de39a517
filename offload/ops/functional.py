"""Functional optimizer updates over flat, contiguous CPU tensors (the swappers' entry points).

Every function updates its tensors in place in one pass over memory: param, optimizer state and, when
given, a 16-bit copy of the updated param. Grads are divided by `grad_scale` on the fly. The return value
is True when every grad element was finite; with `check_finite=True` a non-finite grad makes the function
return False before anything is written (a read-only pass over the grads comes first).

Optimizer states are fp32, bf16 (rounded to nearest even, or stochastically with
`stochastic_rounding=True`: bits from a hash of (seed, step, element index)) or uint8: block-wise 8-bit
codes with one fp32 absmax per QUANT_BLOCK elements (see offload/ops/quant.py), passed as
`<state>_absmax`.

Inputs are checked before any work: a CUDA, sparse or non-contiguous tensor, a dtype outside the
supported set, a size mismatch, a missing or wrongly sized absmax, or an absmax or stochastic rounding for
states that have no use for it raises ValueError naming the argument, so that an update can never be
written to a temporary copy and lost.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from offload import _cpu_optim

from .quant import QUANT_BLOCK, check_seed, num_blocks, sr_keys

_VALUE_DTYPES = {
    torch.float32: _cpu_optim.F32,
    torch.bfloat16: _cpu_optim.BF16,
    torch.float16: _cpu_optim.F16,
}
_STATE_DTYPES = {torch.float32: _cpu_optim.F32, torch.bfloat16: _cpu_optim.BF16}
_COPY_DTYPES = {torch.bfloat16: _cpu_optim.BF16, torch.float16: _cpu_optim.F16}
U8 = _cpu_optim.U8  # dtype code of 8-bit block-quantized states
assert _cpu_optim.QUANT_BLOCK == QUANT_BLOCK
_ANY_STATE_DTYPES = {**_STATE_DTYPES, torch.uint8: U8}
_ABSMAX_DTYPES = {torch.float32: _cpu_optim.F32}


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
    absmax: Optional[dict] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> tuple:
    """Validates everything; returns (n, param code, grad code, state code, copy code).

    `absmax` maps each state's name to its `<name>_absmax` argument (None when not given); the state code
    is U8 for uint8 states.
    """
    param_code = _check_tensor("param", param, _VALUE_DTYPES, None)
    n = param.numel()
    grad_code = _check_tensor("grad", grad, _VALUE_DTYPES, n)
    state_code = None
    first_state = None
    allowed = _ANY_STATE_DTYPES if absmax is not None else _STATE_DTYPES
    for name, t in states.items():
        code = _check_tensor(name, t, allowed, n)
        if state_code is None:
            state_code, first_state = code, name
        elif code != state_code:
            raise ValueError(
                f"optimizer states must share one dtype: {first_state} is "
                f"{states[first_state].dtype}, {name} is {t.dtype}"
            )
    for name in states:
        a = (absmax or {}).get(name)
        if state_code == U8:
            nb = num_blocks(n)
            if a is None:
                raise ValueError(
                    f"{name} is a torch.uint8 (8-bit) state, so {name}_absmax is required: a float32 tensor "
                    f"of ceil({n} / {QUANT_BLOCK}) = {nb} elements"
                )
            _check_tensor(f"{name}_absmax", a, _ABSMAX_DTYPES, None)
            if a.numel() != nb:
                raise ValueError(
                    f"{name}_absmax has {a.numel()} elements ({_describe(a)}) but {name} has {n}: expected "
                    f"ceil({n} / {QUANT_BLOCK}) = {nb}"
                )
        elif a is not None:
            raise ValueError(
                f"{name}_absmax is given but {name} has dtype {states[name].dtype}: an absmax belongs to "
                f"torch.uint8 (8-bit) states only"
            )
    if not isinstance(stochastic_rounding, bool):
        raise ValueError(f"stochastic_rounding must be a bool, got {stochastic_rounding!r}")
    check_seed(seed)
    if stochastic_rounding and state_code != _cpu_optim.BF16:
        raise ValueError(
            f"stochastic_rounding=True applies to bf16 optimizer states, but {first_state} has dtype "
            f"{states[first_state].dtype}"
        )
    copy_code = _cpu_optim.NONE
    if param_copy is not None:
        copy_code = _check_tensor("param_copy", param_copy, _COPY_DTYPES, n)
    if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale!r}")
    return n, param_code, grad_code, state_code, copy_code


def _check_step(step: object, minimum: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < minimum:
        what = "the step number after incrementing" if minimum == 1 else "used by stochastic rounding"
        raise ValueError(f"step must be an int >= {minimum} ({what}), got {step!r}")


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
    exp_avg_absmax: Optional[torch.Tensor] = None,
    exp_avg_sq_absmax: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> bool:
    """One Adam (adamw_mode=False: L2 decay added to the grad) or AdamW (decoupled decay) update.

    `step` is the step number after incrementing (1 for the first update). Math and rounding follow
    torch.optim.Adam/AdamW's single-tensor path for fp32; 16-bit tensors are computed in fp32 and rounded
    once when stored. States may be fp32, bf16 (`stochastic_rounding` rounds them with bits hashed from
    (seed, step, index)) or uint8 8-bit codes with `exp_avg_absmax`/`exp_avg_sq_absmax` (signed and
    unsigned code maps, one fp32 absmax per QUANT_BLOCK elements).
    """
    n, pc, gc, sc, cc = _check_common(
        param,
        grad,
        {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
        param_copy,
        grad_scale,
        {"exp_avg": exp_avg_absmax, "exp_avg_sq": exp_avg_sq_absmax},
        stochastic_rounding,
        seed,
    )
    _check_step(step, 1)

    k0, k1 = sr_keys(seed, step) if stochastic_rounding else (0, 0)
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
        _ptr(exp_avg_absmax),
        _ptr(exp_avg_sq_absmax),
        stochastic_rounding,
        k0,
        k1,
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
    state_sum_absmax: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    step: int = 0,
) -> bool:
    """One Adagrad update with learning rate `lr` (the caller applies lr_decay, as CPUAdagrad does).

    `state_sum` may be uint8 8-bit codes (unsigned map) with `state_sum_absmax`. `step` only feeds the
    stochastic-rounding hash: pass the step number so that successive steps draw different bits.
    """
    n, pc, gc, sc, cc = _check_common(
        param,
        grad,
        {"state_sum": state_sum},
        param_copy,
        grad_scale,
        {"state_sum": state_sum_absmax},
        stochastic_rounding,
        seed,
    )
    _check_step(step, 0)

    k0, k1 = sr_keys(seed, step) if stochastic_rounding else (0, 0)
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
        _ptr(state_sum_absmax),
        stochastic_rounding,
        k0,
        k1,
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
    exp_avg_absmax: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    step: int = 0,
) -> bool:
    """One Lion update: param -= lr * (sign(beta1*m + (1-beta1)*g) + wd*param); m = beta2*m + (1-beta2)*g.

    `exp_avg` may be uint8 8-bit codes (signed map) with `exp_avg_absmax`. `step` only feeds the
    stochastic-rounding hash: pass the step number so that successive steps draw different bits.
    """
    n, pc, gc, sc, cc = _check_common(
        param,
        grad,
        {"exp_avg": exp_avg},
        param_copy,
        grad_scale,
        {"exp_avg": exp_avg_absmax},
        stochastic_rounding,
        seed,
    )
    _check_step(step, 0)

    k0, k1 = sr_keys(seed, step) if stochastic_rounding else (0, 0)
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
        _ptr(exp_avg_absmax),
        stochastic_rounding,
        k0,
        k1,
    )


def make_segment(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_a: torch.Tensor,
    state_b: Optional[torch.Tensor] = None,
    *,
    step: int = 1,
    lr: float = 0.0,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> tuple:
    """Validates one tensor of a multi-tensor step (the optimizers' batched path) and packs its pointers.

    state_a/state_b are named exp_avg/exp_avg_sq in errors; `step` (Adam's bias correction, and the
    stochastic-rounding hash) and `lr` (Adagrad) are per tensor. The tuple holds raw addresses: keep the
    tensors alive until the step has run.
    """
    states = {"exp_avg": state_a} if state_b is None else {"exp_avg": state_a, "exp_avg_sq": state_b}
    n, pc, gc, sc, _ = _check_common(param, grad, states, None, 1.0, None, stochastic_rounding, seed)
    k0, k1 = sr_keys(seed, step) if stochastic_rounding else (0, 0)
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
        stochastic_rounding,
        k0,
        k1,
    )


def grads_finite(grad: torch.Tensor) -> bool:
    """True when every element of a contiguous CPU fp32/bf16/fp16 tensor is finite (multithreaded)."""
    code = _check_tensor("grad", grad, _VALUE_DTYPES, None)
    return _cpu_optim.all_finite(grad.data_ptr(), grad.numel(), code)
