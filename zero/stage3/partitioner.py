"""Stage3Partitioner: owns the 16-bit (or fp32) parameter partitions and gathers / frees whole units.

(Longer than most modules: gathering, freeing, prefetch and reuse share one piece of state - which units are
whole, in flight or kept, and where the recorded use order stands - and are kept together so that state has
one owner. Hooks, the gradient sink, state dicts and GatheredParameters live in modules of their own.)

This is the object the engine constructs for stage 3 (see docs/stage3.md, "The seam"):

* it owns each rank's partitions in their tier (`store`: device memory, host memory, NVMe files);
* `fetch(unit)` / `release(unit)` make a unit's parameters whole on the compute device or empty again
  (reference counted: a module called twice, a tied weight, a GatheredParameters block all hold it);
* after a unit's gradients are all in, it reduce-scatters them and hands this rank's gradient partition to
  its `grad_sink` (zero.stage3.grads); the full gradient is freed at once;
* `read_partition` / `write_partition` and `memory_segments` give the optimizer its flat partitions and
  a way to write updated values back to memory or the swap file.

Prefetch: the order in which units are used (fetched in forward, held in backward) is recorded over one
pass (root forward to the next root forward, backward included). On later passes, each use queues async
NVMe reads for the units that follow in that order (up to stage3_prefetch_bucket_size elements, never more
than stage3_max_live_parameters elements gathered or in flight), so reads overlap compute. A pass that
differs re-records the order.

Reuse (stage3_max_reuse_distance): a unit whose next use in the recorded order comes after at most that
many elements of other uses is kept whole when its module is done with it, instead of being freed and
fetched again (a module called twice, a tied weight, the last layers turning from forward into backward),
as long as everything gathered stays within stage3_max_live_parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from offload.config import load_config
from offload.config.zero import OffloadParamConfig
from offload.pinned import PinnedPool, default_pinned_budget
from zero.accelerator import compute_device
from zero.stage3.comm import all_gather_flat, dist_info, reduce_scatter_flat
from zero.stage3.grads import GradSink, SummingSink
from zero.stage3.hooks import Stage3Hooks
from zero.stage3.state_dict import gathered_state_dict, load_shard
from zero.stage3.store import PartitionStore, UnitSize
from zero.stage3.unit import PartitionStatus, Unit, is_partitioned, set_param_attributes

__all__ = ["ParamIOReport", "Stage3Partitioner", "default_pinned_pool", "load_stage3_config"]

PREFETCH_LOOKAHEAD = 64  # trace entries inspected per gather: bounds the bookkeeping on the hot path


def default_pinned_pool(config: Any = None) -> PinnedPool:
    """A PinnedPool capped by the config's zero_offload.pinned_budget_bytes, else the process default."""
    configured = config.zero_offload.pinned_budget_bytes if config is not None else None
    return PinnedPool(default_pinned_budget(configured))


def load_stage3_config(config: Any) -> Any:
    """A loaded config (ZeroOffloadConfig) from a dict, a JSON path, None (defaults) or a loaded one."""
    if config is None or isinstance(config, (dict, str, os.PathLike)):
        return load_config(config)
    return config


@dataclass
class ParamIOReport:
    """The parameter tier's counts over one interval (`Stage3Partitioner.take_io_report`)."""

    param_nvme_read_bytes: int = 0
    param_nvme_write_bytes: int = 0
    param_reads: int = 0  # partition reads from NVMe (prefetched or on demand)
    param_prefetches: int = 0
    param_prefetch_hits: int = 0  # gathers that found their prefetch done or in flight
    gathers: int = 0  # units made whole
    peak_full_bytes: int = 0  # most bytes of whole (gathered) units alive at once, over the interval
    device_to_host_bytes: int = 0  # gradients copied to the host partition parameter by parameter

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


class Stage3Partitioner:
    """Partitions modules' parameters across ranks and tiers; gathers and frees them on request."""

    def __init__(
        self,
        config: Any = None,
        *,
        device: Optional[Union[str, torch.device]] = None,
        group: Optional[dist.ProcessGroup] = None,
        pool: Optional[PinnedPool] = None,
        grad_sink: Optional[GradSink] = None,
    ) -> None:
        self.config = load_stage3_config(config)
        z = self.config.zero_optimization
        off: OffloadParamConfig = z.offload_param or OffloadParamConfig()
        self.group = group
        self.rank, self.world_size = dist_info(group)
        if device is None:
            device = compute_device()
        self.device = torch.device(device)
        self.persistence_threshold = int(z.stage3_param_persistence_threshold)
        self.prefetch_bucket_numel = int(z.stage3_prefetch_bucket_size)
        self.max_live_numel = int(z.stage3_max_live_parameters)
        self.max_reuse_numel = int(z.stage3_max_reuse_distance)  # 0: never keep a unit for its next use
        self.model_persistence_numel = int(z.stage3_model_persistence_threshold)
        self._persistent_numel = 0
        self.offload_param = off
        self.store = PartitionStore(
            off,
            device=self.device,
            rank=self.rank,
            pool=pool if pool is not None else default_pinned_pool(self.config),
            aio=self.config.aio,
        )
        self.units: List[Unit] = []
        # Where each unit's gradient goes (zero.stage3.grads). When the sink offers an accumulator (one rank,
        # same dtype) each parameter's gradient is summed straight into it: no flat gradient buffer; on a GPU
        # each parameter's gradient is copied to the host partition on its own (counted in
        # device_to_host_bytes), so a unit's gradient never exists twice in device memory.
        default = SummingSink()
        self.grad_sink: GradSink = grad_sink if grad_sink is not None else default
        self.grad_partitions: Dict[int, torch.Tensor] = default.partitions  # the default sink's sums
        self.device_to_host_bytes = 0
        self._summed: set = set()  # units whose gradients went to the sink's accumulator this backward
        self.live_full_bytes = 0
        self.peak_full_bytes = 0
        self.gathers = 0
        self._released: Dict[torch.dtype, torch.Tensor] = {}
        self._grad_hooks: List[Any] = []
        self._reduced: set = set()
        self.in_backward = False
        # prefetch trace
        self.trace: List[int] = []
        self._recording: List[int] = []
        self._trace_valid = False
        self._trace_pos = 0
        self._next_use: List[int] = []  # per trace position: where the same unit is used next, or -1
        self._uses_before: List[int] = []  # per trace position: elements of the uses before it
        self._kept: set = set()  # units kept whole for a reuse the trace predicts
        self._live_numel = 0
        self.peak_live_numel = 0
        self.reuse_keeps = 0  # times a unit was kept for its next use instead of freed
        self._closed = False
        self.hooks: Any = None
        self._meta_map: Dict[int, Any] = {}

    @classmethod
    def for_model(
        cls, model: nn.Module, config: Any = None, *, grad_sink: Optional[GradSink] = None, **kwargs: Any
    ) -> Stage3Partitioner:
        """The partitioner to train `model` with, attached, its gradients going to `grad_sink`: the one its
        parameters were partitioned by under `Init` (config and kwargs are then ignored), else a new one
        from `config`."""
        owners = {}
        for p in model.parameters():
            unit = getattr(p, "ds_unit", None)
            if unit is not None:
                owners[id(unit.owner)] = unit.owner
        if len(owners) > 1:
            raise ValueError(
                f"the model's parameters were partitioned by {len(owners)} different partitioners (nested "
                "zero.Init blocks with different configs?); build it under one Init"
            )
        if owners:
            part = next(iter(owners.values()))
            if grad_sink is not None:
                part.grad_sink = grad_sink  # taken over from the Init, before any backward
        else:
            part = cls(config, grad_sink=grad_sink, **kwargs)
        part.attach(model)
        return part

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
        """Make `params` one unit: store this rank's share in its tier and empty their `.data`.
        With `shapes`, the parameters hold no values yet (built on the meta device): the partition is 0."""
        unit = Unit(
            len(self.units), name, params, param_names, self.world_size, self.rank, self.device, shapes
        )
        unit.owner = self
        # DeepSpeed's two knobs: small units stay gathered, up to a model-wide total of persistent elements
        unit.persistent = (
            unit.numel < self.persistence_threshold
            and self._persistent_numel + unit.numel <= self.model_persistence_numel
        )
        if unit.persistent:
            self._persistent_numel += unit.numel
        self.store.place(unit, None if shapes is not None else functools.partial(_fill_partition, unit))
        set_param_attributes(unit, self.released_tensor(unit.dtype))
        for p in unit.params:
            p.ds_persist = unit.persistent
        self.units.append(unit)
        return unit

    def partition_module(self, module: nn.Module, name: str) -> Optional[Unit]:
        """Partition the parameters `module` registers itself (recurse=False) that are not partitioned yet.

        Meta-device parameters are replaced by real (empty) Parameters on the compute device: a meta tensor
        cannot take real data. Modules sharing one meta parameter get the same replacement."""
        params, names, shapes, seen, meta = [], [], [], set(), False
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in self._meta_map:
                module._parameters[pname] = p = self._meta_map[id(p)][1]
            if id(p) in seen or is_partitioned(p):
                continue
            seen.add(id(p))
            shapes.append(p.shape)
            if p.is_meta:
                new = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device), p.requires_grad)
                self._meta_map[id(p)] = (p, new)  # keeps `p` alive so its id is never reused
                module._parameters[pname] = p = new
                meta = True
            params.append(p)
            names.append(f"{name}.{pname}" if name else pname)
        if not params:
            return None
        return self.partition_params(name or type(module).__name__, params, names, shapes if meta else None)

    def _planned_size(self, name: str, module: nn.Module) -> UnitSize:
        params = {id(p): p for p in module._parameters.values() if p is not None and not is_partitioned(p)}
        first = next(iter(params.values()))
        numel = sum(p.numel() for p in params.values())
        part = max(1, -(-numel // self.world_size))
        return UnitSize(name or type(module).__name__, first.dtype, part, part * first.element_size())

    def partition_model(self, model: nn.Module) -> List[Unit]:
        """Partition every module's parameters, one unit per module (shared parameters: first owner)."""
        pending = []
        for name, m in model.named_modules(remove_duplicate=True):
            own = [p for p in m._parameters.values() if p is not None and not is_partitioned(p)]
            if own:
                pending.append((name, m))
        self.store.reserve([self._planned_size(name, m) for name, m in pending])
        new = []
        for name, m in pending:
            u = self.partition_module(m, name)
            if u is not None:
                new.append(u)
        self.store.ensure_slots()
        return new

    # -------------------------------------------------------------------------------------- fetch/release
    def _aliased(self, unit: Unit) -> Optional[torch.Tensor]:
        """The partition itself when it can serve as the full buffer (one rank, already on the device)."""
        if self.world_size != 1:
            return None
        mem = self.store.memory_partition(unit)
        if mem is not None and mem.device == self.device:
            return mem
        return None

    def _gather(self, unit: Unit) -> None:
        if self._kept and self._live_numel + unit.numel > self.max_live_numel:
            self._evict_kept(self._live_numel + unit.numel - self.max_live_numel)
        full = self._aliased(unit)
        if full is None:
            full = torch.empty(unit.padded_numel, dtype=unit.dtype, device=self.device)
            if self.world_size == 1:
                self.store.read(unit, full)
            else:
                own = torch.empty(unit.part_numel, dtype=unit.dtype, device=self.device)
                self.store.read(unit, own)
                all_gather_flat(full, own, self.group)
        unit.full = full
        for i, p in enumerate(unit.params):
            a, z = unit.param_range(i)
            p.data = full[a:z].view(unit.shapes[i])
            p.ds_status = PartitionStatus.AVAILABLE
        self.gathers += 1
        self.live_full_bytes += unit.nbytes
        self.peak_full_bytes = max(self.peak_full_bytes, self.live_full_bytes)
        self._live_numel += unit.numel
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel)

    def _free(self, unit: Unit) -> None:
        released = self.released_tensor(unit.dtype)
        for p in unit.params:
            p.data = released
            p.ds_status = PartitionStatus.NOT_AVAILABLE
        unit.full = None
        self.live_full_bytes -= unit.nbytes
        self._live_numel -= unit.numel
        self._kept.discard(unit.index)

    def fetch(self, unit: Unit) -> None:
        """Hold `unit` whole on the device until the matching `release`."""
        unit.refs += 1
        if unit.full is None:
            self._gather(unit)
        self._traced(unit)  # after the read: prefetches queued now must not take the slot it needs

    def release(self, unit: Unit) -> None:
        unit.refs -= 1
        if unit.refs < 0:
            raise RuntimeError(f"unit {unit.name!r} released more often than fetched")
        self._maybe_free(unit, keep_for_reuse=True)

    def _maybe_free(self, unit: Unit, keep_for_reuse: bool = False) -> None:
        if unit.full is not None and unit.refs == 0 and not unit.bwd_hold and not unit.persistent:
            if keep_for_reuse and self._reused_soon(unit):
                self._kept.add(unit.index)
                self.reuse_keeps += 1
                return
            self._free(unit)

    def _reused_soon(self, unit: Unit) -> bool:
        """True when the trace says `unit` is used again within max_reuse_distance elements of other uses
        and keeping it leaves everything gathered within max_live_parameters."""
        pos = unit.trace_pos
        if self.max_reuse_numel <= 0 or not self._trace_valid or pos is None or pos >= len(self._next_use):
            return False
        nxt = self._next_use[pos]
        if nxt < self._trace_pos or self._live_numel > self.max_live_numel:
            return False  # no later use in this pass, or over the live budget already
        between = self._uses_before[nxt] - self._uses_before[self._trace_pos]
        return between <= self.max_reuse_numel

    def _evict_kept(self, numel: int) -> None:
        """Free kept units, the one used last first, until `numel` elements are free (or none is left):
        what is kept for reuse never pushes what is gathered above max_live_parameters."""

        def next_use(index: int) -> int:
            pos = self.units[index].trace_pos
            nxt = self._next_use[pos] if pos is not None and pos < len(self._next_use) else -1
            return nxt if nxt >= 0 else len(self._next_use)

        for index in sorted(self._kept, key=next_use, reverse=True):
            if numel <= 0:
                break
            u = self.units[index]
            if u.refs == 0 and not u.bwd_hold:
                numel -= u.numel
                self._free(u)

    def _drop_kept(self) -> None:
        """Free units kept for a reuse that will not come (the order changed, the pass or backward ended)."""
        for index in list(self._kept):
            self._maybe_free(self.units[index])

    def hold_for_backward(self, unit: Unit) -> None:
        """Gather `unit` for a module's backward; it is freed once its gradients are in (or backward ends)."""
        if unit.index in self._reduced and not unit.present:
            return  # gradients already final this backward: autograd will not read these weights again
        unit.bwd_hold = True
        if unit.full is None:
            self._gather(unit)
        self._traced(unit)

    def release_all(self) -> None:
        """Free every gathered, non-persistent unit (after an exception, or to drop all full weights)."""
        for u in self.units:
            u.refs = 0
            u.bwd_hold = False
            self._maybe_free(u)

    # --------------------------------------------------------------------------------- trace and prefetch
    def begin_pass(self) -> None:
        """Called at the start of a root forward: closes the recorded order of the previous pass."""
        if self.in_backward:  # the last backward raised before its end callback ran: forget its state
            self._abort_backward()
        self._drop_kept()
        if self._recording:
            if not self._trace_valid or self._recording != self.trace:
                self._set_trace(self._recording)
            self._trace_valid = True
        self._recording = []
        self._trace_pos = 0
        if self._trace_valid:
            self._prefetch_from(0)

    def _set_trace(self, trace: List[int]) -> None:
        """Adopt a recorded order of uses; precompute each use's next use and the elements in between
        (persistent units cost nothing to reuse: they never count)."""
        self.trace = trace
        self._next_use = [-1] * len(trace)
        last: Dict[int, int] = {}
        for pos in range(len(trace) - 1, -1, -1):
            self._next_use[pos] = last.get(trace[pos], -1)
            last[trace[pos]] = pos
        self._uses_before = [0] * (len(trace) + 1)
        total = 0
        for pos, index in enumerate(trace):
            self._uses_before[pos] = total
            u = self.units[index]
            total += 0 if u.persistent else u.numel
        self._uses_before[len(trace)] = total

    def _traced(self, unit: Unit) -> None:
        """Record a use of `unit` (a forward fetch or a backward hold, gathered or not: recording uses
        rather than gathers keeps the order the same whether units were kept for reuse or not)."""
        self._recording.append(unit.index)
        unit.trace_pos = None
        if not self._trace_valid:
            return
        pos = self._trace_pos
        if pos < len(self.trace) and self.trace[pos] == unit.index:
            unit.trace_pos = pos
            self._trace_pos = pos + 1
            self._prefetch_from(pos + 1)
        else:
            self._trace_valid = False  # the order changed: stop guessing until it is recorded again
            self._drop_kept()

    def _prefetch_from(self, pos: int) -> None:
        budget = self.prefetch_bucket_numel
        live = self._live_numel
        for index in self.trace[pos : pos + PREFETCH_LOOKAHEAD]:
            u = self.units[index]
            if u.present or not self.store.on_nvme(u):
                continue
            if u.numel > budget or live + u.numel > self.max_live_numel:
                break
            budget -= u.numel
            live += u.numel
            if self.store.prefetching(u):
                continue
            if not self.store.prefetch(u):
                break

    # ---------------------------------------------------------------------------------------- gradients
    def install_grad_hooks(self) -> None:
        """Per-parameter post-accumulate-grad hooks: each full gradient goes into its unit's flat buffer."""
        for u in self.units:
            for i in u.trainable:
                self._grad_hooks.append(u.params[i].register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: nn.Parameter) -> None:
        unit: Unit = p.ds_unit
        grad = p.grad
        if grad is None:
            return
        target = self.grad_sink.accumulator(unit)
        if target is not None:
            a, z = unit.param_range(p.ds_index)
            if grad.device != target.device:  # GPU gradient, host partition: blocking, the add reads it now
                grad = grad.to(target.device)
                self.device_to_host_bytes += grad.numel() * grad.element_size()
            target[a:z].add_(grad.reshape(-1))  # one pass: the gradient lands in its final place
            self._summed.add(unit.index)
        elif unit.grad_flat is None and unit.padded_numel == unit.numel and len(unit.params) == 1:
            unit.grad_flat = grad.reshape(-1)  # the gradient already is the unit's flat gradient: no copy
        else:
            if unit.grad_flat is None:
                unit.grad_flat = torch.zeros(unit.padded_numel, dtype=grad.dtype, device=grad.device)
            a, z = unit.param_range(p.ds_index)
            unit.grad_flat[a:z].copy_(grad.reshape(-1))
        p.grad = None  # the full gradient is not kept: only the partition survives
        unit.grads_seen += 1
        if unit.grads_seen == len(unit.trainable):
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        if unit.index in self._summed:  # already summed into the engine's partition by _on_grad
            self._summed.discard(unit.index)
        else:
            flat = unit.grad_flat
            if flat is None:  # no gradient reached this unit (unused in this step): its gradient is zero
                flat = torch.zeros(unit.padded_numel, dtype=unit.dtype, device=self.device)
            if self.world_size == 1:
                part = flat
            else:
                part = torch.empty(unit.part_numel, dtype=flat.dtype, device=flat.device)
                reduce_scatter_flat(part, flat, self.group)
            self.grad_sink.partition_ready(unit, part)
        unit.grad_flat = None
        unit.grads_seen = 0
        self._reduced.add(unit.index)
        unit.bwd_hold = False
        self._maybe_free(unit, keep_for_reuse=True)
        self.grad_sink.unit_final(unit)

    def end_backward(self) -> None:
        """End of a backward: reduce what no hook reduced (unused parameters: zeros), free held units."""
        for u in self.units:
            if u.trainable and u.index not in self._reduced:
                self._reduce(u)
        self._reduced.clear()
        for u in self.units:
            u.bwd_hold = False
            self._maybe_free(u)
        self.in_backward = False

    def _abort_backward(self) -> None:
        for u in self.units:
            u.grad_flat = None
            u.grads_seen = 0
            u.bwd_hold = False
            self._maybe_free(u)
        self._reduced.clear()
        self._summed.clear()
        self.in_backward = False

    # ---------------------------------------------------------------------------------- the engine's seam
    def memory_segments(self) -> List[torch.Tensor]:
        """Flat tensors holding every memory-tier partition back to back (see `store.memory_location`)."""
        return list(self.store.arena.segments)

    def read_partition(self, unit: Unit, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's partition of `unit` (a view when it lives in memory and `out` is None)."""
        if out is None:
            mem = self.store.memory_partition(unit)
            if mem is not None:
                return mem
            out = torch.empty(unit.part_numel, dtype=unit.dtype)
        self.store.read(unit, out)
        return out

    def write_partition(self, unit: Unit, values: torch.Tensor) -> None:
        """Replace this rank's partition (updated weights); a gathered copy is refreshed or dropped.

        Collective for world_size > 1 while the unit is held (its full buffer is re-gathered)."""
        self.store.write(unit, values)
        if unit.full is None or unit.full is self._aliased(unit):
            return
        if self.world_size == 1:
            unit.full[unit.lo : unit.hi].copy_(values.reshape(-1))
        elif unit.refs or unit.bwd_hold:
            own = values.reshape(-1).to(self.device, unit.dtype)
            all_gather_flat(unit.full, own, self.group)
        else:
            self._free(unit)

    def load_state_dict_shard(self, shard: Dict[str, torch.Tensor]) -> List[str]:
        """Write full tensors of some parameters (by qualified name) into their partitions, one unit in
        memory at a time; returns the names used (zero.stage3.state_dict.load_shard)."""
        return load_shard(self, shard)

    def attach(self, model: nn.Module) -> Any:
        """Partition what is not partitioned yet, install module and gradient hooks; returns the hooks."""
        if self.hooks is not None:
            raise RuntimeError("this Stage3Partitioner is already attached to a model")
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

    def gathered_state_dict(
        self, model: nn.Module, device: Union[str, torch.device] = "cpu"
    ) -> Dict[str, Any]:
        """`model.state_dict()` with whole parameters, gathering one unit at a time (collective;
        zero.stage3.state_dict.gathered_state_dict)."""
        return gathered_state_dict(self, model, device)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        self.release_all()
        self.store.close()

    def take_io_report(self) -> ParamIOReport:
        """The counts since the last call (or since construction), and start counting afresh."""
        st = self.store.stats
        report = ParamIOReport(
            param_nvme_read_bytes=st.bytes_read,
            param_nvme_write_bytes=st.bytes_written,
            param_reads=st.reads,
            param_prefetches=st.prefetches,
            param_prefetch_hits=st.prefetch_hits,
            gathers=self.gathers,
            peak_full_bytes=self.peak_full_bytes,
            device_to_host_bytes=self.device_to_host_bytes,
        )
        st.bytes_read = st.bytes_written = st.reads = st.prefetches = st.prefetch_hits = 0
        self.gathers = self.device_to_host_bytes = 0
        self.peak_full_bytes = self.live_full_bytes
        return report

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


def _fill_partition(unit: Unit, dst: torch.Tensor) -> None:
    """Write this rank's share of the unit's parameters into `dst` (part_numel elements), zeros elsewhere.

    Straight into the partition's final place: a temporary would cost one more pass over every weight."""
    covered = 0
    for s in sorted(unit.slices(), key=lambda s: s.part_lo):
        if s.part_lo > covered:
            dst[covered : s.part_lo].zero_()
        dst[s.part_lo : s.part_hi].copy_(s.param.detach().reshape(-1)[s.param_lo : s.param_hi])
        covered = max(covered, s.part_hi)
    if covered < dst.numel():
        dst[covered:].zero_()
