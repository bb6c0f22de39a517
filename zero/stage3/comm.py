"""The two collectives of stage 3 over torch.distributed: gather a unit, reduce-scatter its gradient.

The collectives move the ranks' partitions back to back (rank-major); a unit's flat buffer holds its
parameters back to back, so a unit of several parameters on several ranks is reordered on the way
(`Unit.unpack` after a gather, `Unit.pack` before a reduce-scatter: one copy each)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zero.comm import settle
from zero.stage3.unit import Unit

__all__ = ["all_gather_flat", "all_gather_unit", "dist_info", "reduce_scatter_flat", "reduce_scatter_unit"]


def dist_info(group: Optional[dist.ProcessGroup] = None) -> tuple:
    """(rank, world_size) of `group`, or (0, 1) when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def all_gather_flat(full: torch.Tensor, own: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Fill `full` (world_size * own.numel() elements) with every rank's `own`, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    settle(gather(full, own, group=group, async_op=True))


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """`out` = this rank's share of the sum of `full` over all ranks (unscaled, like the stage 1-2 path)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    settle(scatter(out, full, group=group, async_op=True))


def all_gather_unit(
    unit: Unit, full: torch.Tensor, own: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> None:
    """Fill the unit's flat buffer `full` (`padded_numel` elements) from every rank's partition `own`."""
    if unit.rank_major:
        all_gather_flat(full, own, group)
        return
    gathered = torch.empty(unit.padded_numel, dtype=full.dtype, device=full.device)
    all_gather_flat(gathered, own, group)
    unit.unpack(gathered, full)


def reduce_scatter_unit(
    unit: Unit, out: torch.Tensor, flat: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> None:
    """`out` = this rank's partition of the sum over all ranks of the unit's flat buffer `flat` (a
    gradient: `padded_numel` elements, the parameters back to back)."""
    if not unit.rank_major:
        packed = torch.empty(unit.padded_numel, dtype=flat.dtype, device=flat.device)
        unit.pack(flat, packed)
        flat = packed
    reduce_scatter_flat(out, flat, group)
