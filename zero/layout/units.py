"""UnitLayout: stage 3 (ZeRO-3 / ZeRO-Infinity). Parameters are partitioned over ranks and tiers per unit
(one unit per module) by the stage-3 partitioner (zero.stage3), gathered during forward and backward.

* The optimizer's partition: the partitions of the units that hold trainable parameters, back to back,
  `offsets[unit]` apart (a mixed unit, trainable and frozen, updates only its trainable slices).
* Gradients: the partitioner reduce-scatters each unit's gradient as soon as it is complete and hands the
  rank's partition to this layout (its `GradSink`), which adds it into `grad_host` at the unit's offset
  (fp32 for fp32 models, the model's 16-bit dtype otherwise). On one rank the partitioner sums each
  parameter's gradient straight into the unit's slice (`accumulator`): from a GPU one copy per parameter,
  no flat unit gradient in device memory. No full gradient survives backward.
* Write-back: `UnitParamWriter` scatters each chunk's new weights into the units' partitions.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from offload.config.loader import ZeroOffloadConfig
from offload.pinned import PinnedPool
from zero.layout.base import Fill, Placement, allocate_pinned, cast_parameters, index_names
from zero.layout.grad_fetch import DeviceGradFetch
from zero.layout.param_writer import ParamWriter, UnitParamWriter
from zero.layout.partition import GradReadiness
from zero.stage3.comm import all_gather_unit
from zero.stage3.partitioner import Stage3Partitioner
from zero.stage3.unit import Unit, is_partitioned

__all__ = ["UnitLayout"]


class _UnitGrads:
    """The partitioner's gradient sink: routes each unit's gradient partition into `grad_host`."""

    def __init__(self, on_final: Optional[Callable[[int], None]]) -> None:
        self.layout: Optional[UnitLayout] = None  # set once the units are known (before any backward)
        self.on_final = on_final
        self.device_to_host_bytes = 0

    def accumulator(self, unit: Unit) -> Optional[torch.Tensor]:
        """Where the partitioner may sum `unit`'s parameter gradients directly: its slice of grad_host, on
        one rank when grad_host has the gradients' dtype."""
        lay = self.layout
        off = lay.offsets.get(unit.index) if lay is not None else None
        if off is None or lay.place.world_size != 1 or lay.grad_host.dtype != unit.dtype:
            return None
        return lay.grad_host[off : off + unit.part_numel]

    def partition_ready(self, unit: Unit, grad_partition: torch.Tensor) -> None:
        lay = self.layout
        off = lay.offsets.get(unit.index) if lay is not None else None
        if off is None:  # requires_grad but not given to the optimizer (model_parameters subset)
            return
        dst = lay.grad_host[off : off + unit.part_numel]
        # blocking: the add reads the copy at once (a non_blocking device->host copy may still be in flight)
        dst.add_(grad_partition.reshape(-1).to(dst.device, dst.dtype))
        self.device_to_host_bytes += grad_partition.numel() * grad_partition.element_size()

    def unit_final(self, unit: Unit) -> None:
        """The unit's gradient is in grad_host and its gathered weights are released: backward will not
        read them again, so the optimizer may step and rewrite them now."""
        lay = self.layout
        if self.on_final is not None and lay is not None:
            pos = lay.unit_pos.get(unit.index)
            if pos is not None:
                self.on_final(pos)


class UnitLayout:
    """The layout of stage 3 (see the module doc). `on_grad(i)` is told when the i-th trainable unit's
    gradient is final in a backward."""

    reducer = None
    gathers_after_step = False

    def __init__(
        self,
        model: nn.Module,
        params: List[nn.Parameter],
        place: Placement,
        pool: PinnedPool,
        config: ZeroOffloadConfig,
        on_grad: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.place = place
        dtype = place.dtype
        _check_dtypes(model, dtype)
        # fp32 values of parameters about to be cast to 16 bits: the master starts from them (low bits kept)
        self._fp32_sources: Dict[int, torch.Tensor] = {}
        if dtype != torch.float32:
            for p in params:
                if not is_partitioned(p) and p.dtype == torch.float32:
                    self._fp32_sources[id(p)] = p.data
        _cast_unpartitioned(model, place.device, dtype)
        self.module = model
        self._sink = _UnitGrads(on_grad)
        self.partitioner = Stage3Partitioner.for_model(
            model, config, grad_sink=self._sink, device=place.device, pool=pool
        )
        part = self.partitioner
        self.pool = part.pool  # built under zero.Init: one pinned budget, the Init's

        # -- the optimizer's partition: trainable units back to back
        wanted = {id(p) for p in params}
        self.units: List[Unit] = []
        self.offsets: Dict[int, int] = {}
        self._ranges: Dict[int, List[Tuple[int, int]]] = {}
        self._trained: Dict[int, List[int]] = {}  # unit -> its parameters the optimizer updates
        total = 0
        for u in part.units:
            mine = [i for i in u.trainable if id(u.params[i]) in wanted]
            if not mine:
                continue
            self._trained[u.index] = mine
            self.units.append(u)
            self.offsets[u.index] = total
            total += u.part_numel
            if len(mine) < len(u.params):  # mixed unit: only the trainable parameters' slices are updated
                self._ranges[u.index] = [
                    (s.part_lo, s.part_hi)
                    for s in u.slices()
                    if id(s.param) in wanted and s.param.requires_grad
                ]
        if not self.units:
            raise ValueError("stage 3: the model has no trainable parameters to optimize")
        self._starts = [self.offsets[u.index] for u in self.units]
        self.unit_pos = {u.index: i for i, u in enumerate(self.units)}
        self.trainable_numel = sum(
            s.param_hi - s.param_lo for u in self.units for s in u.slices() if id(s.param) in wanted
        )
        self.part_numel = self.padded_numel = total
        self.lo, self.hi = place.rank * total, (place.rank + 1) * total  # the rank's share, for checkpoints

        # -- gradient partition: fp32, or the model's 16-bit dtype (accumulated as stages 0-2 do)
        if place.optimizer_tier == "none":
            self.grad_host = torch.zeros(total, dtype=dtype, device=place.device)
        else:
            # fresh pinned memory reads as zeros: a zero_() pass would only fault every page in now; only the
            # host share's gradients are pinned (the device share's are pageable; its update copies them)
            d = place.device_share(total)
            self.grad_host = allocate_pinned(
                self.pool, total, "the gradient partition", dtype, pinned=(d, total)
            )
        self._sink.layout = self

    # ----------------------------------------------------------------------------------- the units
    def units_in(self, start: int, n: int) -> Iterator[Tuple[Unit, int, int]]:
        """(unit, a, z): the units overlapping [start, start + n) of the partition, with the overlap as
        [a, z) in the unit's partition coordinates."""
        end = start + n
        i = bisect.bisect_right(self._starts, start) - 1
        while i < len(self.units) and self._starts[i] < end:
            u = self.units[i]
            off = self._starts[i]
            a, z = max(start, off) - off, min(end, off + u.part_numel) - off
            if a < z:
                yield u, a, z
            i += 1

    def param_spans(self) -> List[Tuple[int, int, nn.Parameter]]:
        """[start, end) of each parameter's elements in the rank's partition, with the parameter (frozen
        slices of a mixed unit too: the optimizer never writes them back)."""
        return [
            (self.offsets[u.index] + s.part_lo, self.offsets[u.index] + s.part_hi, s.param)
            for u in self.units
            for s in u.slices()
        ]

    def trainable_ranges(self, unit: Unit) -> List[Tuple[int, int]]:
        """[start, end) of the trainable elements in `unit`'s partition (all of it unless partly frozen)."""
        return self._ranges.get(unit.index, [(0, unit.part_numel)])

    def is_mixed(self, unit: Unit) -> bool:
        """Whether `unit` holds both trainable and frozen parameters."""
        return unit.index in self._ranges

    # ---------------------------------------------------------------------------------- the master
    def master_init(self) -> Union[torch.Tensor, Fill]:
        """fill(start, n, out) for the initial master (the fp32 sources are dropped after the first use)."""
        sources, self._fp32_sources = self._fp32_sources, {}
        return self._filler(sources)

    def master_alias(self) -> Optional[torch.Tensor]:
        """None: the master never shares storage with stage-3 partitions."""
        return None

    def master_from_module(self) -> Fill:
        """The partitions' current values as fp32, unit by unit."""
        return self._filler({})

    def _filler(self, fp32_sources: Dict[int, torch.Tensor]) -> Fill:
        cache: Dict[str, Any] = {"unit": None, "values": None}

        def values_of(u: Unit) -> torch.Tensor:
            if cache["unit"] is u.index:
                return cache["values"]
            if fp32_sources and all(id(s.param) in fp32_sources for s in u.slices()):
                vals = torch.zeros(u.part_numel, dtype=torch.float32)
                for s in u.slices():
                    src = fp32_sources[id(s.param)].reshape(-1)[s.param_lo : s.param_hi]
                    vals[s.part_lo : s.part_hi].copy_(src)
            else:  # a view of a memory-tier partition (no copy); read into a new tensor from NVMe
                vals = self.partitioner.read_partition(u).float()
            cache["unit"], cache["values"] = u.index, vals
            return vals

        def fill(start: int, n: int, out: torch.Tensor) -> None:
            # units lie back to back from 0 to part_numel: only the padding after the last one needs zeros
            out[max(0, min(n, self.part_numel - start)) :].zero_()
            for u, a, z in self.units_in(start, n):
                base = self.offsets[u.index] - start
                out[base + a : base + z].copy_(values_of(u)[a:z])

        return fill

    def make_writer(self, chunk_numel: int) -> ParamWriter:
        """A UnitParamWriter casting master chunks into the units' partitions."""
        return UnitParamWriter(self, self.place.dtype, chunk_numel)

    def put_master(self, writer: ParamWriter, tier: Any) -> None:
        """Set every trainable partition to the committed master, cast to the model dtype."""
        assert isinstance(writer, UnitParamWriter)
        writer.finish()  # units half-assembled by a pass that stopped are rewritten whole from here
        dtype = self.place.dtype

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            writer.scatter(start, n, master.to(dtype))

        tier.read_all(put)

    # ----------------------------------------------------------------------------------- gradients
    def grad_gate(self, chunks: List[Tuple[int, int]]) -> Tuple[GradReadiness, Optional[DeviceGradFetch]]:
        """Sources are units: a unit's gradient partition is final once the partitioner reduced it."""
        return GradReadiness([(self.offsets[u.index], u.part_numel) for u in self.units], chunks), None

    def early_grads(self, fetching: bool) -> torch.Tensor:
        """grad_host: the partitioner writes each unit's reduced gradient there during backward."""
        return self.grad_host

    def gradients_to_host(self) -> int:
        """0: the gradient sink already wrote grad_host during backward."""
        return 0  # the sink wrote grad_host during backward

    def device_grad(self, grad_scale: float) -> torch.Tensor:
        """grad_host as a new fp32 tensor divided by `grad_scale`."""
        return self.grad_host.float().div_(grad_scale)

    def zero_grads(self) -> None:
        """Zero the gradient partition."""
        self.grad_host.zero_()

    def after_step(self) -> None:
        """Nothing to gather: every rank wrote its own partitions; forward gathers them when needed."""

    def take_param_io(self) -> Optional[Dict[str, int]]:
        """The parameter tier's counts since the last call (and the gradients' device-to-host bytes)."""
        io = self.partitioner.take_io_report().as_dict()
        io["device_to_host_bytes"] += self._sink.device_to_host_bytes
        self._sink.device_to_host_bytes = 0
        return io

    @property
    def param_nvme_bytes(self) -> int:
        """Bytes of the parameter partitions in the store's NVMe swap files."""
        return self.partitioner.bytes_on_disk

    # ------------------------------------------------------------------------------- state dicts
    def module_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model's state dict, gathered unit by unit (collective)."""
        return self.partitioner.gathered_state_dict(self.module)

    def master_state_dict(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The trainable parameters from `master`, gathered one unit at a time (collective)."""
        device, world = self.place.device, self.place.world_size
        out: Dict[str, torch.Tensor] = {}
        for u in self.units:
            off = self.offsets[u.index]
            own = master[off : off + u.part_numel]
            if world > 1:
                comm_dev = device if device.type == "cuda" else torch.device("cpu")
                full = torch.empty(u.padded_numel, dtype=torch.float32, device=comm_dev)
                all_gather_unit(u, full, own.to(comm_dev), None)
                full = full.cpu()
            else:
                full = own
            for i, name in enumerate(u.param_names):
                if i in u.trainable:
                    a, z = u.param_range(i)
                    out[name] = full[a:z].view(u.shapes[i]).clone()
        return out

    def master_index(self) -> Dict[str, Any]:
        """What each element of the master and of the parameter partitions is, for readers of checkpoints
        (zero.checkpoint.to_fp32): every unit of the partitioner in order, as a list of its parameters
        `[[name, *tied aliases], shape, trained]` (each parameter split over ranks as `Unit` does, a rank's
        chunks back to back in its partition of the unit; units with a trained
        parameter are the master's, back to back); the state dict's keys and buffers. Plain types only."""
        names, keys, buffers = index_names(self.module)
        units = []
        for u in self.partitioner.units:
            trained = set(self._trained.get(u.index, []))
            units.append(
                [
                    [names.get(id(p), []), list(shape), i in trained]
                    for i, (p, shape) in enumerate(zip(u.params, u.shapes))
                ]
            )
        return {"kind": "units", "keys": keys, "buffers": buffers, "units": units}

    # ------------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove hooks and free the partitions' buffers. The parameters stay partitioned (empty)."""
        self.grad_host = None  # type: ignore[assignment]
        self.partitioner.close()

    def describe(self) -> str:
        """The parameter tier, unit count and trainable elements, for logs."""
        return f"stage=3, offload_param={self.partitioner.tier}, units={len(self.units)}, " + (
            f"params={self.trainable_numel}"
        )


def _check_dtypes(model: nn.Module, dtype: torch.dtype) -> None:
    for name, p in model.named_parameters():
        u = getattr(p, "ds_unit", None)
        if u is not None and u.dtype.is_floating_point and u.dtype != dtype:
            raise ValueError(
                f"parameter {name!r} was partitioned (zero.Init) as {u.dtype} but the config trains in "
                f"{dtype} (fp16/bf16 keys): build the model under zero.Init(config=<this config>) "
                f"or pass dtype={dtype} to Init"
            )


def _cast_unpartitioned(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """For what is not partitioned yet: parameters to the compute dtype (`cast_parameters`), buffers to the
    device in their own dtype."""
    cast_parameters(model, dtype, skip=is_partitioned)
    with torch.no_grad():
        for m in model.modules():
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = b.to(device=device)
