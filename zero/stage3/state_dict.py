"""Whole-model state dicts of a stage-3 model: gathered unit by unit, or loaded shard by shard.

`part` is the Stage3Partitioner that holds the model's units; neither function ever holds more than one
unit whole (plus what the result itself holds).
"""

from __future__ import annotations

from typing import Any, Dict, List, Union

import torch
from torch import nn

from zero.stage3.gathered import GatheredParameters
from zero.stage3.unit import UnitOwner

__all__ = ["gathered_state_dict", "load_shard"]


def gathered_state_dict(
    part: UnitOwner, model: nn.Module, device: Union[str, torch.device] = "cpu", keep: bool = True
) -> Dict[str, Any]:
    """`model.state_dict()` with whole parameters (copied to `device`), gathering one unit at a time.
    Collective for world_size > 1: every rank must call it. `keep=False`: this rank only takes part in
    the gathers and returns {} (one rank collects the result, the others copy nothing)."""
    out: Dict[str, Any] = {}
    by_unit: Dict[int, List[tuple]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        u = getattr(p, "ds_unit", None)
        if u is not None and u.owner is part:
            by_unit.setdefault(u.index, []).append((name, p))
        elif keep:
            out[name] = p.detach().to(device).clone()
    for index in sorted(by_unit):  # the same order on every rank
        with GatheredParameters([p for _, p in by_unit[index]]):
            for name, p in by_unit[index] if keep else ():
                out[name] = p.detach().to(device).clone()
    if not keep:
        return out
    for name, b in model.named_buffers():
        out[name] = b.detach().to(device).clone()
    return {k: out[k] for k in model.state_dict(keep_vars=True) if k in out}


def load_shard(part: UnitOwner, shard: Dict[str, torch.Tensor]) -> List[str]:
    """Write full tensors of some parameters (by qualified name) into their partitions; returns the
    names used. For a model built on the meta device and loaded file by file: only one unit is ever
    materialized at a time (read-modify-write of its partition)."""
    by_name = {n: (u, i) for u in part.units for i, n in enumerate(u.param_names)}
    touched: Dict[int, List[tuple]] = {}
    for name, value in shard.items():
        if name not in by_name:
            continue
        u, i = by_name[name]
        if tuple(value.shape) != tuple(u.shapes[i]):
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} does not match the parameter's {tuple(u.shapes[i])}"
            )
        touched.setdefault(u.index, []).append((i, value))
    for index, items in touched.items():
        u = part.units[index]
        values = part.read_partition(u, torch.empty(u.part_numel, dtype=u.dtype))
        for i, value in items:
            lo, hi = u.share(i)
            at = u.part_offsets[i]
            values[at : at + hi - lo].copy_(value.reshape(-1)[lo:hi])
        part.write_partition(u, values)
    return [n for n in shard if n in by_name]
