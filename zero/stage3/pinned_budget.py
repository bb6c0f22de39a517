"""Stage3PinnedBudgetError: the pinned budget cannot hold what stage 3 needs, with the message naming why."""

from __future__ import annotations

from typing import Any, Sequence

from offload.pinned import PinnedMemoryBudgetError

__all__ = ["Stage3PinnedBudgetError", "partitions_budget_error", "staging_budget_error"]


class Stage3PinnedBudgetError(PinnedMemoryBudgetError):
    """The pinned budget cannot hold what stage 3 needs for a layer; names the layer, its size, the budget."""

    def __init__(self, message: str, requested: int, in_use: int, cap: int) -> None:
        MemoryError.__init__(self, message)
        self.requested, self.in_use, self.cap = requested, in_use, cap


def partitions_budget_error(
    e: PinnedMemoryBudgetError, units: Sequence[Any], numel: int
) -> Stage3PinnedBudgetError:
    """The error for `numel` elements of host-memory partitions of `units` (name, part_numel,
    part_nbytes) that `e` refused."""
    big = max(units, key=lambda u: u.part_nbytes)
    return Stage3PinnedBudgetError(
        f"pinned memory budget of {e.cap} bytes ({e.cap - e.in_use} free) is too small for the "
        f"stage-3 parameter partitions in host memory: {numel} elements ({e.requested} bytes) requested for "
        f"{len(units)} layer(s), the largest {big.name!r} with a partition of {big.part_numel} "
        f"elements ({big.part_nbytes} bytes); raise the pinned budget, set offload_param.pin_memory="
        "false, or offload to nvme",
        e.requested,
        e.in_use,
        e.cap,
    )


def staging_budget_error(
    e: PinnedMemoryBudgetError, big: Any, stored: int, count: int, slot_bytes: int, size: int
) -> Stage3PinnedBudgetError:
    """The error for NVMe staging buffers (`count` of `slot_bytes`, buffer_size `size`) that `e` refused,
    sized for the largest layer `big` (`stored` bytes on its tier)."""
    return Stage3PinnedBudgetError(
        f"pinned memory budget of {e.cap} bytes ({e.cap - e.in_use} free) is too small for the "
        f"stage-3 NVMe staging buffers: the largest layer {big.name!r} has a partition of "
        f"{big.part_numel} elements ({stored} bytes) and offload_param asks for "
        f"buffer_count={count} buffers of {slot_bytes} bytes "
        f"(buffer_size={size} elements); raise the pinned budget or lower "
        "offload_param.buffer_size / buffer_count",
        e.requested,
        e.in_use,
        e.cap,
    )
