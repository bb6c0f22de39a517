"""Swapping tensors between pinned host memory and files on NVMe: the swap space and the swappers."""

from offload.swap.optimizer_swapper import (
    AioSettings,
    DeferredWriteError,
    OptimizerSwapper,
    SwapStats,
    slot_bytes,
)
from offload.swap.space import SwapFile, SwapSpace, SwapSpaceError, align_up, check_nvme_path

__all__ = [
    "AioSettings",
    "DeferredWriteError",
    "OptimizerSwapper",
    "SwapFile",
    "SwapSpace",
    "SwapSpaceError",
    "SwapStats",
    "align_up",
    "check_nvme_path",
    "slot_bytes",
]
