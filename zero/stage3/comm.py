"""The two collectives of stage 3 over torch.distributed: gather a unit, reduce-scatter its gradient."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zero.comm import settle

__all__ = ["all_gather_flat", "dist_info", "reduce_scatter_flat"]


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
