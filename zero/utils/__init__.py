"""DeepSpeed's state accessors (`deepspeed.utils.safe_get_full_fp32_param` & co.) for engines of every
stage and tier.

Each takes a model parameter and finds the engine that trains it; a parameter no live engine trains (frozen,
not given to the optimizer, an inference engine's, or the engine closed) reads as None and setting it does
nothing, as in DeepSpeed. The engine's part doing the work is zero.engine.state_access.StateAccess.

* fp32 master and optimizer states (`"exp_avg"`, `"exp_avg_sq"`; Adagrad `"state_sum"` or torch's
  `"sum"`) are read and written through the state's tier, NVMe included, each call one pass over the rank's
  state. Setting the master also sets the model-dtype weights (the next forward sees it).
* Gradients are readable and writable between the backward that ends an accumulation window and `step()`
  (DeepSpeed's documented window): the accumulated gradient the optimizer will apply, averaged over ranks,
  times the loss scale under fp16 (the step unscales it), as DeepSpeed's. `step()` clears them.
* `full` values are whole parameters (collective where the state is partitioned over ranks: every rank
  calls it); `local` values are this rank's share as a 1-D tensor: the elements `param.ds_tensor` holds at
  stage 3, the rank's slice of the flattened parameter at stages 0-2 (DeepSpeed defines the local forms for
  ZeRO-3 only).

Returned tensors are fp32 on the engine's device (gradients: where the gradient partition lives).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from zero.engine.state_access import StateAccess, access_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "see_memory_usage",
]


def _read(acc: StateAccess, param: Any, key: Optional[str]) -> torch.Tensor:
    return acc.read_local([param], acc.state_index(key))[0].to(acc.device)


def _write(acc: StateAccess, param: Any, local: torch.Tensor, key: Optional[str]) -> None:
    acc.write_local([(param, acc.check_local(param, local))], acc.state_index(key))


# ------------------------------------------------------------------------------- full: master and states
def safe_get_full_fp32_param(param: Any) -> Optional[torch.Tensor]:
    """The whole fp32 master of `param` (its shape), or None."""
    acc = access_of(param)
    return None if acc is None else acc.to_full(param, _read(acc, param, None))


def safe_set_full_fp32_param(param: Any, value: torch.Tensor) -> None:
    """Set the fp32 master of `param` (and its model-dtype weights) to `value` (the parameter's size)."""
    acc = access_of(param)
    if acc is not None:
        _write(acc, param, acc.local_of(param, value), None)


def safe_get_full_optimizer_state(param: Any, optim_state_key: str) -> Optional[torch.Tensor]:
    """The whole optimizer state `optim_state_key` of `param` as fp32, or None."""
    acc = access_of(param)
    return None if acc is None else acc.to_full(param, _read(acc, param, optim_state_key))


def safe_set_full_optimizer_state(param: Any, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state `optim_state_key` of `param` to `value` (the parameter's size)."""
    acc = access_of(param)
    if acc is not None:
        _write(acc, param, acc.local_of(param, value), optim_state_key)


# ------------------------------------------------------------------------------------ full: gradients
def safe_get_full_grad(param: Any) -> Optional[torch.Tensor]:
    """The whole accumulated gradient of `param` (between backward and step), or `param.grad` for a
    parameter no engine trains (None without one)."""
    acc = access_of(param)
    if acc is None:
        return param.grad
    return acc.to_full(param, acc.read_local_grad(param))


def safe_set_full_grad(param: Any, value: torch.Tensor) -> None:
    """Replace the accumulated gradient of `param` (the next `step()` applies it)."""
    acc = access_of(param)
    if acc is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    acc.write_local_grad(param, acc.local_of(param, value))


def safe_update_full_grad_vectorized(param_list: List[Any], update_func: Callable[..., Any]) -> None:
    """Replace each parameter's whole gradient by `update_func(current_full_grad, param)`."""
    for p in param_list:
        acc = access_of(p)
        if acc is None:
            if p.grad is not None:
                p.grad.copy_(update_func(p.grad, p))
            continue
        acc.update_grads([p], update_func)


# ------------------------------------------------------------------------------------------------ local
def safe_get_local_fp32_param(param: Any) -> Optional[torch.Tensor]:
    """This rank's share of the fp32 master of `param` (1-D), or None."""
    acc = access_of(param)
    return None if acc is None else _read(acc, param, None)


def safe_set_local_fp32_param(param: Any, value: torch.Tensor) -> None:
    """Set this rank's share of the fp32 master of `param` (and of its weights)."""
    acc = access_of(param)
    if acc is not None:
        _write(acc, param, value, None)


def safe_get_local_optimizer_state(param: Any, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's share of the optimizer state `optim_state_key` of `param` (1-D fp32), or None."""
    acc = access_of(param)
    return None if acc is None else _read(acc, param, optim_state_key)


def safe_set_local_optimizer_state(param: Any, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's share of the optimizer state `optim_state_key` of `param`."""
    acc = access_of(param)
    if acc is not None:
        _write(acc, param, value, optim_state_key)


def safe_get_local_grad(param: Any) -> Optional[torch.Tensor]:
    """This rank's share of the accumulated gradient of `param` (1-D fp32), or None."""
    acc = access_of(param)
    return None if acc is None else acc.read_local_grad(param)


def safe_set_local_grad(param: Any, value: torch.Tensor) -> None:
    """Set this rank's share of the accumulated gradient of `param`."""
    acc = access_of(param)
    if acc is not None:
        acc.write_local_grad(param, acc.check_local(param, value))


# ------------------------------------------------------------------------------------------ diagnostics
def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's `see_memory_usage`: with `force=True`, log (logger "zero", INFO, on rank 0) `message`
    with the accelerator's allocated / reserved memory and their peaks (CUDA), this process's resident
    host memory and the pinned bytes the engine's pools hold. Without `force` nothing happens, as in
    DeepSpeed (its callers pass force=True to print)."""
    import logging

    import torch.distributed as dist

    from offload.pinned import pinned_bytes_in_use

    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gib = 1 << 30
    parts = [message]
    if torch.cuda.is_available():
        c = torch.cuda
        parts.append(
            f"MA {c.memory_allocated() / gib:.2f} GB, Max_MA {c.max_memory_allocated() / gib:.2f} GB, "
            f"CA {c.memory_reserved() / gib:.2f} GB, Max_CA {c.max_memory_reserved() / gib:.2f} GB"
        )
        torch.cuda.reset_peak_memory_stats()
    parts.append(f"host RSS {_rss_bytes() / gib:.2f} GB, pinned {pinned_bytes_in_use() / gib:.2f} GB")
    logging.getLogger("zero").info(" | ".join(parts))


def _rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it cannot be read)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
