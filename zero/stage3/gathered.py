"""GatheredParameters: DeepSpeed's `zero.GatheredParameters` - stage-3 parameters made whole in a block.

Inside the block each listed parameter's unit is gathered (by the partitioner that owns it, `unit.owner`);
with `modifier_rank` set, the values that rank holds on exit are broadcast and written back to every rank's
partition (how weights are initialised or loaded into a partitioned model).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from zero.comm import settle
from zero.stage3.hooks import register_external_parameter
from zero.stage3.unit import Unit, is_partitioned

__all__ = ["GatheredParameters"]


class GatheredParameters:
    """Make `params` whole inside the block. With `modifier_rank` set, the values that rank holds on exit
    (modified in place or assigned to `.data`) are broadcast and written back to every rank's partition.

    DeepSpeed's signature and meaning: `params` is one parameter or an iterable of them (a generator is
    fine); those not partitioned by stage 3 are ignored, and a block with none of them does nothing.
    `modifier_rank` is a rank of the parameters' process group (the data-parallel group). `fwd_module`:
    the parameters are registered as external parameters of that module (`register_external_parameter`),
    so its forward and backward gather them too. `enabled=False`: the block does nothing."""

    def __init__(
        self,
        params: Union[nn.Parameter, Iterable[nn.Parameter]],
        modifier_rank: Optional[int] = None,
        fwd_module: Optional[nn.Module] = None,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.params: List[nn.Parameter] = []
        self.units: List[Unit] = []
        self._was_partitioned: List[bool] = []
        self._snapshots: List[Optional[torch.Tensor]] = []
        if not enabled:
            return
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            params = [params]  # type: ignore[list-item]
        self.params = [p for p in params if is_partitioned(p)]
        units = {id(p.ds_unit): p.ds_unit for p in self.params}
        # the same order on every rank, whatever order (or duplicates) the caller's iterable has
        self.units = sorted(units.values(), key=lambda u: u.params[0].ds_id)
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self) -> GatheredParameters:
        if self.enabled:
            self._was_partitioned = [u.full is None for u in self.units]
            for u in self.units:
                u.owner.fetch(u)
            self._snapshots = self._take_snapshots()
        return self

    def _take_snapshots(self) -> List[Optional[torch.Tensor]]:
        """With zero_optimization.enable_sanity_checks and no modifier_rank: a copy of each unit's whole
        values (None where the unit's partitioner does not check), compared on exit."""
        if self.modifier_rank is not None:
            return []
        return [
            u.full.clone() if u.owner.config.zero_optimization.enable_sanity_checks else None
            for u in self.units
        ]

    def _changed_params(self) -> List[str]:
        """Names of the parameters whose values differ from the snapshot (bit for bit) or whose `.data` was
        replaced; on every rank the union of all ranks' findings is acted on."""
        names: List[str] = []
        for u, snap in zip(self.units, self._snapshots):
            if snap is None or u.full is None:
                continue
            for i, p in enumerate(u.params):
                a, z = u.param_range(i)
                view = u.full[a:z]
                same = p.data.data_ptr() == view.data_ptr() and torch.equal(
                    view.view(torch.uint8), snap[a:z].view(torch.uint8)
                )
                if not same:
                    names.append(u.param_names[i])
        return names

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if not self.enabled:
            return
        changed: List[str] = []
        changed_anywhere = False
        try:
            if self.modifier_rank is not None and exc_type is None:
                for u in self.units:
                    self._write_back(u)
            elif exc_type is None and any(s is not None for s in self._snapshots):
                changed = self._changed_params()
                changed_anywhere = self._any_rank(bool(changed))
                if changed_anywhere:
                    self._restore()
        finally:
            for u in self.units:
                u.owner.release(u)
            for u, was_partitioned, snap in zip(
                self.units, self._was_partitioned, self._snapshots or [None] * len(self.units)
            ):
                # leave it as the block found it; a changed checked unit is dropped, so changes made to a
                # whole (persistent) copy are discarded too: its next use gathers the partitions again
                if (was_partitioned and u.persistent) or (snap is not None and changed_anywhere):
                    u.owner.repartition(u)
            self._snapshots = []
        if changed_anywhere:
            what = (
                ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
                if changed
                else "on another rank"
            )
            raise RuntimeError(
                "GatheredParameters: parameters were modified inside a block with modifier_rank=None "
                f"({what}); the changes are discarded. Pass modifier_rank=<rank> to keep and broadcast them "
                "(zero_optimization.enable_sanity_checks reports this)"
            )

    def _restore(self) -> None:
        """Put the values the block started with back (the whole copy may be the partition itself, one
        rank on the partitions' device), and each parameter's `.data` back onto its place in it."""
        with torch.no_grad():
            for u, snap in zip(self.units, self._snapshots):
                if snap is None or u.full is None:
                    continue
                u.full.copy_(snap)
                for i, p in enumerate(u.params):
                    a, z = u.param_range(i)
                    if p.data.data_ptr() != u.full[a:z].data_ptr():
                        p.data = u.full[a:z].view(u.shapes[i])

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank of the units' group (DeepSpeed: every rank raises alike)."""
        owner = self.units[0].owner
        if owner.world_size <= 1:
            return flag
        t = torch.tensor([int(flag)], device=owner.device)
        settle(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=owner.group, async_op=True))
        return bool(t.item())

    def _write_back(self, u: Unit) -> None:
        owner = u.owner  # the Stage3Partitioner that holds the unit
        full = u.full
        assert owner is not None and full is not None
        with torch.no_grad():
            for i, p in enumerate(u.params):
                a, z = u.param_range(i)
                view = full[a:z]
                if p.data.data_ptr() != view.data_ptr():  # `.data` was replaced: take the new values
                    if p.data.numel() != z - a:
                        raise ValueError(
                            f"GatheredParameters: {u.param_names[i]} was given {p.data.numel()} elements, "
                            f"its shape {tuple(u.shapes[i])} needs {z - a}"
                        )
                    view.copy_(p.data.reshape(-1))
                    p.data = view.view(u.shapes[i])
            if owner.world_size > 1:
                src = self.modifier_rank  # a rank of the unit's group; broadcast takes a global rank
                if owner.group is not None:
                    src = dist.get_global_rank(owner.group, src)
                settle(dist.broadcast(full, src=src, group=owner.group, async_op=True))
            own = u.partition_of(full)
            owner.write_partition(
                u, own.clone() if owner.partition_as_full(u) is None and u.rank_major else own
            )
