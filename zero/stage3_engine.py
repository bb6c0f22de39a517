"""Stage3Engine: ZeRO stage 3 / ZeRO-Infinity - parameters partitioned over ranks and tiers.

`zero.initialize` returns this engine when `zero_optimization.stage` is 3 (ZeroEngine.__new__ dispatches).
It plugs the stage-3 parameter component (zero.stage3: partitions in device memory, host memory or NVMe,
gathered per module during forward and backward) into the same optimizer machinery as stages 0-2:

* Layout. The optimizer sees one virtual flat partition per rank: the partitions of the units (one unit
  per module) that hold trainable parameters, back to back, `offsets[unit]` apart. Its fp32 master and
  states live on the `offload_optimizer` tier exactly as for stages 0-2 (DeviceState in memory, or the
  engine's OptimizerSwapper streaming sub-groups from NVMe) and are stepped by the same fused kernels.
* Gradients. The partitioner reduce-scatters each unit's gradient as soon as it is complete and calls
  `_on_grad_partition(unit, part)`: the engine adds it into `grad_host` (fp32 for fp32 models, the model's
  16-bit dtype otherwise, as stages 0-2 accumulate) at the unit's offset. On one rank there is nothing
  to reduce: the partitioner sums each parameter's gradient straight into the unit's slice of
  `grad_host` (`grad_accumulator`), one pass per gradient (from a GPU: one copy to the host each, so no
  flat unit gradient is built in device memory). No full gradient survives backward.
* Write-back. The kernel writes the new 16-bit weights of a sub-group into a staging buffer; the
  `_PartitionWriter` scatters them to the units' partitions (straight into host/device memory, or
  assembled per unit and written to its swap file through `write_partition` once the unit is complete).
* NVMe disk space. The atomic optimizer step needs two copies of the state on disk; when `nvme_path`
  cannot hold them (ZeRO-Infinity scale), the state is updated in place (one copy, a warning is issued):
  a step that fails half way then cannot be rolled back - the engine refuses further steps and saves
  (`StateCorruptedError`) until a checkpoint is loaded - and fp16 overflow is checked before the pass.
"""

from __future__ import annotations

import bisect
import shutil
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from offload.pinned import PinnedPool, default_pinned_budget
from zero.comm import settle
from zero.engine import ZeroEngine
from zero.partition import GradReadiness
from zero.stage3.partitioner import Stage3Partitioner
from zero.stage3.unit import Unit, is_partitioned

__all__ = ["Stage3Engine", "consolidated_state_dict"]

FP32_BYTES = 4
# Two copies of the NVMe optimizer state are kept when the disk has this much more room than they need.
DISK_HEADROOM = 1.05


def _disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


class _PartitionWriter:
    """Moves updated weights of an optimizer chunk into the units' parameter partitions.

    A memory-tier unit is written in place as its pieces arrive; an NVMe unit is assembled in a host buffer
    and written to its swap file once all its elements arrived, whatever the order of the chunks (forward
    order after backward, reverse order when sub-groups are stepped during backward): a unit spans at most
    the chunks in flight, so few buffers are ever held. Gathered copies (persistent units) are refreshed by
    `write_partition`.
    """

    def __init__(self, engine: Stage3Engine, chunk_numel: int) -> None:
        self.engine = engine
        self.part = engine.partitioner
        self.half = engine.dtype != torch.float32
        self.staging = torch.empty(chunk_numel, dtype=engine.dtype) if self.half else None
        self.h2d_bytes = 0  # bytes of updated weights written to the parameter tier
        self._assembly: Dict[int, torch.Tensor] = {}
        self._missing: Dict[int, int] = {}  # unit index -> elements not yet assembled

    def param_copy(self, start: int, n: int) -> Optional[torch.Tensor]:
        """Where the kernel writes this chunk's 16-bit weights (None for fp32: the master is the weight)."""
        return self.staging[:n] if self.staging is not None else None

    def after_update(self, start: int, n: int, master: torch.Tensor) -> None:
        src = self.staging[:n] if self.staging is not None else master
        self.scatter(start, n, src)

    def scatter(self, start: int, n: int, src: torch.Tensor) -> None:
        """Write `src` (elements [start, start + n) of the virtual partition, model dtype) to the units."""
        eng = self.engine
        for unit, a, z in eng.units_in(start, n):
            base = eng.offsets[unit.index] - start
            mem = self.part.store.memory_partition(unit)
            buf = mem if mem is not None else self._buffer(unit)
            for lo, hi in eng.trainable_ranges(unit):
                lo, hi = max(lo, a), min(hi, z)
                if lo < hi:
                    buf[lo:hi].copy_(src[base + lo : base + hi])
            self.h2d_bytes += (z - a) * unit.element_size
            missing = self._missing.get(unit.index, unit.part_numel) - (z - a)
            if missing > 0:
                self._missing[unit.index] = missing
                continue
            self._missing.pop(unit.index, None)
            if mem is None:
                self.part.write_partition(unit, self._assembly.pop(unit.index))
            elif unit.full is not None:
                self.part.write_partition(unit, mem)  # refresh the gathered copy of a persistent unit

    def _buffer(self, unit: Unit) -> torch.Tensor:
        buf = self._assembly.get(unit.index)
        if buf is None:
            if self.engine.is_mixed(unit):  # frozen slices keep their stored values
                # not through the staging slots: this may run on the optimizer thread during backward
                buf = torch.empty(unit.part_numel, dtype=unit.dtype)
                self.part.store.read_private(unit, buf)
            else:
                buf = torch.empty(unit.part_numel, dtype=unit.dtype)
            self._assembly[unit.index] = buf
        return buf

    def finish(self) -> None:
        # a pass stopped early (overflow, error): the engine restores from the master
        self._assembly.clear()
        self._missing.clear()

    def close(self) -> None:
        self.finish()
        self.staging = None


class Stage3Engine(ZeroEngine):
    """ZeroEngine for `zero_optimization.stage == 3`; built by `zero.initialize` (see the module doc)."""

    partitioner: Stage3Partitioner

    # ------------------------------------------------------------------------------------------- set-up
    def _setup_stage3(
        self, model: nn.Module, params: List[nn.Parameter], hyper: Dict[str, Any], off: Any
    ) -> None:
        from zero.optimizer_offload import ZeroOptimizer

        zcfg = self.config.zero_optimization
        self.flat = None  # type: ignore[assignment]  # no flat buffers at stage 3
        self._hooks = []
        configured = self.config.zero_offload.pinned_budget_bytes
        self.pool = PinnedPool(default_pinned_budget(configured))
        self._check_dtypes(model)
        # fp32 values of parameters about to be cast to 16 bits: the master starts from them (low bits kept)
        fp32_sources: Dict[int, torch.Tensor] = {}
        if self.dtype != torch.float32:
            for p in params:
                if not is_partitioned(p) and p.dtype == torch.float32:
                    fp32_sources[id(p)] = p.data
        self._cast_unpartitioned(model)
        self.module = model
        self.partitioner = Stage3Partitioner.for_model(
            model, self.config, grad_callback=self._on_grad_partition, device=self.device, pool=self.pool
        )
        part = self.partitioner
        if part.store.pool is not self.pool:
            self.pool = part.store.pool  # built under zero.Init: one pinned budget, the Init's

        # -- the optimizer's virtual partition: trainable units back to back
        wanted = {id(p) for p in params}
        self.units: List[Unit] = []
        self.offsets: Dict[int, int] = {}
        self._ranges: Dict[int, List[Tuple[int, int]]] = {}
        total = 0
        for u in part.units:
            mine = [i for i in u.trainable if id(u.params[i]) in wanted]
            if not mine:
                continue
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
        self._unit_pos = {u.index: i for i, u in enumerate(self.units)}
        self.trainable_numel = sum(
            s.param_hi - s.param_lo for u in self.units for s in u.slices() if id(s.param) in wanted
        )
        self.part_numel = total
        self.lo, self.hi = self.rank * total, (self.rank + 1) * total  # the rank's share, for checkpoints
        self.optimizer = ZeroOptimizer(params, self.rule, hyper)
        self.optimizer.engine = self

        # -- gradient partition: fp32, or the model's 16-bit dtype (accumulated as stages 0-2 do)
        grad_dtype = self.dtype
        if self.offload_device == "none":
            self.grad_host = torch.zeros(total, dtype=grad_dtype, device=self.device)
        else:
            # fresh pinned memory reads as zeros: a zero_() pass would only fault every page in now
            self.grad_host = self._pinned(total, "the gradient partition", grad_dtype)
        self._grads_aliased = True  # the callback writes grad_host directly: nothing to copy at the step

        # -- master + states on the optimizer tier (streamed from the partitions: never whole for NVMe)
        sub_group = max(1, int(zcfg.sub_group_size))
        copies = 2
        if self.offload_device == "nvme":
            copies = self._swap_copies(off, total)
        self._init_state(self._master_filler(fp32_sources), False, sub_group, off, swap_copies=copies)
        fp32_sources.clear()
        self._setup_overlap(off)
        part.on_grad_final = self._unit_grad_final
        part.grad_accumulator = self._grad_target
        self.reducer = None
        st = part.store.stats  # building and initialising are not part of the first step's report
        st.bytes_read = st.bytes_written = st.reads = st.prefetches = st.prefetch_hits = 0
        part.gathers = 0

    def _check_dtypes(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            u = getattr(p, "ds_unit", None)
            if u is not None and u.dtype.is_floating_point and u.dtype != self.dtype:
                raise ValueError(
                    f"parameter {name!r} was partitioned (zero.Init) as {u.dtype} but the config trains in "
                    f"{self.dtype} (fp16/bf16 keys): build the model under zero.Init(config=<this config>) "
                    f"or pass dtype={self.dtype} to Init"
                )

    def _cast_unpartitioned(self, model: nn.Module) -> None:
        """What `model.to(device).to(dtype)` does at stages 0-2, for what is not partitioned yet."""
        with torch.no_grad():
            for m in model.modules():
                for p in m._parameters.values():
                    if p is None or is_partitioned(p):
                        continue
                    if p.is_floating_point() and p.dtype != self.dtype:
                        p.data = p.data.to(dtype=self.dtype)
                for key, b in m._buffers.items():
                    if b is None:
                        continue
                    dtype = self.dtype if b.is_floating_point() else b.dtype
                    m._buffers[key] = b.to(device=self.device, dtype=dtype)

    def _swap_copies(self, off: Any, total: int) -> int:
        """2 (atomic steps) when the disk at nvme_path has room for two copies of the state, else 1."""
        one = total * (1 + self.rule.n_states) * FP32_BYTES
        free = _disk_free(off.nvme_path)
        if 2 * one * DISK_HEADROOM <= free:
            return 2
        warnings.warn(
            f"offload_optimizer.nvme_path={off.nvme_path!r} has {free} bytes free, not enough for two copies "
            f"of the optimizer state ({2 * one} bytes): the state is updated in place, so a step that fails "
            "half way (I/O error) cannot be rolled back",
            stacklevel=4,
        )
        return 1

    def _master_filler(self, fp32_sources: Dict[int, torch.Tensor]) -> Any:
        """fill(start, n, out): the initial fp32 master of [start, start + n), read unit by unit."""
        cache: Dict[str, Any] = {"unit": None, "values": None}

        def values_of(u: Unit) -> torch.Tensor:
            if cache["unit"] is u.index:
                return cache["values"]
            if all(id(s.param) in fp32_sources for s in u.slices()):
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

    def _make_writer(self, aliased: bool, chunk_numel: int) -> Any:
        return _PartitionWriter(self, chunk_numel)

    # ----------------------------------------------------------------------------------------- layout
    def units_in(self, start: int, n: int) -> Iterator[Tuple[Unit, int, int]]:
        """(unit, a, z): the units overlapping [start, start + n) of the virtual partition, with the
        overlap as [a, z) in the unit's partition coordinates."""
        end = start + n
        i = bisect.bisect_right(self._starts, start) - 1
        while i < len(self.units) and self._starts[i] < end:
            u = self.units[i]
            off = self._starts[i]
            a, z = max(start, off) - off, min(end, off + u.part_numel) - off
            if a < z:
                yield u, a, z
            i += 1

    def trainable_ranges(self, unit: Unit) -> List[Tuple[int, int]]:
        return self._ranges.get(unit.index, [(0, unit.part_numel)])

    def is_mixed(self, unit: Unit) -> bool:
        return unit.index in self._ranges

    # -------------------------------------------------------------------------------------- gradients
    def _on_grad_partition(self, unit: Unit, grad_partition: torch.Tensor) -> None:
        off = self.offsets.get(unit.index)
        if off is None:  # requires_grad but not given to the optimizer (model_parameters subset)
            return
        dst = self.grad_host[off : off + unit.part_numel]
        # blocking: the add reads the copy at once (a non_blocking device->host copy may still be in flight)
        dst.add_(grad_partition.reshape(-1).to(dst.device, dst.dtype))
        self._clock.current.device_to_host_bytes += grad_partition.numel() * grad_partition.element_size()

    def _make_grad_gate(self, chunks: List[Tuple[int, int]]) -> GradReadiness:
        """Sources are units: a unit's gradient partition is final once the partitioner reduced it."""
        return GradReadiness([(self.offsets[u.index], u.part_numel) for u in self.units], chunks)

    def _early_grads(self) -> torch.Tensor:
        return self.grad_host

    def _unit_grad_final(self, unit: Unit) -> None:
        """Called by the partitioner once a unit's gradient is in grad_host and its gathered weights are
        released: backward will not read them again, so the optimizer may step and rewrite them now."""
        if self._early_thread is not None:
            pos = self._unit_pos.get(unit.index)
            if pos is not None:
                self._early_gate.param_ready(pos)  # type: ignore[union-attr]

    def _grad_target(self, unit: Unit) -> Optional[torch.Tensor]:
        """Where the partitioner may sum `unit`'s parameter gradients directly: its slice of grad_host, on
        one rank when grad_host has the gradients' dtype. On a GPU each parameter's gradient then goes to
        the host on its own, instead of through a flat copy of the unit's gradient in device memory."""
        off = self.offsets.get(unit.index)
        host = self.grad_host
        if off is None or self.world_size != 1 or host.dtype != unit.dtype:
            return None
        return host[off : off + unit.part_numel]

    def zero_grad(self) -> None:
        self._discard_early_pass()  # it read gradients that are being cleared
        if self.grad_host is not None:
            self.grad_host.zero_()

    # ----------------------------------------------------------------------------------------- update
    def _allgather_params(self) -> None:
        """Nothing to gather: every rank wrote its own partitions; forward gathers them when needed."""

    def _write_from_master(self) -> None:
        """Set every trainable partition to the (committed) master, cast to the model dtype."""
        writer = self._writer
        writer.finish()  # units half-assembled by a pass that stopped are rewritten whole from here

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            writer.scatter(start, n, master.to(self.dtype))

        self._state.read_all(put)

    def _put_master_in_params(self) -> None:
        self._write_from_master()

    def _master_from_module(self) -> Any:
        """The partitions' current values as fp32, unit by unit (what the master started from)."""
        return self._master_filler({})

    def _device_step(self, step: int, group: Dict[str, Any], grad_scale: float) -> None:
        opt = self._torch_opt
        assert opt is not None
        g = opt.param_groups[0]
        for k in ("lr", "betas", "eps", "weight_decay"):
            g[k] = group[k]
        self._device_param.grad = self.grad_host.float().div_(grad_scale)
        opt.state[self._device_param]["step"].fill_(step - 1)
        opt.step()
        self._device_param.grad = None
        self._write_from_master()

    def _finish_report(self) -> Any:
        rep = super()._finish_report()
        rep.device_to_host_bytes += self.partitioner.device_to_host_bytes  # gradients summed per parameter
        self.partitioner.device_to_host_bytes = 0
        st = self.partitioner.store.stats
        self.last_param_io = {
            "param_nvme_read_bytes": st.bytes_read,
            "param_nvme_write_bytes": st.bytes_written,
            "param_reads": st.reads,
            "param_prefetches": st.prefetches,
            "param_prefetch_hits": st.prefetch_hits,
            "gathers": self.partitioner.gathers,
            "peak_full_bytes": self.partitioner.peak_full_bytes,
        }
        st.bytes_read = st.bytes_written = st.reads = st.prefetches = st.prefetch_hits = 0
        self.partitioner.gathers = 0
        return rep

    @property
    def nvme_bytes(self) -> int:
        """Bytes of swap files: optimizer state plus parameter partitions."""
        return super().nvme_bytes + self.partitioner.store.bytes_on_disk

    @property
    def optimizer_nvme_bytes(self) -> int:
        return self._space.bytes_allocated if self._space is not None else 0

    # ------------------------------------------------------------------------------------ consolidation
    def _zero3_consolidated_16bit_state_dict(self) -> Dict[str, torch.Tensor]:
        """DeepSpeed's name: the whole model's state dict in the model dtype (collective)."""
        return consolidated_state_dict(self)

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Gather the whole model and save its state dict (model dtype) as `save_dir/save_filename` on rank
        0, like DeepSpeed's; every rank must call it. Returns True."""
        import os

        self.check_state_usable()
        sd = consolidated_state_dict(self)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        if self.world_size > 1:
            dist.barrier()
        return True

    def fp32_master_state_dict(self) -> Dict[str, torch.Tensor]:
        """The trainable parameters' fp32 master values, whole (collective; gathers one unit at a time)."""
        self._discard_early_pass()
        self._settle_write_back()
        master = torch.empty(self.part_numel, dtype=torch.float32)

        def take(start: int, n: int, m: torch.Tensor, st: List[torch.Tensor]) -> None:
            master[start : start + n].copy_(m)

        self._state.read_all(take)
        out: Dict[str, torch.Tensor] = {}
        for u in self.units:
            off = self.offsets[u.index]
            own = master[off : off + u.part_numel]
            if self.world_size > 1:
                comm_dev = self.device if self.device.type == "cuda" else torch.device("cpu")
                full = torch.empty(u.padded_numel, dtype=torch.float32, device=comm_dev)
                settle(dist.all_gather_into_tensor(full, own.to(comm_dev), async_op=True))
                full = full.cpu()
            else:
                full = own
            for i, name in enumerate(u.param_names):
                if i in u.trainable:
                    a, z = u.param_range(i)
                    out[name] = full[a:z].view(u.shapes[i]).clone()
        return out

    # ---------------------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Remove hooks, free pinned memory and remove swap files. The module's parameters stay
        partitioned (empty) afterwards: take `zero.consolidated_state_dict(engine)` before closing."""
        if self._closed:
            return
        self._closed = True
        self._close_optimizer_state()
        self.partitioner.close()

    def __repr__(self) -> str:
        return (
            f"Stage3Engine(offload_param={self.partitioner.store.tier}, "
            f"offload_optimizer={self.offload_device}, "
            f"dtype={self.dtype}, rank={self.rank}/{self.world_size}, units={len(self.units)}, "
            f"params={self.trainable_numel}, device={self.device})"
        )


def consolidated_state_dict(engine: ZeroEngine, fp32: bool = False) -> Dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU, whatever the stage (collective at stage 3: every rank
    calls it). `fp32=True`: trainable parameters from the fp32 master instead of the model-dtype weights."""
    if isinstance(engine, Stage3Engine):
        sd = engine.partitioner.gathered_state_dict(engine.module)
        if fp32:
            sd.update(engine.fp32_master_state_dict())
        return sd
    sd = {k: v.detach().to("cpu").clone() for k, v in engine.module.state_dict().items()}
    if fp32:
        master = engine.optimizer_state_dict()["master"]
        if engine.world_size > 1 and engine.stage >= 1:
            full = torch.empty(engine.flat.padded_numel, dtype=torch.float32)
            settle(dist.all_gather_into_tensor(full, master, async_op=True))
            master = full
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for p, a, n in zip(engine.flat.params, engine.flat.offsets, engine.flat.numels):
            sd[names[id(p)]] = master[a : a + n].view(p.shape).clone()
    return sd
