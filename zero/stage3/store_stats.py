"""What a partition store counts (StoreStats) and knows of a unit before placing it (UnitSize)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["StoreStats", "UnitSize"]


class UnitSize(NamedTuple):
    """What placement needs to know about a unit before it exists."""

    name: str
    dtype: torch.dtype
    part_numel: int
    part_nbytes: int
    world_size: int  # the ranks its parameters are split over


@dataclass
class StoreStats:
    """The store's I/O counters (NVMe bytes read and written, reads, prefetches and prefetch hits; bytes
    read from partitions in host memory). Of the NVMe bytes read, `staged_bytes` were copied out of a staging
    slot, `in_place_bytes` were used where they landed (viewed by the parameters, `lend`, or decoded from the
    slot) and `direct_bytes` were read straight into their destination. `peak_inflight`: most prefetches
    in flight at once; `ahead_bytes` / `peak_ahead_bytes`: bytes of host partitions copied ahead to the
    read-ahead device, now and at most; `slots_replaced`: lent slots still referenced from outside when
    given back (see the module doc); `read_wait_s`: time the reading thread waited for the disk (the rest
    of a gather's time is copies, decoding and bookkeeping). Writes left in flight (zero.stage3.write_back):
    `async_writes` / `async_bytes_written` queued without waiting, `peak_writes_in_flight` most at once,
    `write_wait_s` time spent waiting for them, `write_retries` failed writes written again."""

    bytes_read: int = 0
    cpu_bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    staged_bytes: int = 0
    in_place_bytes: int = 0
    direct_bytes: int = 0
    peak_inflight: int = 0
    ahead_bytes: int = 0  # bytes of copies ahead on the read-ahead device, not taken yet
    peak_ahead_bytes: int = 0
    slots_replaced: int = 0
    read_wait_s: float = 0.0  # seconds a gather blocked on NVMe reads (a prefetch not done, a read on demand)
    async_writes: int = 0
    async_bytes_written: int = 0
    peak_writes_in_flight: int = 0
    write_wait_s: float = 0.0
    write_retries: int = 0
