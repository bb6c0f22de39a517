"""Parameter writers: where the optimizer's updated weights go, chunk by chunk, as a pass runs.

The fused kernel updates the fp32 master of a chunk and can write the new model-dtype weights in the same
pass (`param_copy`: where it should put them, or None). `after_update` then moves them to the parameters;
`finish` ends a pass (and makes compute wait for in-flight copies); `close` frees the buffers.

* `FlatParamWriter` (stages 0-2): the parameters are views of one flat buffer, written by slice.
* `UnitParamWriter` (stage 3): the parameters are per-unit partitions on a tier (device, host or NVMe);
  the chunk is scattered to the units it overlaps.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import torch

from offload.pinned import PinnedPool
from zero.layout.partition import FlatParams

__all__ = ["FlatParamWriter", "ParamWriter", "UnitMap", "UnitParamWriter"]


class ParamWriter(Protocol):
    """What the optimizer pass needs from a writer."""

    h2d_bytes: int

    def param_copy(self, start: int, n: int) -> Optional[torch.Tensor]:
        """Where the kernel writes this chunk's 16-bit weights; None when it writes none."""

    def after_update(self, start: int, n: int, master: torch.Tensor) -> None:
        """Chunk [start, start + n) of the master was updated: bring it into the parameters."""

    def finish(self) -> None:
        """The pass ended: complete or drop what is still being written."""

    def settle(self) -> None:
        """Wait for the parameter writes a pass left in flight; raise a failure that is held."""

    def close(self) -> None:
        """Wait for pending copies and free the staging buffers."""


class UnitMap(Protocol):
    """The stage-3 optimizer partition: trainable units back to back (zero.layout.units.UnitLayout)."""

    partitioner: Any
    offsets: Dict[int, int]

    def units_in(self, start: int, n: int) -> Iterator[Tuple[Any, int, int]]:
        """(unit, start, n) of each unit that overlaps [start, start + n) of the partition."""

    def trainable_ranges(self, unit: Any) -> List[Tuple[int, int]]:
        """[start, end) of the trainable elements in `unit`'s partition."""

    def is_mixed(self, unit: Any) -> bool:
        """Whether `unit` holds both trainable and frozen parameters."""


class FlatParamWriter:
    """Moves updated master values of a chunk into the model's flat parameter buffer.

    CPU device: the kernel writes 16-bit weights straight into the parameter buffer (param_copy), fp32 is a
    plain copy, and when the master *is* the parameter buffer there is nothing to do. CUDA: the kernel
    writes into a pinned staging slot, copied asynchronously on a side stream; a slot is reused only after
    its copy finished (an event per slot).
    """

    def __init__(
        self, flat: FlatParams, lo: int, aliased: bool, chunk_numel: int, pool: Optional[PinnedPool]
    ):
        self.target = flat.param_buffer
        self.lo = lo
        self.aliased = aliased
        self.half = self.target.dtype != torch.float32
        self.cuda = self.target.is_cuda
        self.h2d_bytes = 0
        self._slot = 0
        self._staging: List[torch.Tensor] = []
        if self.cuda and not aliased:
            n_slots = 2
            for _ in range(n_slots):
                if pool is not None:
                    self._staging.append(pool.allocate(chunk_numel, self.target.dtype))
                else:
                    self._staging.append(torch.empty(chunk_numel, dtype=self.target.dtype).pin_memory())
            self._events = [torch.cuda.Event() for _ in range(n_slots)]
            self._stream = torch.cuda.Stream(device=self.target.device)
        self._pool = pool

    def param_copy(self, start: int, n: int) -> Optional[torch.Tensor]:
        """Where the kernel should write 16-bit weights for this chunk (None: it writes none)."""
        if self.aliased:
            return None
        if self.cuda:
            self._slot = (self._slot + 1) % len(self._staging)
            self._events[self._slot].synchronize()
            return self._staging[self._slot][:n] if self.half else None
        return self.target[self.lo + start : self.lo + start + n] if self.half else None

    def after_update(self, start: int, n: int, master: torch.Tensor) -> None:
        """Copy the updated chunk into the flat parameters (nothing when they alias the master; async on
        CUDA)."""
        if self.aliased:
            return
        dst = self.target[self.lo + start : self.lo + start + n]
        self.h2d_bytes += n * dst.element_size()
        if not self.cuda:
            if not self.half:
                dst.copy_(master)
            return
        src = self._staging[self._slot][:n]
        if not self.half:
            src.copy_(master)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            self._events[self._slot].record(self._stream)

    def finish(self) -> None:
        """Make the compute stream wait for the parameter copies of this step."""
        if self.cuda and not self.aliased:
            torch.cuda.current_stream(self.target.device).wait_stream(self._stream)

    def settle(self) -> None:
        """Nothing is left in flight past `finish`."""

    def close(self) -> None:
        """Wait for the CUDA copies and free the pinned staging buffers."""
        if self.cuda and not self.aliased:
            self._stream.synchronize()
        if self._pool is not None:
            for t in self._staging:
                self._pool.free(t)
        self._staging = []


class UnitParamWriter:
    """Moves updated weights of an optimizer chunk into the units' parameter partitions.

    A memory-tier unit is written in place as its pieces arrive; an NVMe unit is assembled in a host buffer
    and written to its swap file once all its elements arrived, whatever the order of the chunks (forward
    order after backward, reverse order when sub-groups are stepped during backward): a unit spans at most
    the chunks in flight, so few buffers are ever held. The write is left in flight, the buffer handed
    over to it (zero.stage3.write_back): the pass goes on with the next chunks while up to `queue_depth`
    writes run, and the next read of the unit waits for its write. Gathered copies (persistent units) are
    refreshed by `write_partition`.
    """

    def __init__(self, units: UnitMap, dtype: torch.dtype, chunk_numel: int) -> None:
        self.units = units
        self.part = units.partitioner
        self.half = dtype != torch.float32
        self.staging = torch.empty(chunk_numel, dtype=dtype) if self.half else None
        self.h2d_bytes = 0  # bytes of updated weights written to the parameter tier
        self._assembly: Dict[int, torch.Tensor] = {}
        self._missing: Dict[int, int] = {}  # unit index -> elements not yet assembled

    def param_copy(self, start: int, n: int) -> Optional[torch.Tensor]:
        """Where the kernel writes this chunk's 16-bit weights (None for fp32: the master is the weight)."""
        return self.staging[:n] if self.staging is not None else None

    def after_update(self, start: int, n: int, master: torch.Tensor) -> None:
        """Scatter the updated chunk (its 16-bit copy, or the master for fp32) to the units it overlaps."""
        src = self.staging[:n] if self.staging is not None else master
        self.scatter(start, n, src)

    def scatter(self, start: int, n: int, src: torch.Tensor) -> None:
        """Write `src` (elements [start, start + n) of the virtual partition, model dtype) to the units."""
        units = self.units
        for unit, a, z in units.units_in(start, n):
            base = units.offsets[unit.index] - start
            mem = self.part.memory_partition(unit)
            buf = mem if mem is not None else self._buffer(unit)
            for lo, hi in units.trainable_ranges(unit):
                lo, hi = max(lo, a), min(hi, z)
                if lo < hi:
                    buf[lo:hi].copy_(src[base + lo : base + hi])
            self.h2d_bytes += (z - a) * unit.element_size
            missing = self._missing.get(unit.index, unit.part_numel) - (z - a)
            if missing > 0:
                self._missing[unit.index] = missing
                continue
            self._missing.pop(unit.index, None)
            if mem is None:  # the assembled buffer is the write's own until it ended
                self.part.write_partition(unit, self._assembly.pop(unit.index), asynchronous=True)
            elif unit.full is not None:
                self.part.write_partition(unit, mem)  # refresh the gathered copy of a persistent unit

    def _buffer(self, unit: Any) -> torch.Tensor:
        buf = self._assembly.get(unit.index)
        if buf is None:
            if self.units.is_mixed(unit):  # frozen slices keep their stored values
                # not through the staging slots: this may run on the optimizer thread during backward
                buf = torch.empty(unit.part_numel, dtype=unit.dtype)
                self.part.read_partition_private(unit, buf)
            else:
                buf = torch.empty(unit.part_numel, dtype=unit.dtype)
            self._assembly[unit.index] = buf
        return buf

    def finish(self) -> None:
        # a pass stopped early (overflow, error): the caller restores from the master
        """Drop partly assembled units of a pass stopped early (the caller restores from the master)."""
        self._assembly.clear()
        self._missing.clear()

    def settle(self) -> None:
        """Wait for the partition writes left in flight (DeferredWriteError while one keeps failing)."""
        self.part.settle_writes()

    def close(self) -> None:
        """Drop partial units and the staging buffer."""
        self.finish()
        self.staging = None
