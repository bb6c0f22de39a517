"""StagingSlot: one pinned buffer an NVMe partition is read into, with its own aio handle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from offload.pinned import PinnedMemoryBudgetError, PinnedPool

__all__ = ["StagingSlot", "allocate_slots", "storage_uses"]


@dataclass
class StagingSlot:
    """A pinned uint8 `buf`, the aio `handle` reading into it, and what holds it (a prefetch, a loan)."""

    buf: torch.Tensor  # uint8, pinned
    handle: Any
    unit: Optional[int] = None  # unit index of a prefetch in flight, None when free
    event: Any = None  # CUDA event of the last copy out of this slot
    lent: Optional[int] = None  # unit index whose gathered tensor is a view of this slot (`lend`)
    lead: int = 0  # where in `buf` the bytes of the last read start (PartitionSource.lead)

    def data(self, nbytes: int) -> torch.Tensor:
        """The `nbytes` bytes of the last read (from `lead` on)."""
        return self.buf[self.lead : self.lead + nbytes]

    def land(self, source: Any, offset: int, nbytes: int) -> torch.Tensor:
        """Where a read of `nbytes` from `offset` of `source` (a PartitionSource) goes: at the source's lead,
        so that the read goes straight to the device, when the buffer has room for it, else at 0."""
        lead = source.lead(offset)
        self.lead = lead if lead + nbytes <= self.buf.numel() else 0
        return self.data(nbytes)


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share `t`'s memory; -1 where torch cannot say."""
    uses = getattr(torch._C, "_storage_Use_Count", None)
    return int(uses(t.untyped_storage()._cdata)) if uses is not None else -1


def allocate_slots(
    pool: PinnedPool, count: int, nbytes: int, pads: Sequence[int], handle: Callable[[], Any]
) -> Tuple[List[StagingSlot], int]:
    """`count` slots of `nbytes` plus the first of `pads` the pool has room for (each a new aio `handle()`),
    and the bytes of each buffer. A try that does not fit is given back whole before the next; when the
    last does not fit either, its PinnedMemoryBudgetError is raised with nothing held."""
    for i, pad in enumerate(pads):
        slots: List[StagingSlot] = []
        try:
            for _ in range(count):
                slots.append(StagingSlot(pool.allocate(nbytes + pad, torch.uint8), handle()))
            return slots, nbytes + pad
        except PinnedMemoryBudgetError:
            for s in slots:
                s.handle.close()
                pool.free(s.buf)
            if i == len(pads) - 1:
                raise
    raise ValueError("allocate_slots needs at least one pad")
