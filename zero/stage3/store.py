"""Where each unit's partition lives between uses: device memory, host memory (pinned) or an NVMe swap file.

Memory tiers ("none": the compute device, "cpu": host memory, pinned from the PinnedPool when
`pin_memory`) pack partitions back to back into a few large segments, so the optimizer sees flat buffers and
no partition costs an allocation of its own. The NVMe tier keeps one swap file per unit, named after the
module that owns it, and moves it through `buffer_count` pinned staging slots of at most `buffer_size`
elements: a partition that fits a slot is read with one request; a larger one is prefetched in pieces into
as many free slots as it needs and copied out of them, or, read on demand, streamed through a slot chunk by
chunk (on a CPU destination: read straight into it). Each slot has its own aio handle, so waiting for one
prefetch never waits for the others. With `max_in_cpu`, partitions of up to that many elements in all stay
in host memory, spread along the module order (offload.swap.resident) so that a forward's reads overlap
their compute.

Lending (`lend` / `give_back`): when the compute device is the CPU, a partition that lands in a slot can be
used where it lies instead of being copied out: `lend` returns a view of the slot and keeps the slot out of
use until `give_back`. A slot is refilled only when nothing but the store references its memory any more;
one still viewed from outside when it is given back is replaced by a new buffer (`StoreStats.slots_replaced`).

With weight quantization (`set_quantization`, zero.stage3.quant), the units it selects are stored encoded
(`PartitionCodec`: int8/int4 codes and float16 constants, the rest raw) on whatever tier they live: their
memory slot, swap file and reads are `stored_nbytes` long, and `read` decodes after the transfer, on the
destination's device. `memory_partition` is None for them: their bytes are not values.

Read ahead to an accelerator (`read_ahead_device`, set by the partitioner for an inference forward on
one): `prefetch` of a partition in host memory copies it to the device on a side stream
(zero.stage3.device_copy) while the layers before it compute; `take_ahead` hands the copy over as the
gathered buffer (`read` decodes a quantized unit's codes from it). A write drops the copy, and so does
a pass that does not read ahead (`drop_read_ahead`): the optimizer updates memory partitions in place.

The module is longer than most (about 840 lines): reads, prefetches, loans and writes share one piece of
bookkeeping - which slot holds what, under one lock taken by the main thread and the optimizer's writer
thread - and splitting it would spread that invariant over modules.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from offload.config.aio import AioConfig
from offload.config.zero import OffloadParamConfig
from offload.pinned import PinnedMemoryBudgetError, PinnedPool
from offload.swap.resident import resident_plan
from offload.swap.space import SwapFile, SwapSpace, SwapSpaceError, check_nvme_path
from zero.stage3.device_copy import SideStream
from zero.stage3.placement import auto_keeps_unit, auto_max_in_cpu
from zero.stage3.quant import PartitionCodec, QuantTarget, planned_nbytes, unit_codec
from zero.stage3.unit import PartitionStatus, Unit, safe_file_name, set_status

__all__ = ["PartitionStore", "Stage3PinnedBudgetError", "StoreStats", "UnitSize"]

SEGMENT_NUMEL = 1 << 22  # unpinned segments: untouched pages cost nothing, so over-reserving is free


class Stage3PinnedBudgetError(PinnedMemoryBudgetError):
    """The pinned budget cannot hold what stage 3 needs for a layer; names the layer, its size, the budget."""

    def __init__(self, message: str, requested: int, in_use: int, cap: int) -> None:
        MemoryError.__init__(self, message)
        self.requested, self.in_use, self.cap = requested, in_use, cap


class UnitSize(NamedTuple):
    """What placement needs to know about a unit before it exists."""

    name: str
    dtype: torch.dtype
    part_numel: int
    part_nbytes: int


@dataclass
class StoreStats:
    """The store's I/O counters (NVMe bytes read and written, reads, prefetches and prefetch hits; bytes
    read from partitions in host memory). Of the NVMe bytes read, `staged_bytes` were copied out of a staging
    slot, `in_place_bytes` were used where they landed (viewed by the parameters, `lend`, or decoded from the
    slot) and `direct_bytes` were read straight into their destination. `peak_inflight`: most prefetches
    in flight at once; `ahead_bytes` / `peak_ahead_bytes`: bytes of host partitions copied ahead to the
    read-ahead device, now and at most; `slots_replaced`: lent slots still referenced from outside when
    given back (see the module doc); `read_wait_s`: time the reading thread waited for the disk (the rest
    of a gather's time is copies, decoding and bookkeeping)."""

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
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class _Slot:
    buf: torch.Tensor  # uint8, pinned
    handle: Any
    unit: Optional[int] = None  # unit index of a prefetch in flight, None when free
    event: Any = None  # CUDA event of the last copy out of this slot
    lent: Optional[int] = None  # unit index whose gathered tensor is a view of this slot (`lend`)


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share `t`'s memory; -1 where torch cannot say."""
    uses = getattr(torch._C, "_storage_Use_Count", None)
    return int(uses(t.untyped_storage()._cdata)) if uses is not None else -1


class _Arena:
    """Bump allocator over segments; one segment per call to `reserve`, or SEGMENT_NUMEL-sized ones."""

    def __init__(self, alloc: Callable[[int, torch.dtype], torch.Tensor], exact: bool, zeroed: bool) -> None:
        self._alloc = alloc
        self._exact = exact  # pinned memory is locked: never reserve more than asked
        # every segment is fresh anonymous memory (pinned): what nothing has written yet reads as zeros, and
        # memory is never handed out twice, so a unit placed without values needs no zeroing pass (for a
        # model of gigabytes that pass costs seconds of page faults before the values are copied in)
        self.zeroed = zeroed
        self.segments: List[torch.Tensor] = []
        self._open: Dict[torch.dtype, Tuple[int, int]] = {}  # dtype -> (segment index, used)

    def reserve(self, numel: int, dtype: torch.dtype) -> None:
        """Start a segment of exactly `numel` elements (call before taking a known total)."""
        self.segments.append(self._alloc(max(1, numel), dtype))
        self._open[dtype] = (len(self.segments) - 1, 0)

    def take(self, numel: int, dtype: torch.dtype) -> Tuple[int, int, torch.Tensor]:
        seg, used = self._open.get(dtype, (-1, 0))
        if seg < 0 or used + numel > self.segments[seg].numel():
            self.reserve(numel if self._exact else max(numel, SEGMENT_NUMEL), dtype)
            seg, used = self._open[dtype]
        self._open[dtype] = (seg, used + numel)
        return seg, used, self.segments[seg][used : used + numel]


class PartitionStore:
    """Holds every unit's partition of this rank in its tier; reads, writes and prefetches them."""

    def __init__(
        self,
        offload: OffloadParamConfig,
        *,
        device: torch.device,
        rank: int,
        pool: PinnedPool,
        aio: AioConfig,
    ) -> None:
        """`offload`: the config's offload_param section (tier, pin_memory, nvme_path, buffer_count,
        buffer_size, max_in_cpu: the config holds their defaults); `pool`: the capped pinned pool."""
        tier, pin_memory, nvme_path = offload.device, offload.pin_memory, offload.nvme_path
        buffer_count, buffer_size, max_in_cpu = offload.buffer_count, offload.buffer_size, offload.max_in_cpu
        if tier not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload_param.device must be 'none', 'cpu' or 'nvme', got {tier!r}")
        self.tier = tier
        self.device = device
        self.rank = rank
        self.pin_memory = pin_memory and tier != "none"
        self.pool = pool
        self.buffer_count = max(1, int(buffer_count))
        self.buffer_size = max(1, int(buffer_size))
        # "auto" (zero.stage3.placement): resolved against the pinned budget when the units are placed
        self.auto_max_in_cpu = tier == "nvme" and max_in_cpu == "auto"
        self.max_in_cpu = int(max_in_cpu) if tier == "nvme" and not self.auto_max_in_cpu else 0
        self.in_cpu_numel = 0
        self.in_memory_bytes = 0  # bytes of partitions placed in memory (device or host)
        self.charged_bytes = 0  # pageable partitions kept by "auto", charged to the pinned budget
        # unit name -> kept in host memory (NVMe tier), as `reserve` planned it for the units it was given;
        # units placed without a plan (one at a time, as zero.Init builds them) take what is left, first fit
        self._resident: Dict[str, bool] = {}
        self.stats = StoreStats()
        self._aio = aio
        self._nvme_path = (
            check_nvme_path(nvme_path or "", "zero_optimization.offload_param.nvme_path")
            if tier == "nvme"
            else None
        )
        self._space: Optional[SwapSpace] = None
        self._files: Dict[int, SwapFile] = {}
        self._file_names: Dict[str, int] = {}
        self._mem: Dict[int, Tuple[int, int, torch.Tensor]] = {}  # unit -> (segment, offset, view)
        self._names: Dict[int, str] = {}
        self._units: Dict[int, Unit] = {}  # by index: a prefetch sets its parameters' ds_status (INFLIGHT)
        self._largest: Optional[Unit] = None  # largest unit on NVMe: sizes the staging slots
        self._slots: List[_Slot] = []
        self._slot_bytes = 0
        self._inflight: Dict[int, List[_Slot]] = {}  # unit index -> the slots its prefetch reads into
        self._lent: Dict[int, _Slot] = {}  # unit index -> the slot its gathered tensor views
        self._slot_uses = -1  # storage uses of a slot's buffer that nothing outside the store holds
        self._direct_handle: Any = None
        # The optimizer may write partitions from its own thread during backward (pipelined steps) while
        # the main thread prefetches others: the slot bookkeeping is shared, the writer's I/O is not.
        self._slots_lock = threading.RLock()
        self._plan: Dict[str, QuantTarget] = {}  # unit (module) name -> what to quantize
        self._codecs: Dict[int, PartitionCodec] = {}
        self._copies = SideStream()
        # Read ahead from host memory to the compute device (`read_ahead_device`, set by the partitioner):
        # unit index -> (its stored bytes or values on the device, the copy's event)
        self.read_ahead_device: Optional[torch.device] = None
        self._ahead: Dict[int, Tuple[torch.Tensor, Any]] = {}
        self._write_handle: Any = None
        on_device = tier == "none"
        self.arena = _Arena(self._memory_allocator(on_device), exact=self.pin_memory, zeroed=self.pin_memory)

    # ------------------------------------------------------------------------------------------ placement
    def _memory_allocator(self, on_device: bool) -> Callable[[int, torch.dtype], torch.Tensor]:
        if on_device:
            return lambda n, dtype: torch.empty(n, dtype=dtype, device=self.device)
        if self.pin_memory:
            return self.pool.allocate
        return lambda n, dtype: torch.empty(n, dtype=dtype)

    def reserve(self, units: Sequence[Any]) -> None:
        """Make one memory segment (per dtype) for the units placed next, so they lie back to back, and on
        the NVMe tier plan which of them stay in host memory (`resident_plan` over what is left of
        max_in_cpu). `units`: Units or anything with `name`, `dtype`, `part_numel` and `part_nbytes`
        (UnitSize), in module order."""
        totals: Dict[torch.dtype, int] = {}
        keep = [True] * len(units)
        if self.auto_max_in_cpu:
            self.max_in_cpu = self.in_cpu_numel + auto_max_in_cpu(
                units, self.pool, self.buffer_count, self.buffer_size
            )
        if self.tier == "nvme":
            keep = resident_plan([u.part_numel for u in units], self.max_in_cpu - self.in_cpu_numel)
            self._resident.update((u.name, k) for u, k in zip(units, keep))
        for u, k in zip(units, keep):
            if not k:
                continue
            t = self._plan.get(u.name)
            if t is not None:
                n = planned_nbytes(t.numels, t.index, u.part_numel, self.rank, t.spec, u.dtype)
                totals[torch.uint8] = totals.get(torch.uint8, 0) + n
            else:
                totals[u.dtype] = totals.get(u.dtype, 0) + u.part_numel
        for dtype, n in totals.items():
            self._guard(lambda n=n, dtype=dtype: self.arena.reserve(n, dtype), units, n)

    def _guard(self, fn: Callable[[], Any], units: Sequence[Any], numel: int) -> Any:
        try:
            return fn()
        except PinnedMemoryBudgetError as e:
            big = max(units, key=lambda u: u.part_nbytes)
            raise Stage3PinnedBudgetError(
                f"pinned memory budget of {e.cap} bytes ({e.cap - e.in_use} free) is too small for the "
                f"stage-3 parameter partitions in host memory: {numel} elements ({e.requested} bytes) "
                f"requested for "
                f"{len(units)} layer(s), the largest {big.name!r} with a partition of {big.part_numel} "
                f"elements ({big.part_nbytes} bytes); raise the pinned budget, set offload_param.pin_memory="
                "false, or offload to nvme",
                e.requested,
                e.in_use,
                e.cap,
            ) from e

    def place(self, unit: Unit, fill: Optional[Callable[[torch.Tensor], None]]) -> None:
        """Make the unit's partition: `fill(dst)` writes all part_numel elements of it into `dst` (None:
        zeros). In memory, `dst` is the partition's own slot, so the values are written once."""
        self._names[unit.index] = unit.name
        self._units[unit.index] = unit
        codec = unit_codec(unit, self._plan.get(unit.name))
        if codec is not None:
            self._codecs[unit.index] = codec
        if self.auto_max_in_cpu and unit.name not in self._resident:  # placed without a plan (zero.Init)
            keep = auto_keeps_unit(unit, self.pool, self.buffer_count, self.buffer_size)
            self.max_in_cpu = self.in_cpu_numel + (unit.part_numel if keep else 0)
        fits = self.in_cpu_numel + unit.part_numel <= self.max_in_cpu
        in_memory = self.tier != "nvme" or (self._resident.get(unit.name, True) and fits)
        if in_memory:
            if self.tier == "nvme":
                self.in_cpu_numel += unit.part_numel
            numel, dtype = (codec.nbytes, torch.uint8) if codec is not None else (unit.part_numel, unit.dtype)
            seg, off, view = self._guard(lambda: self.arena.take(numel, dtype), [unit], numel)
            self.in_memory_bytes += view.numel() * view.element_size()
            if self.auto_max_in_cpu and not self.pin_memory:
                self._guard(lambda: self.pool.charge(view.numel() * view.element_size()), [unit], numel)
                self.charged_bytes += view.numel() * view.element_size()
            self._mem[unit.index] = (seg, off, view)
            if fill is None:
                if not self.arena.zeroed:
                    view.zero_()  # zero bytes decode to zeros
            elif codec is None:
                fill(view)
            else:
                values = torch.empty(unit.part_numel, dtype=unit.dtype, device=view.device)
                fill(values)
                codec.encode(values, view)
            return
        self._files[unit.index] = self._new_file(unit)
        if self._largest is None or self.stored_nbytes(unit) > self.stored_nbytes(self._largest):
            self._largest = unit
        if fill is None:
            return  # a new swap file is preallocated and reads as zeros: writing them would double the I/O
        values = torch.empty(unit.part_numel, dtype=unit.dtype)
        fill(values)
        self.write(unit, values)

    # ----------------------------------------------------------------------------------------- quantization
    def set_quantization(self, plan: Dict[str, QuantTarget]) -> None:
        """Store the weights `plan` selects (by module name: zero.stage3.quant.quantization_plan) encoded,
        in every unit placed from now on."""
        self._plan = dict(plan)

    @property
    def quantizes(self) -> bool:
        """Whether a quantization plan was set (zero.stage3.quant)."""
        return bool(self._plan)

    def codec(self, unit: Unit) -> Optional[PartitionCodec]:
        """The unit's codec when its partition is stored quantized, else None."""
        return self._codecs.get(unit.index)

    def stored_nbytes(self, unit: Unit) -> int:
        """Bytes the unit's partition occupies on its tier and moves per read (quantized: encoded)."""
        codec = self._codecs.get(unit.index)
        return codec.nbytes if codec is not None else unit.part_nbytes

    def use_swap_space(self, space: Any) -> None:
        """Create the swap files of the units placed from now on in `space` instead of a private
        SwapSpace: anything with SwapSpace's `create`, `close`, `dir`, `bytes_allocated` and `read_only`
        (zero.stage3.swap_cache.SwapCache). The store closes it. Writes to a `read_only` space are refused."""
        if self._space is not None:
            raise RuntimeError("the store already has a swap space: set it before placing any unit")
        self._space = space

    def _new_file(self, unit: Unit) -> SwapFile:
        if self._space is None:
            assert self._nvme_path is not None
            self._space = SwapSpace(self._nvme_path, prefix=f"zero-stage3-r{self.rank}-")
        base = safe_file_name(unit.name)
        k = self._file_names.get(base, 0)
        self._file_names[base] = k + 1
        name = f"{base}.param.swp" if k == 0 else f"{base}.{k}.param.swp"
        return self._space.create(name, self.stored_nbytes(unit))

    def on_nvme(self, unit: Unit) -> bool:
        """Whether the unit's partition lives in a swap file."""
        return unit.index in self._files

    def memory_partition(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's partition tensor when it lives in memory (a view into a segment), else None (also
        when it is stored quantized: its bytes are not values)."""
        entry = self._mem.get(unit.index)
        return entry[2] if entry is not None and unit.index not in self._codecs else None

    def memory_location(self, unit: Unit) -> Optional[Tuple[int, int]]:
        """(segment index, element offset) of a memory-tier partition inside `arena.segments` (None when
        it is stored quantized)."""
        entry = self._mem.get(unit.index)
        return (entry[0], entry[1]) if entry is not None and unit.index not in self._codecs else None

    def swap_file(self, unit: Unit) -> Optional[str]:
        """The path of the unit's swap file, or None (memory tier)."""
        f = self._files.get(unit.index)
        return f.path if f is not None else None

    @property
    def swap_dir(self) -> Optional[str]:
        """The private directory of this store's swap files (None until the first one exists)."""
        return self._space.dir if self._space is not None else None

    @property
    def bytes_on_disk(self) -> int:
        """Bytes allocated to this store's swap files (0 without NVMe)."""
        return self._space.bytes_allocated if self._space is not None else 0

    # ---------------------------------------------------------------------------------------- staging slots
    def ensure_slots(self) -> None:
        """Allocate the pinned staging slots now (before training), or fail naming the largest layer."""
        if self._slots or self._largest is None:
            return
        big = self._largest
        self._slot_bytes = min(self.buffer_size * big.element_size, self.stored_nbytes(big))
        for _ in range(self.buffer_count):
            try:
                buf = self.pool.allocate(self._slot_bytes, torch.uint8)
            except PinnedMemoryBudgetError as e:
                for s in self._slots:
                    self.pool.free(s.buf)
                self._slots = []
                raise Stage3PinnedBudgetError(
                    f"pinned memory budget of {e.cap} bytes ({e.cap - e.in_use} free) is too small for the "
                    f"stage-3 NVMe staging buffers: the largest layer {big.name!r} has a partition of "
                    f"{big.part_numel} elements ({self.stored_nbytes(big)} bytes) and offload_param asks for "
                    f"buffer_count={self.buffer_count} buffers of {self._slot_bytes} bytes "
                    f"(buffer_size={self.buffer_size} elements); raise the pinned budget or lower "
                    "offload_param.buffer_size / buffer_count",
                    e.requested,
                    e.in_use,
                    e.cap,
                ) from e
            self._slots.append(_Slot(buf, self._aio.handle()))
        self._slot_uses = _storage_uses(self._slots[0].buf)

    def _idle_slots(self) -> List[_Slot]:
        """The slots holding nothing: no prefetch in flight, not lent (call under `_slots_lock`)."""
        self.ensure_slots()
        return [s for s in self._slots if s.unit is None and s.lent is None]

    def _free_slot(self, evict: bool) -> Optional[_Slot]:
        idle = self._idle_slots()
        if idle:
            return idle[0]
        if not evict or not self._inflight:
            return None  # (every slot lent: the caller reads around the slots)
        # Every slot holds a prefetch: the one queued last, the furthest ahead, is given up (its unit is
        # read again on demand, or prefetched again when a slot frees).
        victim_unit, held = next(reversed(self._inflight.items()))
        self._drop_inflight(victim_unit)
        return held[0]

    def _piece_bytes(self) -> int:
        """Bytes per slot of a partition prefetched in pieces: the slot's size in whole 4 KiB blocks, so that
        each piece's file offset stays aligned for O_DIRECT (0: slots smaller than a block take no pieces)."""
        return self._slot_bytes // 4096 * 4096

    def _drop_inflight(self, index: int) -> None:
        with self._slots_lock:
            held = self._inflight.pop(index, None)
        if held is not None:
            for s in held:
                # its data is dropped unused, so is a failed read's error: a read on demand meets it again
                with contextlib.suppress(Exception):
                    s.handle.wait()
                s.unit = None
            self._prefetch_over(self._units[index])

    @staticmethod
    def _prefetch_over(unit: Unit) -> None:
        """The unit's prefetch was used or dropped: not in flight any more (a gather sets AVAILABLE)."""
        if unit.full is None:
            set_status(unit, PartitionStatus.NOT_AVAILABLE)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Count the time inside as waiting for the disk (`StoreStats.read_wait_s`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.read_wait_s += time.perf_counter() - t0

    def _wait_copy(self, s: _Slot) -> None:
        if s.event is not None:
            s.event.synchronize()  # the slot's last host->device copy must finish before it is refilled
            s.event = None

    def _copy_out(self, s: _Slot, dst_bytes: torch.Tensor, nbytes: int, fresh: bool = False) -> None:
        # on a GPU: a side stream (device_copy); `fresh`: dst_bytes is part of a `device_buffer`
        s.event = self._copies.copy(dst_bytes, s.buf[:nbytes], fresh)

    def device_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer on the compute device for `read(..., fresh=True)`: on a GPU allocated on
        the copies' side stream, so that a read into it overlaps the compute queued before it."""
        return self._copies.empty(numel, dtype, self.device)

    # ------------------------------------------------------------------------------------------------- I/O
    def prefetchable(self, unit: Unit) -> bool:
        """Whether `prefetch` applies to the unit: its partition is on NVMe, or in host memory while reads
        ahead are on (`read_ahead_device` set)."""
        return unit.index in self._files or self._reads_ahead(unit)

    def _reads_ahead(self, unit: Unit) -> bool:
        """A host-memory partition (`cpu` tier, or kept by max_in_cpu) while reads ahead are on."""
        return self.read_ahead_device is not None and self.tier != "none" and unit.index in self._mem

    def prefetch(self, unit: Unit) -> bool:
        """Queue an async read of an NVMe partition into a free slot (a partition larger than a slot: into as
        many free slots as its pieces need), or, for a partition in host memory with `read_ahead_device`
        set, an async copy of it to that device (`take_ahead`, or `read`, uses it); False if not applicable,
        not enough slots are free, or the device has no memory for the copy."""
        if self._reads_ahead(unit):
            return self._read_ahead(unit)
        path = self._files.get(unit.index)  # opened relative to its directory fd, never by path
        if path is None or unit.index in self._inflight:
            return False
        self.ensure_slots()
        nbytes = self.stored_nbytes(unit)
        piece = max(1, nbytes) if nbytes <= self._slot_bytes else self._piece_bytes()
        if piece == 0:
            return False
        with self._slots_lock:
            pieces = max(1, -(-nbytes // piece))
            free = self._idle_slots()[:pieces]
            if not free or len(free) * piece < nbytes:
                return False
            for s in free:
                s.unit = unit.index  # taken: no other thread's _free_slot returns it now
            self._inflight[unit.index] = free
            self.stats.peak_inflight = max(self.stats.peak_inflight, len(self._inflight))
        try:
            for i, s in enumerate(free):
                self._wait_copy(s)
                off = i * piece
                s.handle.async_pread(s.buf[: min(piece, nbytes - off)], path, off)
        except BaseException:
            self._drop_inflight(unit.index)  # a refused request: no slot may pass for holding the unit
            raise
        self.stats.prefetches += 1
        if unit.full is None:
            set_status(unit, PartitionStatus.INFLIGHT)  # DeepSpeed's meaning: being fetched
        return True

    def prefetching(self, unit: Unit) -> bool:
        """Whether a prefetch of the unit's partition is queued or done, and not consumed yet."""
        return unit.index in self._inflight or unit.index in self._ahead

    def _read_ahead(self, unit: Unit) -> bool:
        dev = self.read_ahead_device
        if unit.index in self._ahead or dev is None:
            return False
        src = self._mem[unit.index][2]  # the values, or the codes of a quantized unit
        try:
            copied = self._copies.copy_ahead(src, dev)
        except torch.OutOfMemoryError:
            return False  # no room ahead on the device: the unit is copied when it is gathered
        with self._slots_lock:
            self._ahead[unit.index] = copied
            st = self.stats
            st.peak_inflight = max(st.peak_inflight, len(self._inflight) + len(self._ahead))
            st.ahead_bytes += src.numel() * src.element_size()
            st.peak_ahead_bytes = max(st.peak_ahead_bytes, st.ahead_bytes)
        self.stats.prefetches += 1
        if unit.full is None:
            set_status(unit, PartitionStatus.INFLIGHT)
        return True

    def _ahead_copy(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's copy read ahead, ready for the compute stream and counted as a read; None if none."""
        with self._slots_lock:
            held = self._ahead.pop(unit.index, None)
            if held is not None:
                self.stats.ahead_bytes -= held[0].numel() * held[0].element_size()
        if held is None:
            return None
        self._prefetch_over(unit)
        t = self._copies.take(*held)
        self.stats.cpu_bytes_read += t.numel() * t.element_size()
        self.stats.prefetch_hits += 1
        return t

    def take_ahead(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's partition read ahead to `read_ahead_device` (part_numel elements of its dtype, a
        tensor of its own), or None when there is none (or the unit is stored quantized: `read` decodes
        its codes read ahead)."""
        if unit.index in self._codecs:
            return None
        return self._ahead_copy(unit)

    def drop_read_ahead(self) -> None:
        """Drop every copy ahead not taken yet (a pass that does not read ahead: its partitions may be
        updated in place, through `arena.segments`, before a later use)."""
        for index in list(self._ahead):
            self._drop_ahead(index)

    def _drop_ahead(self, index: int) -> None:
        with self._slots_lock:
            held = self._ahead.pop(index, None)
            if held is not None:
                self.stats.ahead_bytes -= held[0].numel() * held[0].element_size()
        if held is not None:
            self._copies.wait(held[1])  # the copy reads the host partition: let it end first
            self._prefetch_over(self._units[index])

    def lend(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's partition as a view of the staging slot its read landed in (part_numel elements of its
        dtype, host memory), the slot kept out of use until `give_back(unit)`; None when that does not
        apply (not on NVMe, stored quantized, larger than a slot, every slot lent, or torch cannot count
        a buffer's users): then `read` it. Uses the unit's prefetch when one is queued."""
        if unit.index in self._codecs:
            return None
        s = self._land(unit, unit.part_nbytes, lend=True)
        return s.buf[: unit.part_nbytes].view(unit.dtype) if s is not None else None

    def encoded(self, unit: Unit, lend: bool = True) -> torch.Tensor:
        """The stored (quantized) bytes of the unit's partition in host memory, for a product that reads
        the codes: its copy made ahead in host memory (reads ahead to the CPU), else a view of its memory
        partition, else (`lend`) of the staging slot its read landed in (lent to the unit until
        `give_back(unit)`, as `lend`), else a copy read around the slots (a unit held for good must not
        keep a slot). Read-only."""
        codec = self._codecs[unit.index]
        held = self._ahead.get(unit.index)
        if held is not None and held[0].device.type == "cpu":
            ahead = self._ahead_copy(unit)
            assert ahead is not None
            return ahead
        entry = self._mem.get(unit.index)
        if entry is not None and entry[2].device.type == "cpu":
            self._count_memory_read(entry[2], codec.nbytes)
            return entry[2][: codec.nbytes]
        s = self._land(unit, codec.nbytes, lend=True) if lend else None
        if s is not None:
            return s.buf[: codec.nbytes]
        stored = torch.empty(codec.nbytes, dtype=torch.uint8)
        self._read_stored(unit, stored, codec.nbytes)
        return stored

    def _land(self, unit: Unit, nbytes: int, lend: bool) -> Optional[_Slot]:
        """Read the unit's stored bytes into a staging slot (its prefetch's, else a free one) and return
        the slot, counted as used in place: lent to the unit (`lend`), else taken until `_done(slot)`.
        None when the unit is not on NVMe, does not fit a slot, or no slot is free."""
        path = self._files.get(unit.index)  # opened relative to its directory fd, never by path
        if path is None:
            return None
        self.ensure_slots()
        if nbytes > self._slot_bytes or lend and self._slot_uses < 0:
            return None
        with self._slots_lock:
            held = self._inflight.pop(unit.index, None)
            hit = held is not None
            s = held[0] if held is not None else None  # (one slot: the partition fits one)
            if s is None:
                s = self._free_slot(evict=True)
                if s is None:
                    return None
            s.unit = unit.index  # taken (no prefetch may claim it) until `_done` or `give_back`
            if lend:
                s.lent = unit.index
                self._lent[unit.index] = s
        try:
            with self._waiting():
                if hit:
                    self._prefetch_over(unit)
                    s.handle.wait()  # raises AioError naming the file if the read failed
                else:
                    self._wait_copy(s)
                    s.handle.sync_pread(s.buf[:nbytes], path, 0)
        except BaseException:
            self._done(s)
            self.give_back(unit)
            raise
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        self.stats.in_place_bytes += nbytes
        self.stats.prefetch_hits += int(hit)
        if lend:
            s.unit = None  # the loan keeps it now
        return s

    @staticmethod
    def _done(s: _Slot) -> None:
        s.unit = None

    def give_back(self, unit: Unit) -> bool:
        """End the loan of `unit`'s slot (`lend`); the caller has dropped every view of it. A slot whose
        memory is still referenced from outside is given a new buffer rather than refilled. Returns
        whether a slot was lent to the unit (and is free now)."""
        with self._slots_lock:
            s = self._lent.pop(unit.index, None)
            if s is None:
                return False
            if _storage_uses(s.buf) != self._slot_uses:
                # someone still views the old memory (it lives on until they drop it): never refill it
                self.pool.free(s.buf)
                s.buf = self.pool.allocate(self._slot_bytes, torch.uint8)
                self.stats.slots_replaced += 1
            s.lent = None
        return True

    def lent(self, unit: Unit) -> bool:
        """Whether the unit's gathered tensor is a view of a staging slot right now (`lend`)."""
        return unit.index in self._lent

    def read(self, unit: Unit, dst: torch.Tensor, fresh: bool = False) -> None:
        """Copy the unit's partition into `dst` (part_numel elements, contiguous, on any device); a
        quantized one is read encoded and decoded on `dst`'s device. `fresh`: `dst` comes from
        `device_buffer`."""
        codec = self._codecs.get(unit.index)
        if codec is None:
            self._read_stored(unit, dst, unit.part_nbytes, fresh)
            return
        ahead = self._ahead_copy(unit)
        if ahead is not None:  # the codes, copied ahead to the device: decoded there
            codec.decode(ahead, dst)
            return
        entry = self._mem.get(unit.index)
        if entry is not None and entry[2].device == dst.device:
            self._count_memory_read(entry[2], codec.nbytes)
            codec.decode(entry[2], dst)  # straight from the partition: no copy of the bytes
            return
        s = self._land(unit, codec.nbytes, lend=False) if dst.device.type == "cpu" else None
        if s is not None:  # decoded straight from the staging slot: no copy of the bytes
            try:
                codec.decode(s.buf[: codec.nbytes], dst)
            finally:
                self._done(s)
            return
        stored = self._copies.empty(codec.nbytes, torch.uint8, dst.device)
        self._read_stored(unit, stored, codec.nbytes, fresh=True)
        codec.decode(stored, dst)

    def _count_memory_read(self, mem: torch.Tensor, nbytes: int) -> None:
        if mem.device.type == "cpu":
            self.stats.cpu_bytes_read += nbytes

    def _read_stored(self, unit: Unit, dst: torch.Tensor, nbytes: int, fresh: bool = False) -> None:
        """Copy the `nbytes` the unit's partition occupies on its tier into `dst` (of its stored dtype)."""
        entry = self._mem.get(unit.index)
        if entry is not None:
            ahead = self._ahead_copy(unit)
            if ahead is not None:
                dst.view(torch.uint8)[:nbytes].copy_(ahead.view(torch.uint8))
                return
            mem = entry[2]
            self._count_memory_read(mem, nbytes)
            if dst.device.type == "cuda" and mem.device.type == "cpu":
                s = _Slot(mem.view(torch.uint8), None)
                self._copy_out(s, dst.view(torch.uint8), nbytes, fresh)
            else:
                dst.copy_(mem)
            return
        path = self._files.get(unit.index)  # opened relative to its directory fd, never by path
        if path is None:
            raise KeyError(f"unit {unit.name!r} has no partition in this store")
        dst_bytes = dst.view(torch.uint8)
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        with self._slots_lock:
            held = self._inflight.pop(unit.index, None)
        if held is not None:
            self._prefetch_over(unit)
            piece = nbytes if len(held) == 1 else self._piece_bytes()
            try:
                with self._waiting():
                    for s in held:
                        s.handle.wait()  # raises AioError naming the file if the read failed
                for i, s in enumerate(held):
                    off = i * piece
                    self._copy_out(s, dst_bytes[off : off + piece], min(piece, nbytes - off), fresh)
            finally:
                for s in held:
                    with contextlib.suppress(Exception):  # (the first failure is what propagates)
                        s.handle.wait()  # after a failed piece, the other pieces' reads end first
                    s.unit = None
            self.stats.prefetch_hits += 1
            self.stats.staged_bytes += nbytes
            return
        self.ensure_slots()
        big = dst.device.type == "cpu" and nbytes > self._slot_bytes
        with self._slots_lock:
            s = None if big else self._free_slot(evict=True)
        if s is None:  # into host memory, larger than a slot or every slot lent: no staging copy
            if dst.device.type != "cpu":
                raise RuntimeError(f"no free staging slot to read {unit.name!r} into device memory")
            if self._direct_handle is None:
                self._direct_handle = self._aio.handle()
            with self._waiting():
                self._direct_handle.sync_pread(dst_bytes[:nbytes], path, 0)
            self.stats.direct_bytes += nbytes
            return
        self.stats.staged_bytes += nbytes
        esize = dst.element_size()
        chunk = self._slot_bytes // esize * esize
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            self._wait_copy(s)
            with self._waiting():
                s.handle.sync_pread(s.buf[:n], path, off)
            self._copy_out(s, dst_bytes[off : off + n], n, fresh)

    def write(self, unit: Unit, src: torch.Tensor, only: Optional[set] = None) -> None:
        """Replace the unit's partition with `src` (part_numel elements, any device). A quantized unit is
        encoded; `only` (indices of its parameters) re-encodes just those parameters' quantized shares and
        keeps the others as stored (no second rounding of values already quantized)."""
        src = src.reshape(-1)
        if src.numel() != unit.part_numel or src.dtype != unit.dtype:
            raise ValueError(
                f"partition of {unit.name!r} is {unit.part_numel} x {unit.dtype}, "
                f"got {src.numel()} x {src.dtype}"
            )
        codec = self._codecs.get(unit.index)
        entry = self._mem.get(unit.index)
        if entry is not None:
            self._drop_ahead(unit.index)  # a copy of the old values must not be used
            if codec is None:
                entry[2].copy_(src)
            else:
                codec.encode(src.to(entry[2].device), entry[2], only)
            return
        path = self._files.get(unit.index)  # opened relative to its directory fd, never by path
        if path is None:
            raise KeyError(f"unit {unit.name!r} has no partition in this store")
        if self._space is not None and self._space.read_only:
            raise SwapSpaceError(
                errno.EROFS,
                f"the partition of {unit.name!r} is in a read-only swap cache: not written",
                path.path,
            )
        self._drop_inflight(unit.index)  # a prefetch of the old values must not be used
        host = src.detach().to("cpu").contiguous()
        if codec is not None:
            encoded = torch.empty(codec.nbytes, dtype=torch.uint8)
            if only is not None:
                self._own_handle().sync_pread(encoded, path, 0)
                self.stats.bytes_read += codec.nbytes
            codec.encode(host, encoded, only)
            host = encoded
        self._aio_write(host, path)  # failures raise AioError naming the file, offset and errno
        self.stats.bytes_written += self.stored_nbytes(unit)

    def read_private(self, unit: Unit, dst: torch.Tensor) -> None:
        """`read` into a host tensor through the writer's own handle, never a staging slot: for the thread
        that writes partitions (the optimizer), while the main thread's gathers use the slots."""
        path = self._files.get(unit.index)  # opened relative to its directory fd, never by path
        if path is None:
            self.read(unit, dst)  # memory tier: a plain copy, no slot
            return
        codec = self._codecs.get(unit.index)
        if codec is None:
            self._own_handle().sync_pread(dst.view(torch.uint8), path, 0)
        else:
            stored = torch.empty(codec.nbytes, dtype=torch.uint8)
            self._own_handle().sync_pread(stored, path, 0)
            codec.decode(stored, dst)
        self.stats.bytes_read += self.stored_nbytes(unit)

    def _own_handle(self) -> Any:
        if self._write_handle is None:
            self._write_handle = self._aio.handle()  # its own handle: a write never waits on a prefetch
        return self._write_handle

    def _aio_write(self, host: torch.Tensor, path: SwapFile) -> int:
        return int(self._own_handle().sync_pwrite(host, path, 0))

    # ---------------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Drop prefetches, give slots and pinned segments back to the pool, remove the swap files."""
        for index in list(self._inflight):
            self._drop_inflight(index)
        self.drop_read_ahead()
        self._lent.clear()  # the partitioner freed its units: no view of a slot is in use
        for s in self._slots:
            self._wait_copy(s)
            s.handle.close()
            self.pool.free(s.buf)
        self._slots = []
        for h in (self._write_handle, self._direct_handle):
            if h is not None:
                h.close()
        self._write_handle = self._direct_handle = None
        if self.pin_memory:
            for seg in self.arena.segments:
                self.pool.free(seg)
        self.arena.segments = []
        self.pool.uncharge(self.charged_bytes)
        self.charged_bytes = 0
        self._mem.clear()
        if self._space is not None:
            self._space.close()
            self._space = None
