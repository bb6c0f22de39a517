"""ReadAhead: copies of host-memory partitions made on the compute device ahead of their use.

While reads ahead are on (the store's `read_ahead_device`, set by the partitioner for an inference forward
on an accelerator), `start` copies a partition in host memory to the device on the side stream
(zero.stage3.device_copy) while the layers before it compute; `take` hands the copy over, counted as a
read; `drop` discards one not taken (after waiting for the copy, which reads the host partition).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from zero.stage3.device_copy import SideStream
from zero.stage3.store_stats import StoreStats
from zero.stage3.unit import PartitionStatus, Unit, set_status

__all__ = ["ReadAhead"]


class ReadAhead:
    """The copies ahead of one store, by unit index."""

    def __init__(
        self,
        copies: SideStream,
        stats: StoreStats,
        lock: threading.RLock,
        over: Callable[[Unit], None],
    ) -> None:
        """`lock`: the store's slot lock (its bookkeeping is shared); `over(unit)`: the unit's prefetch
        was used or dropped."""
        self._copies = copies
        self._stats = stats
        self._lock = lock
        self._over = over
        self._held: Dict[int, Tuple[torch.Tensor, Any]] = {}  # index -> (copy on the device, its event)

    def __contains__(self, index: object) -> bool:
        return index in self._held

    def __len__(self) -> int:
        return len(self._held)

    def on_cpu(self, unit: Unit) -> bool:
        """Whether the unit's copy ahead is in host memory (reads ahead to the CPU)."""
        held = self._held.get(unit.index)
        return held is not None and held[0].device.type == "cpu"

    def start(self, unit: Unit, src: torch.Tensor, device: torch.device, inflight: int) -> bool:
        """Copy `src` (the unit's host partition: values or codes) to `device`; False if one is held or
        the device has no room. `inflight`: NVMe prefetches in flight (for the peak count)."""
        if unit.index in self._held:
            return False
        try:
            copied = self._copies.copy_ahead(src, device)
        except torch.OutOfMemoryError:
            return False  # no room ahead on the device: the unit is copied when it is gathered
        with self._lock:
            self._held[unit.index] = copied
            st = self._stats
            st.peak_inflight = max(st.peak_inflight, inflight + len(self._held))
            st.ahead_bytes += src.numel() * src.element_size()
            st.peak_ahead_bytes = max(st.peak_ahead_bytes, st.ahead_bytes)
        self._stats.prefetches += 1
        if unit.full is None:
            set_status(unit, PartitionStatus.INFLIGHT)
        return True

    def take(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's copy ahead, ready for the compute stream and counted as a read; None if none."""
        with self._lock:
            held = self._held.pop(unit.index, None)
            if held is not None:
                self._stats.ahead_bytes -= held[0].numel() * held[0].element_size()
        if held is None:
            return None
        self._over(unit)
        t = self._copies.take(*held)
        self._stats.cpu_bytes_read += t.numel() * t.element_size()
        self._stats.prefetch_hits += 1
        return t

    def drop(self, unit: Unit) -> None:
        """Discard the unit's copy ahead, if any (once the copy has ended)."""
        with self._lock:
            held = self._held.pop(unit.index, None)
            if held is not None:
                self._stats.ahead_bytes -= held[0].numel() * held[0].element_size()
        if held is not None:
            self._copies.wait(held[1])  # the copy reads the host partition: let it end first
            self._over(unit)

    def held(self) -> List[int]:
        """Indices of the units with a copy ahead."""
        return list(self._held)
