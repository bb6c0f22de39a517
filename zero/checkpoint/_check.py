"""Checks of every field a load applies, made before the first write (load.py: validate, then apply).

A field of the wrong type or range would otherwise fail half-way through applying, after the weights and
optimizer states were already overwritten. Library states (RNG, loss scaler) are checked by loading them
into a copy and restoring the original; states of other objects (an LR scheduler) must have the keys and
value types of the live object's own `state_dict()`.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = [
    "check_counters",
    "check_like",
    "check_loss_scaler",
    "check_plan_types",
    "check_rng",
    "check_step",
    "param_mismatch",
]

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_counters(ms: Dict[str, Any], where: str) -> None:
    for key in COUNTERS:
        if not _is_int(ms.get(key)) or ms[key] < 0:
            raise ValueError(f"{where}: '{key}' is not an int >= 0")


def check_step(meta: Dict[str, Any], groups_live: List[Dict[str, Any]], where: str) -> None:
    """The optimizer's step count and every param group's hyperparameters, as `_apply` sets them
    (`groups_live`: the engine's `group_hyperparameters()`)."""
    if not _is_int(meta.get("step")) or meta["step"] < 0:
        raise ValueError(f"{where}: the optimizer's 'step' is not an int >= 0")
    groups = meta.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{where}: the optimizer's 'param_groups' is not a list of dicts")
    if len(groups) != len(groups_live):
        raise ValueError(
            f"{where}: the saved optimizer's 'param_groups' has {len(groups)} param group(s), this one "
            f"{len(groups_live)}: build the engine with the same groups"
        )
    for i, (saved, live) in enumerate(zip(groups, groups_live)):
        check_like(saved, live, f"{where}: the optimizer's param_groups[{i}]", extra_ok=False)
        for k, v in saved.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{where}: the optimizer's param_groups[{i}]['{k}'] is not finite")


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return "sequence"
    if isinstance(v, dict):
        return "dict"
    if isinstance(v, torch.Tensor):
        return "tensor"
    return type(v).__name__


def check_like(saved: Any, live: Any, what: str, extra_ok: bool = False) -> None:
    """Raise ValueError unless `saved` has the structure of `live` (same dict keys - `extra_ok`: saved may
    hold more -, sequence lengths, and kinds of values: numbers, bools, strings, tensors of one shape).
    None on either side matches anything (a value that is not set yet)."""
    if saved is None or live is None:
        return
    if _kind(saved) != _kind(live):
        raise ValueError(f"{what}: a {_kind(saved)} where a {_kind(live)} belongs")
    if isinstance(live, dict):
        missing = [k for k in live if k not in saved]
        extra = [k for k in saved if k not in live]
        if missing or (extra and not extra_ok):
            raise ValueError(
                f"{what}: keys {sorted(map(str, missing + extra))[:5]} differ from the live state's"
            )
        for k in live:
            check_like(saved[k], live[k], f"{what}[{k!r}]", extra_ok)
    elif isinstance(live, (list, tuple)):
        if len(saved) != len(live):
            raise ValueError(f"{what}: {len(saved)} entries, the live state has {len(live)}")
        for i, (a, b) in enumerate(zip(saved, live)):
            check_like(a, b, f"{what}[{i}]", extra_ok)
    elif isinstance(live, torch.Tensor) and (saved.shape != live.shape or saved.dtype != live.dtype):
        raise ValueError(
            f"{what}: a {saved.dtype} tensor of shape {tuple(saved.shape)}, not {live.dtype} "
            f"{tuple(live.shape)}"
        )


def check_loss_scaler(scaler: Any, state: Any, where: str) -> None:
    """Load `state` into a copy of `scaler`: its own checks, the live scaler untouched."""
    if not isinstance(state, dict):
        raise ValueError(f"{where}: the loss scaler's state is not a dict")
    try:
        copy.deepcopy(scaler).load_state_dict(state)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ValueError(
            f"{where}: the loss scaler's state does not load ({type(e).__name__}: {e})"
        ) from None


def check_rng(state: Any, where: str) -> None:
    """Set every saved RNG state and restore the current ones: each library checks its own state."""
    from zero.checkpoint._state import rng_state, set_rng_state

    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise ValueError(f"{where}: 'rng' is not a dict of RNG states (torch, python, ...)")
    now = rng_state()
    try:
        set_rng_state(state)
    except Exception as e:  # noqa: BLE001 - any refusal of a library means the state is malformed
        raise ValueError(f"{where}: the saved RNG state does not load ({type(e).__name__}: {e})") from None
    finally:
        set_rng_state(now)


def _params(index: Any) -> Optional[List[Tuple[str, Tuple[int, ...]]]]:
    """(name, shape) of each parameter in a `master_index`, or None if it is not one."""
    try:
        if index["kind"] == "flat":
            return [
                (str(names[0]), tuple(int(d) for d in shape)) for names, shape in index["params"] if names
            ]
        return [(str(p[0][0]), tuple(int(d) for d in p[1])) for unit in index["units"] for p in unit if p[0]]
    except (KeyError, TypeError, IndexError, ValueError):
        return None


def param_mismatch(saved_index: Any, live_index: Any) -> Tuple[Optional[str], bool]:
    """(the first parameter whose shape differs between a checkpoint's `master_index` and the model's, or
    that only one of them has, with both shapes; whether it is a shape that differs) - (None, False) when
    they agree or the checkpoint has no index."""
    saved, live = _params(saved_index), _params(live_index)
    if saved is None or live is None:
        return None, False
    saved_shape, live_shape = dict(saved), dict(live)
    for name, shape in live:
        if name in saved_shape and saved_shape[name] != shape:
            return (
                f"parameter {name}: shape {saved_shape[name]} in the checkpoint, {shape} in the model",
                True,
            )
    for name, shape in live:
        if name not in saved_shape:
            return f"parameter {name} (shape {shape}) is not in the checkpoint", False
    for name, shape in saved:
        if name not in live_shape:
            return f"the checkpoint's parameter {name} (shape {shape}) is not in the model", False
    return None, False


def check_plan_types(ms: Any, rs: Any, optimizer: bool, stage3: bool, where: str) -> None:
    """The fields of model_states.pt / rank<r>_states.pt the checks and the load read, by type."""
    if not isinstance(ms, dict) or not isinstance(rs, dict):
        raise ValueError(f"{where}: model_states.pt or the rank's states file is not a dict")
    for key, lo in (("numel", 0), ("world_size", 1)):
        if not _is_int(ms.get(key)) or ms[key] < lo:
            raise ValueError(f"{where}: '{key}' is not an int >= {lo}")
    if not isinstance(ms.get("module"), dict) or not all(isinstance(k, str) for k in ms["module"]):
        raise ValueError(f"{where}: 'module' is not a state dict")
    pickled = ms.get("pickled", [])
    if not isinstance(pickled, list) or not set(pickled) <= {"lr_scheduler", "client_state"}:
        raise ValueError(f"{where}: 'pickled' is not a list of 'lr_scheduler' / 'client_state'")
    if optimizer:
        meta = rs.get("optimizer")
        part = meta.get("partition") if isinstance(meta, dict) else None
        if not isinstance(part, (list, tuple)) or len(part) != 2 or not all(_is_int(v) for v in part):
            raise ValueError(f"{where}: the optimizer's metadata has no 'partition' [lo, hi]")
        if not isinstance(meta.get("rule"), str):
            raise ValueError(f"{where}: the optimizer's 'rule' is not a name")
    if stage3:
        units = rs.get("stage3_units")
        if not isinstance(units, list) or not all(
            isinstance(u, (list, tuple)) and len(u) == 3 and isinstance(u[0], str) and _is_int(u[1])
            for u in units
        ):
            raise ValueError(f"{where}: 'stage3_units' is not a list of [name, numel, dtype]")
