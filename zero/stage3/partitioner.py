"""Stage3Partitioner: owns the 16-bit (or fp32) parameter partitions and gathers / frees whole units.

This is the object the engine constructs for stage 3 (see docs/stage3.md, "The seam"):

* it owns each rank's partitions in their tier (`store`: device memory, host memory, NVMe files);
* `fetch(unit)` / `release(unit)` make a unit's parameters whole on the compute device or empty again
  (reference counted: a module called twice, a tied weight, a GatheredParameters block all hold it);
* `read_partition` / `write_partition` and `memory_segments` give the optimizer its flat partitions and
  a way to write updated values back to memory or the swap file.
* code outside zero.stage3 reaches the partitions only through its documented seam (`tier`, `pool`,
  `on_nvme`, `memory_partition`, `codec`, ...; tests/test_stage3_seam.py), never through `store`.

It is composed of parts, each in a module of its own: the unit builder that turns modules into units
(`builder`, zero.stage3.builder), the use trace that drives prefetch and reuse
(`use_trace`, zero.stage3.trace), gradient reduction into the gradient sink given at construction
(`grads`, zero.stage3.reduction and zero.stage3.grads), the module hooks (`hooks`, zero.stage3.hooks) and
whole-model state dicts (zero.stage3.state_dict), and its I/O counts (zero.stage3.io_report). The
partitioner owns what they share: which units are whole, and how many elements are gathered (`live_numel`).

The module is longer than most (about 650 lines): some 110 of them are the seam's short delegations to the
store, which keep the store private to stage 3, and the gather / free logic beside them is one piece of
state (references, backward holds, units kept for reuse, live counts) that a split would spread out;
`write_share` (a write to a parameter's `ds_tensor`, zero.stage3.shard) updates the gathered copies it
holds.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from offload.config.loader import ConfigInput
from offload.config.zero import OffloadParamConfig
from offload.pinned import PinnedPool
from zero.accelerator import compute_device
from zero.stage3.adopt import choose_owner, move_foreign_units
from zero.stage3.builder import UnitBuilder
from zero.stage3.comm import all_gather_unit, dist_info
from zero.stage3.config import default_pinned_pool, load_stage3_config
from zero.stage3.grads import GradSink
from zero.stage3.hooks import Stage3Hooks
from zero.stage3.io_report import ParamIOReport, take_io_report
from zero.stage3.placement import ParamPlacement, describe_param_placement
from zero.stage3.quant import PartitionCodec, QuantTarget
from zero.stage3.reduction import GradReduction
from zero.stage3.served import CheckpointFds, ServedPartition
from zero.stage3.state_dict import gathered_state_dict, load_shard
from zero.stage3.store import PartitionStore
from zero.stage3.trace import UseTrace
from zero.stage3.unit import PartitionStatus, Unit, set_partition_tensors, set_status

__all__ = ["ParamIOReport", "Stage3Partitioner"]


_HOST_ALIGN = 4096


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised gathered buffer; in host memory 4 KiB aligned, so that an NVMe read straight into
    it goes to the device without bouncing (O_DIRECT)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * esize + _HOST_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HOST_ALIGN
    return raw[skip : skip + numel * esize].view(dtype)


class Stage3Partitioner:
    """Partitions modules' parameters across ranks and tiers; gathers and frees them on request."""

    def __init__(
        self,
        config: ConfigInput = None,
        *,
        device: Optional[Union[str, torch.device]] = None,
        group: Optional[dist.ProcessGroup] = None,
        pool: Optional[PinnedPool] = None,
        grad_sink: Optional[GradSink] = None,
    ) -> None:
        """`config`: dict, JSON path, loaded config or None (defaults); `device`: the compute device
        (default: the accelerator's); `pool`: the pinned pool to share (default: one capped by the config);
        `grad_sink`: where each unit's reduced gradient goes (default: a SummingSink: `grad_partitions`)."""
        self.group = group
        self.rank, self.world_size = dist_info(group)
        self.config = load_stage3_config(config, self.world_size)
        z = self.config.zero_optimization
        off: OffloadParamConfig = z.offload_param or OffloadParamConfig()
        self.device = torch.device(device if device is not None else compute_device())
        self.offload_param = off
        self.store = PartitionStore(
            off,
            device=self.device,
            rank=self.rank,
            pool=pool if pool is not None else default_pinned_pool(self.config),
            aio=self.config.aio,
        )
        self._released: Dict[torch.dtype, torch.Tensor] = {}  # the empty `.data` of released parameters
        self.units: List[Unit] = []
        self.builder = UnitBuilder(
            self,
            self.units,
            self.store,
            device=self.device,
            released=self.released_tensor,
            persistence_threshold=int(z.stage3_param_persistence_threshold),
            model_persistence_numel=int(z.stage3_model_persistence_threshold),
        )
        self.use_trace = UseTrace(
            self.units,
            self.store,
            prefetch_numel=int(z.stage3_prefetch_bucket_size),
            max_live_numel=int(z.stage3_max_live_parameters),
            max_reuse_numel=int(z.stage3_max_reuse_distance),
        )
        self.grads = GradReduction(
            grad_sink, world_size=self.world_size, group=group, device=self.device, release=self._grads_in
        )
        self.grad_partitions: Dict[int, torch.Tensor] = self.grads.default_sums  # the default sink's sums
        self.live_full_bytes = 0
        self.peak_full_bytes = 0
        self.live_numel = 0
        self.peak_live_numel = 0
        self.gathers = 0
        self.host_to_device_bytes = 0
        # Copies of host-memory partitions ahead of their use in inference forwards (one rank): None reads
        # ahead when the compute device is an accelerator; True also on the CPU, where each copy replaces
        # using the partition in place (a way to run that path without a GPU); False never.
        self.read_ahead: Optional[bool] = None
        self._closed = False
        self.hooks: Optional[Stage3Hooks] = None
        # The zero.Init that made it (None: made otherwise): a model built from parts that one Init gave
        # to several partitioners is moved into one of them when attached (zero.stage3.adopt).
        self.family: Optional[object] = None

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        config: ConfigInput = None,
        *,
        grad_sink: Optional[GradSink] = None,
        **kwargs: Any,
    ) -> Stage3Partitioner:
        """The partitioner to train `model` with, attached, its gradients going to `grad_sink`: the one its
        parameters were partitioned by under `Init` (config and kwargs are then ignored; parts built by
        separate statements under one Init are moved into one partitioner, zero.stage3.adopt), else a new
        one from `config`."""
        part = choose_owner(model)  # several partitioners of one Init: the one holding most of it
        if part is not None:
            part._refuse_attached()  # before its sink changes: the engine training it is left as it was
            if grad_sink is not None:
                part.grads.sink = grad_sink  # taken over from the Init, before any backward
        else:
            part = cls(config, grad_sink=grad_sink, **kwargs)
        part.attach(model)
        return part

    @property
    def grad_sink(self) -> GradSink:
        """Where each unit's reduced gradient goes (given at construction, or to `for_model`)."""
        return self.grads.sink

    @property
    def in_backward(self) -> bool:
        """Whether a backward through the attached model has started and not ended yet."""
        return self.grads.in_backward

    # ------------------------------------------------------------------------------------------ partition
    def released_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The shared empty tensor a released parameter's `.data` points at."""
        t = self._released.get(dtype)
        if t is None:
            t = self._released[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return t

    def partition_params(
        self,
        name: str,
        params: Sequence[nn.Parameter],
        param_names: Sequence[str],
        shapes: Optional[Sequence[torch.Size]] = None,
    ) -> Unit:
        """Make `params` one unit: store this rank's share in its tier and empty their `.data` (a unit moved
        in from another partitioner, zero.stage3.adopt). With `shapes`, the parameters hold no values yet
        (built on the meta device): the partition is 0."""
        return self.builder.params(name, params, param_names, shapes)

    def partition_module(self, module: nn.Module, name: str) -> Optional[Unit]:
        """Partition the parameters `module` registers itself (recurse=False) that are not partitioned yet
        (zero.stage3.builder: meta-device parameters are replaced by real, empty ones)."""
        return self.builder.module(module, name)

    def partition_model(self, model: nn.Module) -> List[Unit]:
        """Partition every module's parameters, one unit per module (shared parameters: first owner)."""
        return self.builder.model(model)

    # -------------------------------------------------------------------------------------- fetch/release
    def partition_as_full(self, unit: Unit) -> Optional[torch.Tensor]:
        """The partition itself when it serves as the unit's full buffer (one rank, partition already on the
        compute device: a gather costs no copy), else None."""
        if self.world_size != 1:
            return None
        mem = self.store.memory_partition(unit)
        if mem is not None and mem.device == self.device:
            return mem
        return None

    def _lends(self, unit: Unit) -> bool:
        """Whether the unit's parameters may view the staging slot its partition lands in (zero copy): one
        rank, the CPU computes, and nothing keeps the weights past the unit's release - no autograd graph
        (grad mode off, not in a backward) and not a persistent unit (it would hold a slot for good)."""
        return self._host_inference() and not unit.persistent

    def _host_inference(self) -> bool:
        """One rank computing on the CPU with grad mode off, outside backward: an inference forward."""
        return (
            self.world_size == 1
            and self.device.type == "cpu"
            and not torch.is_grad_enabled()
            and not self.in_backward
        )

    def _gather(self, unit: Unit, encoded: bool = False) -> None:
        for kept in self.use_trace.make_room(self.live_numel, unit.numel):
            self._free(kept)
        if encoded and self._host_inference():
            self._gather_encoded(unit)
            return
        full = None
        if unit.padded_numel == unit.part_numel:
            full = self.store.take_ahead(unit)  # copied to the device ahead of this use (`begin_pass`)
            if full is not None and self.device.type != "cpu":
                self.host_to_device_bytes += unit.part_nbytes
        if full is None:
            full = self.partition_as_full(unit)
        if full is None and self._lends(unit):
            full = self.store.lend(unit)
        if full is None:
            from_host = False
            if self.device.type != "cpu":
                mem = self.store.memory_partition(unit)
                from_host = mem is None or mem.device.type == "cpu"  # a host tier or an NVMe staging slot
                if from_host:
                    self.host_to_device_bytes += unit.part_nbytes
            if self.world_size == 1:
                # from the host: a buffer of the copies' side stream, so the copy overlaps the layers queued
                # before it
                if from_host:
                    full = self.store.device_buffer(unit.padded_numel, unit.dtype)
                else:
                    full = _empty(unit.padded_numel, unit.dtype, self.device)
                self.store.read(unit, full, fresh=from_host)
            else:
                full = _empty(unit.padded_numel, unit.dtype, self.device)
                own = torch.empty(unit.part_numel, dtype=unit.dtype, device=self.device)
                self.store.read(unit, own)
                all_gather_unit(unit, full, own, self.group)
        self._gathered(unit, full)

    def _gathered(self, unit: Unit, full: torch.Tensor) -> None:
        unit.full = full
        for i, p in enumerate(unit.params):
            a, z = unit.param_range(i)
            p.data = full[a:z].view(unit.shapes[i])
        set_status(unit, PartitionStatus.AVAILABLE)
        self.gathers += 1
        self.live_full_bytes += unit.nbytes
        self.peak_full_bytes = max(self.peak_full_bytes, self.live_full_bytes)
        self.live_numel += unit.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _gather_encoded(self, unit: Unit) -> None:
        """Gather a unit whose module computes from the codes (zero/stage3/fused.py): its stored bytes
        stay where they are, only the raw parameters are decoded, the weight stays released."""
        assert self.hooks is not None
        stored = self.store.encoded(unit, lend=not unit.persistent)
        codec = self.store.codec(unit)
        assert codec is not None
        full = torch.empty(unit.padded_numel, dtype=unit.dtype)  # the weight's pages are never touched
        codec.decode(stored, full, quantized=False)
        unit.encoded = self.hooks.fused.encoded_weight(unit, stored)
        self._gathered(unit, full)
        weight = unit.params[unit.encoded.weight]
        weight.data = self.released_tensor(unit.dtype)
        weight.ds_status = PartitionStatus.NOT_AVAILABLE  # a read from elsewhere decodes it (`fetch`)

    def _decode_encoded(self, unit: Unit) -> None:
        """Decode an encoded-gathered unit's weight into its buffer: something besides its own forward
        reads it (the module then runs its own forward too)."""
        enc, full = unit.encoded, unit.full
        assert enc is not None and full is not None
        codec = self.store.codec(unit)
        assert codec is not None
        codec.decode(enc.stored, full)
        unit.encoded = None
        weight = unit.params[enc.weight]
        a, z = unit.param_range(enc.weight)
        weight.data = full[a:z].view(unit.shapes[enc.weight])
        weight.ds_status = PartitionStatus.AVAILABLE

    def _free(self, unit: Unit) -> None:
        unit.encoded = None  # drops its views of the staging slot before the slot is given back
        released = self.released_tensor(unit.dtype)
        for p in unit.params:
            p.data = released
        set_status(unit, PartitionStatus.NOT_AVAILABLE)
        unit.full = None
        self.live_full_bytes -= unit.nbytes
        self.live_numel -= unit.numel
        self.use_trace.discard(unit)
        if self.store.give_back(unit):  # its staging slot is free: queue the next read into it now
            self.use_trace.refill(self.live_numel)

    def _use(self, unit: Unit) -> None:
        """Record a use of `unit` (after its read: prefetches queued now must not take the slot it needs)."""
        if self.use_trace.record(unit, self.live_numel):
            self._drop_kept()
        elif not self.use_trace.order and self._host_inference():  # first inference pass: guess the order
            self.use_trace.guess(unit, self.live_numel)

    def fetch(self, unit: Unit, encoded: bool = False) -> None:
        """Hold `unit` whole on the device until the matching `release`. `encoded`: the fetch is its own
        module's, which may compute from the codes (zero/stage3/fused.py); any other fetch of a unit
        gathered that way, or one outside an inference forward, decodes its weight."""
        unit.refs += 1
        if unit.full is None:
            self._gather(unit, encoded)
        elif unit.encoded is not None and not (encoded and self._host_inference()):
            self._decode_encoded(unit)  # read by another module, or by a forward that may be differentiated
        self._use(unit)

    def release(self, unit: Unit) -> None:
        """Undo one `fetch`: once nothing holds the unit, it is freed (or kept for a predicted reuse)."""
        unit.refs -= 1
        if unit.refs < 0:
            raise RuntimeError(f"unit {unit.name!r} released more often than fetched")
        self._maybe_free(unit, keep_for_reuse=True)

    def repartition(self, unit: Unit) -> None:
        """Free `unit` if nothing holds it, persistent or not: a GatheredParameters block that found it
        partitioned leaves it partitioned (a persistent unit is then gathered again at its first use)."""
        if unit.full is not None and unit.refs == 0 and not unit.bwd_hold:
            self._free(unit)

    def _maybe_free(self, unit: Unit, keep_for_reuse: bool = False) -> None:
        if unit.full is not None and unit.refs == 0 and not unit.bwd_hold and not unit.persistent:
            if keep_for_reuse and self.use_trace.keep(unit, self.live_numel):
                return
            self._free(unit)

    def _drop_kept(self) -> None:
        """Free units kept for a reuse that will not come (the order changed, the pass or backward ended)."""
        for index in list(self.use_trace.kept):
            self._maybe_free(self.units[index])

    def begin_pass(self) -> None:
        """Called at the start of a root forward: closes the recorded order of the previous pass."""
        if self.in_backward:  # the last backward raised before its end callback ran: forget its state
            self._abort_backward()
        self._drop_kept()
        # An inference forward on an accelerator copies host-memory partitions ahead of their use on a side
        # stream (store.prefetch), as NVMe partitions are read ahead; training copies them when gathered.
        wanted = self.device.type != "cpu" if self.read_ahead is None else self.read_ahead
        ahead = wanted and self.world_size == 1 and not torch.is_grad_enabled()
        self.store.read_ahead_device = self.device if ahead else None
        if not ahead:
            # copies left by an earlier pass (made beyond where it stopped) would be stale once the
            # optimizer updates the partitions in place: this pass gathers from the partitions themselves
            self.store.drop_read_ahead()
        self.use_trace.begin_pass(self.live_numel)

    def hold_for_backward(self, unit: Unit) -> None:
        """Gather `unit` for a module's backward; it is freed once its gradients are in (or backward ends)."""
        if self.grads.is_final(unit) and not unit.present:
            return  # gradients already final this backward: autograd will not read these weights again
        unit.bwd_hold = True
        if unit.full is None:
            self._gather(unit)
        self._use(unit)

    def release_backward_hold(self, units: List[Unit]) -> None:
        """Units without trainable parameters whose module's backward has run (zero.stage3.hooks): free
        them as a gradient would free a trainable unit."""
        for u in units:
            if u.bwd_hold and not u.trainable:
                u.bwd_hold = False
                self._maybe_free(u)

    def release_all(self) -> None:
        """Free every gathered, non-persistent unit (after an exception, or to drop all full weights)."""
        for u in self.units:
            u.refs = 0
            u.bwd_hold = False
            self._maybe_free(u)

    # ------------------------------------------------------------------------------------------- backward
    def install_grad_hooks(self) -> None:
        """Per-parameter post-accumulate-grad hooks that reduce each unit's gradient (see `grads`). Which
        parameters are trainable is read now: a parameter frozen after `zero.Init` partitioned it (PEFT's
        LoRA freezes the base model that way) is gathered for forward and backward but gets no gradient."""
        for u in self.units:
            u.trainable = [i for i, p in enumerate(u.params) if p.requires_grad]
        self.grads.install(self.units)

    def begin_backward(self) -> None:
        """A backward through the attached model starts (its end must call `end_backward`)."""
        self.grads.in_backward = True

    def _grads_in(self, unit: Unit) -> None:
        """`unit`'s gradient is reduced: backward will not read its weights again."""
        unit.bwd_hold = False
        self._maybe_free(unit, keep_for_reuse=True)

    def end_backward(self) -> None:
        """End of a backward: reduce what no hook reduced (unused parameters: zeros), free held units."""
        self.grads.finish(self.units)
        self._free_held()

    def _abort_backward(self) -> None:
        self.grads.abort(self.units)
        self._free_held()

    def _free_held(self) -> None:
        for u in self.units:
            u.bwd_hold = False
            self._maybe_free(u)

    # ---------------------------------------------------------------------------------- the engine's seam
    # Code outside zero.stage3 reaches the partitions through these methods, never through `store`
    # (tests/test_stage3_seam.py checks it): the store's bookkeeping stays the partitioner's to change.
    @property
    def tier(self) -> str:
        """Where the partitions live: "none" (the compute device), "cpu" or "nvme" (offload_param.device)."""
        return self.store.tier

    @property
    def pool(self) -> PinnedPool:
        """The pinned pool the partitions and staging slots come from (a zero.Init's: its budget)."""
        return self.store.pool

    @property
    def bytes_on_disk(self) -> int:
        """Bytes allocated to the partitions' swap files (0 without NVMe)."""
        return self.store.bytes_on_disk

    @property
    def swap_bytes_written(self) -> int:
        """Bytes written to the swap files since the last `take_io_report` (or construction)."""
        return self.store.stats.bytes_written

    def on_nvme(self, unit: Unit) -> bool:
        """Whether the unit's partition lives on NVMe: in a swap file, or served from checkpoint files."""
        return self.store.on_nvme(unit)

    def serve_from(
        self, checkpoint: CheckpointFds, serve: Callable[[Unit], Optional[ServedPartition]]
    ) -> None:
        """Serve the units placed from now on from the checkpoint's own files where `serve(unit)` gives
        their extents (zero.stage3.served); the partitioner closes `checkpoint` with its store."""
        self.store.serve_from(checkpoint, serve)

    def param_placement(self, max_in_cpu: Union[int, str]) -> ParamPlacement:
        """Where the partitions live and why, bytes per tier (`max_in_cpu`: the config's value;
        zero.stage3.placement)."""
        return describe_param_placement(self.store, max_in_cpu)

    def served(self, unit: Unit) -> bool:
        """Whether the unit's partition is read straight from checkpoint files (`serve_from`)."""
        return self.store.served(unit)

    @property
    def served_bytes(self) -> int:
        """Bytes of the partitions read straight from checkpoint files."""
        return self.store.served_bytes

    def memory_partition(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's partition itself when it lives in memory (a view into `memory_segments()`), else None
        (a swap file, or stored quantized: its bytes are not values)."""
        return self.store.memory_partition(unit)

    def memory_location(self, unit: Unit) -> Optional[Tuple[int, int]]:
        """(segment index, element offset) of a memory-tier partition in `memory_segments()`, else None."""
        return self.store.memory_location(unit)

    def memory_segments(self) -> List[torch.Tensor]:
        """Flat tensors holding every memory-tier partition back to back (see `memory_location`)."""
        return list(self.store.arena.segments)

    # weight quantization (zero.stage3.quant)
    def set_quantization(self, plan: Dict[str, QuantTarget]) -> None:
        """Store the weights `plan` selects (zero.stage3.quant.quantization_plan) quantized, in every unit
        partitioned from now on: call it before `partition_model` / `attach`."""
        self.store.set_quantization(plan)

    @property
    def quantizes(self) -> bool:
        """Whether a quantization plan was set (`set_quantization`)."""
        return self.store.quantizes

    def codec(self, unit: Unit) -> Optional[PartitionCodec]:
        """The unit's codec when its partition is stored quantized, else None."""
        return self.store.codec(unit)

    def stored_nbytes(self, unit: Unit) -> int:
        """Bytes the unit's partition occupies on its tier and moves per read (quantized: encoded)."""
        return self.store.stored_nbytes(unit)

    def use_swap_space(self, space: Any) -> None:
        """Create the swap files of the units partitioned from now on in `space` (a SwapSpace or
        zero.stage3.swap_cache.SwapCache; the partitioner closes it) instead of a private one."""
        self.store.use_swap_space(space)

    def drop_read_ahead(self) -> None:
        """Drop the copies of host partitions read ahead to the device and not used yet."""
        self.store.drop_read_ahead()

    def read_partition(self, unit: Unit, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's partition of `unit` (a view when it lives in memory and `out` is None)."""
        if out is None:
            mem = self.store.memory_partition(unit)
            if mem is not None:
                return mem
            out = torch.empty(unit.part_numel, dtype=unit.dtype)
        self.store.read(unit, out)
        return out

    def read_partition_private(self, unit: Unit, out: torch.Tensor) -> None:
        """`read_partition` into `out` (host memory) without the staging slots, through a handle of its
        own: for the thread that writes partitions (the optimizer's) while the main thread gathers."""
        self.store.read_private(unit, out)

    def write_partition(
        self, unit: Unit, values: torch.Tensor, only: Optional[set] = None, asynchronous: bool = False
    ) -> None:
        """Replace this rank's partition (updated weights); a gathered copy is refreshed or dropped.
        `only` (indices of the unit's parameters), for a unit stored quantized: re-encode just those
        parameters and keep the others as stored (no second rounding). `asynchronous`: a swap file write
        is left in flight (zero.stage3.write_back; `settle_writes`), holding `values`: hand over a host
        tensor nothing changes afterwards.

        Collective for world_size > 1 while the unit is held (its full buffer is re-gathered)."""
        self.store.write(unit, values, only, asynchronous)
        if unit.full is None or unit.full is self.partition_as_full(unit):
            return
        if self.world_size == 1:
            unit.full[: unit.part_numel].copy_(values.reshape(-1))
        elif unit.refs or unit.bwd_hold:
            own = values.reshape(-1).to(self.device, unit.dtype)
            all_gather_unit(unit, unit.full, own, self.group)
        else:
            self._free(unit)

    def settle_writes(self) -> None:
        """Wait for every partition write left in flight (`write_partition(..., asynchronous=True)`); one
        that failed is written again, and while that fails too this raises
        offload.swap.optimizer_swapper.DeferredWriteError (steps_lost 0: the values are held, nothing is
        lost). Reads of a unit settle its own write first."""
        self.store.write_back.settle_all()

    @property
    def writes_in_flight(self) -> int:
        """Partition writes queued and not waited for yet."""
        return self.store.write_back.in_flight

    def write_share(self, unit: Unit, index: int, values: Optional[torch.Tensor]) -> None:
        """A write to the `ds_tensor` of parameter `index` of `unit` (zero.stage3.shard): `values` (this
        rank's share, 1-D, the unit's dtype) go into the partition - a swap file or a quantized partition
        is read, patched and written back - or, None, the share in memory was changed in place. Then copies
        follow: reads ahead are dropped, and a gathered unit gets this rank's share in its full buffer at
        once (other ranks' copies follow at their next gather). Not collective."""
        lo, hi = unit.share(index)
        start, n = unit.offsets[index] + lo, hi - lo  # the share's real elements in the unit's flat buffer
        at, c = unit.part_offsets[index], unit.chunks[index]  # the chunk (padding included) in the partition
        mem = self.store.memory_partition(unit)
        if values is not None and mem is not None:
            mem[at : at + c].copy_(values)
        elif values is not None:
            whole = self.read_partition(unit, torch.empty(unit.part_numel, dtype=unit.dtype))
            whole[at : at + c].copy_(values)
            self.store.write(unit, whole, only={index})
        if mem is not None:
            self.store.forget_ahead(unit)
        full = unit.full
        if full is None or full is self.partition_as_full(unit):
            return
        if (
            unit.encoded is not None
        ):  # gathered as codes (one rank, inference): gathered again at its next use
            if unit.refs == 0 and not unit.bwd_hold:
                self._free(unit)
            return
        if values is None:
            assert mem is not None  # only a memory partition is changed in place
            values = mem[at : at + c]
        full[start : start + n].copy_(values[:n])

    def load_state_dict_shard(self, shard: Dict[str, torch.Tensor]) -> List[str]:
        """Write full tensors of some parameters (by qualified name) into their partitions, one unit in
        memory at a time; returns the names used (zero.stage3.state_dict.load_shard)."""
        return load_shard(self, shard)

    def attach(self, model: nn.Module) -> Stage3Hooks:
        """Move in the model's units other partitioners of the same zero.Init hold (zero.stage3.adopt),
        partition what is not partitioned yet, install module and gradient hooks; returns the hooks."""
        self._refuse_attached()
        move_foreign_units(self, model)
        self.partition_model(model)
        for name, m in model.named_modules():
            for pname, p in m._parameters.items():
                if p is not None and getattr(p, "ds_unit", None) is not None and p.ds_unit.owner is self:
                    u = p.ds_unit
                    qual = f"{name}.{pname}" if name else pname
                    if u.param_names[p.ds_index].startswith("<init>"):
                        u.param_names[p.ds_index] = qual  # built under Init: learn the qualified name
                        p.ds_name = qual
                        u.name = name or type(m).__name__  # its swap file keeps the construction-order name
        self.hooks = Stage3Hooks(self, model)
        self.install_grad_hooks()
        return self.hooks

    def _refuse_attached(self) -> None:
        if self.hooks is not None:
            raise RuntimeError(
                "this Stage3Partitioner is already attached to a model: one partitioner (and one engine) per "
                "model; under one zero.Init, build each model by a statement of its own (`a = A()`, then "
                "`b = B()`) and each gets a partitioner of its own"
            )

    def gathered_state_dict(
        self, model: nn.Module, device: Union[str, torch.device] = "cpu", keep: bool = True
    ) -> Dict[str, Any]:
        """`model.state_dict()` with whole parameters, gathering one unit at a time (collective;
        `keep=False`: take part, return {}; zero.stage3.state_dict.gathered_state_dict)."""
        return gathered_state_dict(self, model, device, keep)

    def close(self) -> None:
        """Hooks off, every unit freed, pinned memory back to the pool, swap files removed (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.grads.remove()
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        self.release_all()
        for u in self.units:  # no ds_tensor may keep a view of memory given back to the pool
            set_partition_tensors(u, None, None, owned=False)
        self.store.close()

    def take_io_report(self) -> ParamIOReport:
        """The counts since the last call (or since construction), and start counting afresh."""
        return take_io_report(self)

    def units_of(self, params: Iterable[nn.Parameter]) -> List[Unit]:
        """The units (of this partitioner) holding `params`, each once, in order of first appearance."""
        out, seen = [], set()
        for p in params:
            u = getattr(p, "ds_unit", None)
            if u is None:
                raise ValueError(f"parameter of shape {tuple(p.shape)} is not partitioned by stage 3")
            if u.index not in seen and u.owner is self:
                seen.add(u.index)
                out.append(u)
        return out
