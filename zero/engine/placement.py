"""`engine.placement()`: where each state of the engine went - parameters, optimizer state - with the bytes
per tier and why, and the one INFO line the engine logs about it when it is built.

The parameters' share comes from the stage-3 store (zero.stage3.placement) or, for stages 0-2, the
module's parameters on the compute device; the optimizer state's from `engine.optimizer_state_info()`.
"""

from __future__ import annotations

from typing import Any, Dict

from offload.estimate.units import format_bytes
from offload.swap.slots import StateFormat
from zero.stage3.placement import ParamPlacement

__all__ = ["engine_placement", "format_placement"]


def _parameters(engine: Any) -> Dict[str, Any]:
    part = engine.layout.partitioner
    if part is not None:
        off = engine.config.zero_optimization.offload_param
        return part.param_placement(off.max_in_cpu if off is not None else "auto").as_dict()
    nbytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    return ParamPlacement(
        tier="none",
        device_bytes=nbytes,
        host_bytes=0,
        host_pinned=False,
        nvme_bytes=0,
        max_in_cpu=0,
        resident_numel=-1,
        budget_bytes=engine.pool.cap_bytes,
        why=f"stage {engine.stage}: the parameters live on the compute device",
    ).as_dict()


def _optimizer(engine: Any) -> Dict[str, Any]:
    if engine.optimizer is None:
        return {"tier": "none", "device_bytes": 0, "host_bytes": 0, "nvme_bytes": 0, "why": "no optimizer"}
    info = engine.optimizer_state_info()
    fmt = StateFormat(engine.rule.n_states, info.state_dtype)
    off = engine.config.zero_optimization.offload_optimizer
    if info.tier == "device":
        device, host = fmt.whole_bytes(info.numel), 0
    else:
        device = fmt.whole_bytes(info.device_numel)
        host = fmt.whole_bytes(info.resident_numel - info.device_numel)
    if info.tier == "device":
        why = "offload_optimizer.device=none"
    elif info.tier == "cpu":
        why = "offload_optimizer.device=cpu"
    elif off.max_in_cpu != "auto":
        why = f"offload_optimizer.max_in_cpu={off.max_in_cpu}"
    elif info.swapped_numel == 0:
        why = "max_in_cpu=auto: the state fits in what the pinned budget had left"
    else:
        why = "max_in_cpu=auto: what the pinned budget had left stays in RAM, the rest on NVMe"
    return {
        "tier": info.tier,
        "device_bytes": device,
        "host_bytes": host,
        "nvme_bytes": fmt.whole_bytes(info.swapped_numel),
        "nvme_copies": info.copies,
        "max_in_cpu": off.max_in_cpu if off is not None else 0,
        "why": why,
    }


def engine_placement(engine: Any) -> Dict[str, Any]:
    """Where each state of `engine` lives: {"parameters": ..., "optimizer_state": ..., "pinned_budget_bytes",
    "pinned_bytes_in_use"}; each state gives device_bytes, host_bytes, nvme_bytes (one rank's) and why."""
    return {
        "parameters": _parameters(engine),
        "optimizer_state": _optimizer(engine),
        "pinned_budget_bytes": engine.pool.cap_bytes,
        "pinned_bytes_in_use": engine.pool.bytes_in_use,
    }


def format_placement(placement: Dict[str, Any]) -> str:
    """The placement as one log line: bytes per tier of each state, and why."""
    parts = []
    for name in ("parameters", "optimizer_state"):
        p = placement[name]
        if name == "optimizer_state" and p["tier"] == "none" and p["why"] == "no optimizer":
            continue
        tiers = [
            f"{format_bytes(p[key])} {label}"
            for key, label in (("device_bytes", "device"), ("host_bytes", "RAM"), ("nvme_bytes", "NVMe"))
            if p[key]
        ]
        parts.append(f"{name.replace('_', ' ')}: {', '.join(tiers) or '0 B'} ({p['why']})")
    budget = format_bytes(placement["pinned_budget_bytes"])
    return "placement: " + "; ".join(parts) + f"; pinned budget {budget}"
