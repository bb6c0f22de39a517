"""Which partitioner trains a model, when `zero.Init` built its parts with several.

`zero.Init` gives each model built by a statement of its own (`actor = Model()`, then `ref = Model()`) a
partitioner of its own (zero/stage3/init.py), so that each can be wrapped by an engine of its own, with its
own store and swap space. A model composed afterwards of modules built by separate statements under the
same Init (`nn.Sequential(a, b)`) has parameters in several of that Init's partitioners; before one of them
is attached to it, the others' units are moved into it: each unit is gathered, and partitioned again by the
target (one unit whole at a time). A partitioner left with no unit is closed (its memory and swap files
freed). Units of partitioners of different Inits, or of one already attached to a model, are never moved.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from zero.stage3.unit import Unit

__all__ = ["choose_owner", "move_foreign_units"]


def _model_units(model: nn.Module) -> List[Unit]:
    """The units holding `model`'s parameters, each once, in module order."""
    out: List[Unit] = []
    seen = set()
    for p in model.parameters():
        u = getattr(p, "ds_unit", None)
        if u is not None and id(u) not in seen:
            seen.add(id(u))
            out.append(u)
    return out


def choose_owner(model: nn.Module) -> Any:
    """The partitioner that should train `model`, among those holding its parameters (None: none does).

    One owner: it. Several: they must be partitioners of one `zero.Init`, none attached to a model yet; the
    one holding most of the model's elements is chosen (the others' units move to it when it is attached).
    """
    owners: Dict[int, Any] = {}
    numel: Dict[int, int] = {}
    for u in _model_units(model):
        owners[id(u.owner)] = u.owner
        numel[id(u.owner)] = numel.get(id(u.owner), 0) + u.numel
    if not owners:
        return None
    if len(owners) == 1:
        return next(iter(owners.values()))
    families = {id(p.family) for p in owners.values()}
    if len(families) != 1 or next(iter(owners.values())).family is None:
        raise ValueError(
            f"the model's parameters were partitioned by {len(owners)} different partitioners (nested "
            "zero.Init blocks with different configs?); build it under one Init"
        )
    attached = [p for p in owners.values() if p.hooks is not None]
    if attached:
        raise ValueError(
            "part of the model is already trained by another engine (its parameters' partitioner is "
            "attached to another model); a parameter can belong to one engine's model only"
        )
    return owners[max(numel, key=lambda k: numel[k])]


def move_foreign_units(target: Any, model: nn.Module) -> int:
    """Move the units of `model` that other partitioners of `target`'s Init hold into `target`; returns how
    many moved. ValueError, before anything moved, when one belongs to another Init's partitioner or to one
    attached to a model."""
    foreign = [u for u in _model_units(model) if u.owner is not target]
    for u in foreign:
        src = u.owner
        if target.family is None or src.family is not target.family:
            raise ValueError(
                f"parameter {u.param_names[0]!r} was partitioned by another zero.Init's partitioner; build "
                "the whole model under one Init"
            )
        if src.hooks is not None:
            raise ValueError(
                f"parameter {u.param_names[0]!r} is already trained by another engine (its partitioner is "
                "attached to another model); a parameter can belong to one engine's model only"
            )
    sources: Dict[int, Any] = {}
    for u in foreign:
        sources[id(u.owner)] = u.owner
        _move(u, target)
    for src in sources.values():
        if all(not u.params for u in src.units):
            src.close()  # nothing left in it: its memory and swap files go now
    return len(foreign)


def _move(unit: Unit, target: Any) -> None:
    """Gather `unit` from its partitioner, partition its parameters again in `target`, and leave the old
    unit empty (no parameters) so that its partitioner never touches them again."""
    src = unit.owner
    params, names = list(unit.params), list(unit.param_names)
    with torch.no_grad():
        src.fetch(unit)
        try:
            values = [p.data.detach().clone() for p in params]
        finally:
            src.release(unit)
            src.repartition(unit)  # freed even when persistent
    for p, v in zip(params, values):
        p.data = v
    unit.params, unit.param_names, unit.trainable = [], [], []
    unit.shapes, unit.numels, unit.offsets = [], [], []
    target.partition_params(unit.name, params, names)
