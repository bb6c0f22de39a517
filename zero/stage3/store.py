"""Where each unit's partition lives between uses: device memory, host memory (pinned) or an NVMe swap file.

Memory tiers ("none": the compute device, "cpu": host memory, pinned when `pin_memory`) pack partitions back
to back into a few segments (zero.stage3.arena): flat buffers for the optimizer, no allocation per partition.
The NVMe tier keeps one swap file per unit, named after its module, or serves the unit from the checkpoint
files it lies in unconverted (`serve_from`; zero.stage3.nvme_files, zero.stage3.served), and moves it
through `buffer_count` pinned staging slots of at most `buffer_size` elements, each with its own aio
handle: a partition that fits a slot is one request; a larger one is prefetched in pieces into free slots,
or, read on demand, streamed through a slot chunk by chunk (on a CPU destination: straight into it). With
`max_in_cpu`, partitions of up to that many elements stay in host memory, spread along the module order
(offload.swap.resident) so that a forward's reads overlap their compute.

Lending (`lend` / `give_back`): on a CPU compute device a partition that lands in a slot is used where it
lies; the slot stays out of use until `give_back`, and one still viewed from outside then is replaced by a
new buffer (`StoreStats.slots_replaced`). With weight quantization (`set_quantization`, zero.stage3.quant)
the units it selects are stored encoded (`PartitionCodec`) on any tier: slot, file and reads are
`stored_nbytes` long, `read` decodes on the destination's device, and `memory_partition` is None for them.
Read ahead to an accelerator (`read_ahead_device`, set by the partitioner for an inference forward on one):
`prefetch` of a partition in host memory copies it to the device ahead (zero.stage3.read_ahead) and
`take_ahead` hands the copy over; a write, or a pass that does not read ahead (`drop_read_ahead`), drops it.

Partition writes may be left in flight (`write(..., asynchronous=True)`, zero.stage3.write_back): any
read of the unit's file waits for its write first.

The module is longer than most (some 710 lines): reads, prefetches, loans and writes share one piece of
bookkeeping - which slot holds what, under one lock taken by the main thread and the optimizer's writer
thread - and splitting it would spread that invariant over modules.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload.config.aio import AioConfig
from offload.config.zero import OffloadParamConfig
from offload.pinned import PinnedMemoryBudgetError, PinnedPool
from offload.swap.resident import resident_plan
from offload.swap.space import check_nvme_path
from zero.stage3.arena import Arena
from zero.stage3.device_copy import SideStream
from zero.stage3.nvme_files import NvmeFiles
from zero.stage3.pinned_budget import Stage3PinnedBudgetError, partitions_budget_error, staging_budget_error
from zero.stage3.placement import auto_keeps_unit, auto_max_in_cpu
from zero.stage3.quant import PartitionCodec, QuantTarget, segment_totals, unit_codec
from zero.stage3.read_ahead import ReadAhead
from zero.stage3.served import ALIGN, CheckpointFds, ServedPartition
from zero.stage3.staging_slot import StagingSlot as _Slot
from zero.stage3.staging_slot import allocate_slots
from zero.stage3.staging_slot import storage_uses as _storage_uses
from zero.stage3.store_stats import StoreStats, UnitSize
from zero.stage3.unit import PartitionStatus, Unit, set_status
from zero.stage3.write_back import WriteBack

__all__ = ["PartitionStore", "Stage3PinnedBudgetError", "StoreStats", "UnitSize"]


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
        nvme = (
            check_nvme_path(nvme_path or "", "zero_optimization.offload_param.nvme_path")
            if tier == "nvme"
            else None
        )
        # where each partition on NVMe lives: its swap file, or checkpoint files it is served from
        self.files = NvmeFiles(nvme if tier == "nvme" else None, rank)
        self._mem: Dict[int, Tuple[int, int, torch.Tensor]] = {}  # unit -> (segment, offset, view)
        self._names: Dict[int, str] = {}
        self._units: Dict[int, Unit] = {}  # by index: a prefetch sets its parameters' ds_status (INFLIGHT)
        self._largest: Optional[Unit] = None  # largest unit on NVMe: sizes the staging slots
        self._slots: List[_Slot] = []
        self._slot_bytes = 0  # the most bytes a slot holds
        self._slot_alloc = 0  # a slot buffer's bytes: `_slot_bytes`, plus ALIGN with served partitions
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
        self._ahead = ReadAhead(self._copies, self.stats, self._slots_lock, self._prefetch_over)
        # the writer's I/O (its own handle: a write never waits on a prefetch), writes left in flight
        self.write_back = WriteBack(aio.handle, aio.queue_depth, self.stats)
        on_device = tier == "none"
        self.arena = Arena(self._memory_allocator(on_device), exact=self.pin_memory, zeroed=self.pin_memory)

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
        keep = [True] * len(units)
        if self.auto_max_in_cpu:
            self.max_in_cpu = self.in_cpu_numel + auto_max_in_cpu(
                units, self.pool, self.buffer_count, self.buffer_size
            )
        if self.tier == "nvme":
            keep = resident_plan([u.part_numel for u in units], self.max_in_cpu - self.in_cpu_numel)
            self._resident.update((u.name, k) for u, k in zip(units, keep))
        for dtype, n in segment_totals(units, keep, self._plan, self.rank).items():
            self._guard(lambda n=n, dtype=dtype: self.arena.reserve(n, dtype), units, n)

    def _guard(self, fn: Callable[[], Any], units: Sequence[Any], numel: int) -> Any:
        try:
            return fn()
        except PinnedMemoryBudgetError as e:
            raise partitions_budget_error(e, units, numel) from e

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
        self.files.add(unit, self.stored_nbytes(unit), may_serve=codec is None and fill is None)
        if self._largest is None or self.stored_nbytes(unit) > self.stored_nbytes(self._largest):
            self._largest = unit
        if fill is None:
            # served: the checkpoint holds its values; a new swap file is preallocated and reads as zeros:
            # writing them would double the I/O
            return
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
        """Swap files from now on in `space` (a SwapCache; see NvmeFiles.use_swap_space), closed with the
        store; writes to a `read_only` space are refused."""
        self.files.use_swap_space(space)

    def serve_from(
        self, checkpoint: CheckpointFds, serve: Callable[[Unit], Optional[ServedPartition]]
    ) -> None:
        """Serve the units placed from now on (without values, stored raw) from checkpoint files where
        `serve(unit)` gives extents (zero.stage3.served); `checkpoint` is closed with the store."""
        self.files.serve_from(checkpoint, serve)

    def served(self, unit: Unit) -> bool:
        """Whether the unit's partition is read straight from checkpoint files (`serve_from`)."""
        return self.files.served(unit)

    @property
    def served_bytes(self) -> int:
        """Bytes of the served partitions that come from checkpoint files."""
        return self.files.served_bytes

    def on_nvme(self, unit: Unit) -> bool:
        """Whether the unit's partition lives on NVMe: in a swap file, or served from checkpoint files."""
        return self.files.holds(unit)

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
        """The path of the unit's swap file, or None (memory tier, or served from the checkpoint)."""
        f = self.files.swap_file(unit)
        return f.path if f is not None else None

    @property
    def swap_dir(self) -> Optional[str]:
        """The private directory of this store's swap files (None until the first one exists)."""
        return self.files.dir

    @property
    def bytes_on_disk(self) -> int:
        """Bytes allocated to this store's swap files (0 without NVMe)."""
        return self.files.bytes_allocated

    # ---------------------------------------------------------------------------------------- staging slots
    def ensure_slots(self) -> None:
        """Allocate the pinned staging slots now (before training), or fail naming the largest layer."""
        if self._slots or self._largest is None:
            return
        big = self._largest
        self._slot_bytes = min(self.buffer_size * big.element_size, self.stored_nbytes(big))
        # with served partitions, room for a read to start at its file's alignment (PartitionSource.lead)
        # when the budget has it; without it such reads start at 0 (bounced by the I/O core)
        pads = (ALIGN, 0) if self.files.served_bytes else (0,)
        try:
            self._slots, self._slot_alloc = allocate_slots(
                self.pool, self.buffer_count, self._slot_bytes, pads, self._aio.handle
            )
        except PinnedMemoryBudgetError as e:
            stored, n, size = self.stored_nbytes(big), self.buffer_count, self.buffer_size
            raise staging_budget_error(e, big, stored, n, self._slot_bytes, size) from e
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
        s.event = self._copies.copy(dst_bytes, s.data(nbytes), fresh)

    def device_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer on the compute device for `read(..., fresh=True)`: on a GPU allocated on
        the copies' side stream, so that a read into it overlaps the compute queued before it."""
        return self._copies.empty(numel, dtype, self.device)

    # ------------------------------------------------------------------------------------------------- I/O
    def prefetchable(self, unit: Unit) -> bool:
        """Whether `prefetch` applies to the unit: its partition is on NVMe, or in host memory while reads
        ahead are on (`read_ahead_device` set)."""
        return self.files.holds(unit) or self._reads_ahead(unit)

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
        path = self._source(unit)  # a swap file (by its directory fd) or checkpoint fds
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
                path.read_into(s.handle, s.land(path, off, min(piece, nbytes - off)), off, asynchronous=True)
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
        if dev is None:
            return False
        src = self._mem[unit.index][2]  # the values, or the codes of a quantized unit
        return self._ahead.start(unit, src, dev, len(self._inflight))

    def take_ahead(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's partition read ahead to `read_ahead_device` (part_numel elements of its dtype, a
        tensor of its own), or None when there is none (or the unit is stored quantized: `read` decodes
        its codes read ahead)."""
        if unit.index in self._codecs:
            return None
        return self._ahead.take(unit)

    def drop_read_ahead(self) -> None:
        """Drop every copy ahead not taken yet (a pass that does not read ahead: its partitions may be
        updated in place, through `arena.segments`, before a later use)."""
        for index in self._ahead.held():
            self._ahead.drop(self._units[index])

    def lend(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's partition as a view of the staging slot its read landed in (part_numel elements of its
        dtype, host memory), the slot kept out of use until `give_back(unit)`; None when that does not
        apply (not on NVMe, stored quantized, larger than a slot, every slot lent, or torch cannot count
        a buffer's users): then `read` it. Uses the unit's prefetch when one is queued."""
        if unit.index in self._codecs:
            return None
        s = self._land(unit, unit.part_nbytes, lend=True)
        return s.data(unit.part_nbytes).view(unit.dtype) if s is not None else None

    def encoded(self, unit: Unit, lend: bool = True) -> torch.Tensor:
        """The stored (quantized) bytes of the unit's partition in host memory, for a product that reads
        the codes: its copy made ahead in host memory (reads ahead to the CPU), else a view of its memory
        partition, else (`lend`) of the staging slot its read landed in (lent to the unit until
        `give_back(unit)`, as `lend`), else a copy read around the slots (a unit held for good must not
        keep a slot). Read-only."""
        codec = self._codecs[unit.index]
        if self._ahead.on_cpu(unit):
            ahead = self._ahead.take(unit)
            assert ahead is not None
            return ahead
        entry = self._mem.get(unit.index)
        if entry is not None and entry[2].device.type == "cpu":
            self._count_memory_read(entry[2], codec.nbytes)
            return entry[2][: codec.nbytes]
        s = self._land(unit, codec.nbytes, lend=True) if lend else None
        if s is not None:
            return s.data(codec.nbytes)
        stored = torch.empty(codec.nbytes, dtype=torch.uint8)
        self._read_stored(unit, stored, codec.nbytes)
        return stored

    def _land(self, unit: Unit, nbytes: int, lend: bool) -> Optional[_Slot]:
        """Read the unit's stored bytes into a staging slot (its prefetch's, else a free one) and return
        the slot, counted as used in place: lent to the unit (`lend`), else taken until `_done(slot)`.
        None when the unit is not on NVMe, does not fit a slot, or no slot is free."""
        path = self._source(unit)  # a swap file (by its directory fd) or checkpoint fds
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
                    path.read_into(s.handle, s.land(path, 0, nbytes), 0)
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
                s.buf = self.pool.allocate(self._slot_alloc, torch.uint8)
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
        ahead = self._ahead.take(unit)
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
                codec.decode(s.data(codec.nbytes), dst)
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
            ahead = self._ahead.take(unit)
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
        path = self._source(unit)  # a swap file (by its directory fd) or checkpoint fds
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
                path.read_into(self._direct_handle, dst_bytes[:nbytes], 0)
            self.stats.direct_bytes += nbytes
            return
        self.stats.staged_bytes += nbytes
        esize = dst.element_size()
        chunk = self._slot_bytes // esize * esize
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            self._wait_copy(s)
            with self._waiting():
                path.read_into(s.handle, s.land(path, off, n), off)
            self._copy_out(s, dst_bytes[off : off + n], n, fresh)

    def write(
        self, unit: Unit, src: torch.Tensor, only: Optional[set] = None, asynchronous: bool = False
    ) -> None:
        """Replace the unit's partition with `src` (part_numel elements, any device). A quantized unit is
        encoded; `only` (indices of its parameters) re-encodes just those parameters' quantized shares and
        keeps the others as stored (no second rounding of values already quantized). `asynchronous`: a swap
        file write is left in flight (zero.stage3.write_back): `src` must not change after the call."""
        src = src.reshape(-1)
        if src.numel() != unit.part_numel or src.dtype != unit.dtype:
            raise ValueError(
                f"partition of {unit.name!r} is {unit.part_numel} x {unit.dtype}, "
                f"got {src.numel()} x {src.dtype}"
            )
        codec = self._codecs.get(unit.index)
        entry = self._mem.get(unit.index)
        if entry is not None:
            self._ahead.drop(unit)  # a copy of the old values must not be used
            if codec is None:
                entry[2].copy_(src)
            else:
                codec.encode(src.to(entry[2].device), entry[2], only)
            return
        path = self.files.writable(unit)  # refused: served, or in a read-only swap cache (EROFS)
        self._drop_inflight(unit.index)  # a prefetch of the old values must not be used
        host = src.detach().to("cpu").contiguous()
        if codec is not None:
            encoded = torch.empty(codec.nbytes, dtype=torch.uint8)
            if only is not None:
                self.write_back.settle(unit.index)
                self.write_back.own.sync_pread(encoded, path, 0)
                self.stats.bytes_read += codec.nbytes
            codec.encode(host, encoded, only)
            host = encoded
        if asynchronous:
            self.write_back.submit(unit.index, unit.name, host, path)
        else:  # failures raise AioError naming the file, offset and errno
            self.write_back.write_now(unit.index, host, path)
        self.stats.bytes_written += self.stored_nbytes(unit)

    def _source(self, unit: Unit) -> Any:
        """Where the unit's partition is read from (None: not on NVMe), once its write in flight ended."""
        self.write_back.settle(unit.index)  # DeferredWriteError while it keeps failing
        return self.files.source(unit)

    def forget_ahead(self, unit: Unit) -> None:
        """Drop the unit's copy read ahead to the device, if any: its memory partition changed in place."""
        self._ahead.drop(unit)

    def read_private(self, unit: Unit, dst: torch.Tensor) -> None:
        """`read` into a host tensor through the writer's own handle, never a staging slot: for the thread
        that writes partitions (the optimizer), while the main thread's gathers use the slots."""
        path = self._source(unit)  # a swap file (by its directory fd) or checkpoint fds
        if path is None:
            self.read(unit, dst)  # memory tier: a plain copy, no slot
            return
        codec = self._codecs.get(unit.index)
        stored = dst.view(torch.uint8) if codec is None else torch.empty(codec.nbytes, dtype=torch.uint8)
        path.read_into(self.write_back.own, stored, 0)
        if codec is not None:
            codec.decode(stored, dst)
        self.stats.bytes_read += self.stored_nbytes(unit)

    # ---------------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Drop prefetches, give slots and pinned segments back to the pool, remove the swap files. A write
        in flight that keeps failing is raised (DeferredWriteError, steps_lost 1) once all that is done."""
        lost = self.write_back.close()  # (its handles: before the swap files go)
        for index in list(self._inflight):
            self._drop_inflight(index)
        self.drop_read_ahead()
        self._lent.clear()  # the partitioner freed its units: no view of a slot is in use
        for s in self._slots:
            self._wait_copy(s)
            s.handle.close()
            self.pool.free(s.buf)
        self._slots = []
        if self._direct_handle is not None:
            self._direct_handle.close()
        self._direct_handle = None
        if self.pin_memory:
            for seg in self.arena.segments:
                self.pool.free(seg)
        self.arena.segments = []
        self.pool.uncharge(self.charged_bytes)
        self.charged_bytes = 0
        self._mem.clear()
        self.files.close()
        if lost is not None:
            raise lost
