"""Turning modules' parameters into units: which parameters, how big, persistent or not, placed in their tier.

One unit per module, of the parameters it registers itself (recurse=False) that no unit holds yet (a shared
parameter belongs to its first module). Meta-device parameters (a model built without memory, loaded shard
by shard later) are replaced by real, empty Parameters, the same replacement wherever one is shared; their
partitions start as zeros. Units smaller than stage3_param_persistence_threshold stay gathered once fetched
(persistent), up to stage3_model_persistence_threshold elements in all (DeepSpeed's two knobs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from offload.progress import progress
from zero.stage3.store import PartitionStore, UnitSize
from zero.stage3.unit import (
    Unit,
    UnitOwner,
    fill_partition,
    is_partitioned,
    param_shares,
    set_param_attributes,
    set_partition_tensors,
)

__all__ = ["UnitBuilder"]


class UnitBuilder:
    """Makes the units of `owner` (a Stage3Partitioner), appending them to `units` and placing each
    partition in `store`; released parameters point at `released(dtype)`."""

    def __init__(
        self,
        owner: UnitOwner,
        units: List[Unit],
        store: PartitionStore,
        *,
        device: torch.device,
        released: Callable[[torch.dtype], torch.Tensor],
        persistence_threshold: int,
        model_persistence_numel: int,
    ) -> None:
        """`persistence_threshold`, `model_persistence_numel`: the config's
        stage3_param_persistence_threshold and stage3_model_persistence_threshold."""
        self.owner = owner
        self.units = units
        self.store = store
        self.device = device
        self.released = released
        self.persistence_threshold = persistence_threshold
        self.model_persistence_numel = model_persistence_numel
        self.persistent_numel = 0
        self._meta_map: Dict[int, Any] = {}  # id(meta parameter) -> (it, its replacement)

    def params(
        self,
        name: str,
        params: Sequence[nn.Parameter],
        param_names: Sequence[str],
        shapes: Optional[Sequence[torch.Size]] = None,
    ) -> Unit:
        """Make `params` one unit: store this rank's share in its tier and empty their `.data`.
        With `shapes`, the parameters hold no values yet (built on the meta device): the partition is 0."""
        owner = self.owner
        index = len(self.units)
        unit = Unit(index, name, params, param_names, owner.world_size, owner.rank, self.device, shapes)
        unit.owner = owner
        unit.persistent = (
            unit.numel < self.persistence_threshold
            and self.persistent_numel + unit.numel <= self.model_persistence_numel
        )
        if unit.persistent:
            self.persistent_numel += unit.numel
        self.store.place(unit, None if shapes is not None else functools.partial(fill_partition, unit))
        set_param_attributes(unit, self.released(unit.dtype))
        store = self.store
        set_partition_tensors(unit, store.memory_partition(unit), "nvme" if store.on_nvme(unit) else None)
        for p in unit.params:
            p.ds_persist = unit.persistent
        self.units.append(unit)
        return unit

    def module(self, module: nn.Module, name: str) -> Optional[Unit]:
        """The unit of the parameters `module` registers itself that are not partitioned yet (None: none).

        Meta-device parameters are replaced by real (empty) Parameters on the compute device: a meta tensor
        cannot take real data. Modules sharing one meta parameter get the same replacement."""
        params, names, shapes, seen, meta = [], [], [], set(), False
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in self._meta_map:
                module._parameters[pname] = p = self._meta_map[id(p)][1]
            if id(p) in seen or is_partitioned(p):
                continue
            seen.add(id(p))
            shapes.append(p.shape)
            if p.is_meta:
                new = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device), p.requires_grad)
                self._meta_map[id(p)] = (p, new)  # keeps `p` alive so its id is never reused
                module._parameters[pname] = p = new
                meta = True
            params.append(p)
            names.append(f"{name}.{pname}" if name else pname)
        if not params:
            return None
        return self.params(name or type(module).__name__, params, names, shapes if meta else None)

    def model(self, model: nn.Module) -> List[Unit]:
        """One unit per module of `model` with parameters not partitioned yet; the memory tier gets one
        segment for all of them (back to back), the NVMe tier its staging slots."""
        pending = []
        for name, m in model.named_modules(remove_duplicate=True):
            own = [p for p in m._parameters.values() if p is not None and not is_partitioned(p)]
            if own:
                pending.append((name, m))
        sizes = [self._planned_size(name, m) for name, m in pending]
        self.store.reserve(sizes)
        # real weights bound for swap files (not meta ones, as zero.from_pretrained's): a bar of the bytes
        on_disk = self.store.tier == "nvme" and any(
            not p.is_meta for _, m in pending for p in m.parameters(False)
        )
        new = []
        with progress(
            "zero: writing parameters to NVMe",
            sum(s.part_nbytes for s in sizes),
            rank=self.owner.rank,
            quiet=not on_disk,
        ) as bar:
            for (name, m), size in zip(pending, sizes):
                u = self.module(m, name)
                if u is not None:
                    new.append(u)
                bar.update(size.part_nbytes)
        self.store.ensure_slots()
        return new

    def _planned_size(self, name: str, module: nn.Module) -> UnitSize:
        params = {id(p): p for p in module._parameters.values() if p is not None and not is_partitioned(p)}
        first = next(iter(params.values()))
        world = self.owner.world_size
        _, _, part = param_shares([p.numel() for p in params.values()], world, self.owner.rank)
        return UnitSize(name or type(module).__name__, first.dtype, part, part * first.element_size(), world)
