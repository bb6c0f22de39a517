"""Swapping tensors between pinned host memory and files on NVMe: the swap space and the swappers.

The swappers (and torch with them) are imported on first use, so the swap-space API (`SwapSpace`,
`reclaim_stale`) stays light for tools that only manage swap directories.
"""

import importlib
from typing import TYPE_CHECKING, Any

from offload.swap.slots import MIN_SLOT_NUMEL, plan_slot_numel, slot_bytes, swap_chunk
from offload.swap.space import (
    ReclaimedSpace,
    SwapFile,
    SwapSpace,
    SwapSpaceError,
    align_up,
    check_nvme_path,
    reclaim_stale,
)

if TYPE_CHECKING:
    from offload.swap.optimizer_swapper import (
        DeferredWriteError,
        OptimizerSwapper,
        SwapStats,
    )

_SWAPPER_NAMES = ("DeferredWriteError", "OptimizerSwapper", "SwapStats")

__all__ = [
    "MIN_SLOT_NUMEL",
    "DeferredWriteError",
    "OptimizerSwapper",
    "ReclaimedSpace",
    "SwapFile",
    "SwapSpace",
    "SwapSpaceError",
    "SwapStats",
    "align_up",
    "check_nvme_path",
    "plan_slot_numel",
    "reclaim_stale",
    "slot_bytes",
    "swap_chunk",
]


def __getattr__(name: str) -> Any:
    if name in _SWAPPER_NAMES or name == "optimizer_swapper":
        optimizer_swapper = importlib.import_module("offload.swap.optimizer_swapper")
        return optimizer_swapper if name == "optimizer_swapper" else getattr(optimizer_swapper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
