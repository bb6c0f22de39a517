"""FlatLayout: stages 0-2. The trainable parameters are views of one flat buffer; the rank's optimizer
partition is a slice [lo, hi) of it (stage 0, or one rank: all of it).

Stages 0-1: gradients accumulate straight into a flat gradient buffer of the whole model (the parameters'
`.grad`s are views of it), as DeepSpeed's stage 1 keeps them. At the end of an accumulation window,
post-accumulate-grad hooks send full buckets to the other ranks while backward goes on (`GradReducer`:
stage 1 reduces each bucket only to the ranks owning it, stage 0 all-reduces), and the rank's slice is
copied once to the fp32 gradient partition `grad_host` (on a CPU-only machine with fp32 weights the
gradient buffer already is that partition).

Stage 2: no gradient buffer of the model's size. Every backward, each gradient goes into a bucket of
`reduce_bucket_size` elements as autograd produces it, and each full bucket is reduced to the ranks owning
its elements and added into the rank's gradient partition `grad_host` (`GradBuckets`): pinned fp32 host
memory when the optimizer is offloaded, the device in the model dtype otherwise.

After the optimizer pass, stages 1-2 all-gather the updated partitions.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from offload.config.zero import ZeroConfig
from offload.pinned import PinnedPool
from zero.comm import settle
from zero.layout.base import Fill, GradMemory, Placement, allocate_pinned, cast_parameters, index_names
from zero.layout.grad_buckets import GradBuckets
from zero.layout.grad_fetch import DeviceGradFetch, copy_to_host
from zero.layout.param_writer import FlatParamWriter, ParamWriter
from zero.layout.partition import FlatParams, GradReadiness, GradReducer, partition_range

__all__ = ["FlatLayout"]


class FlatLayout:
    """The layout of stages 0-2 (see the module doc). `on_grad(i)` is told when parameter i's gradient
    is final in a backward (the optimizer pass during backward waits on it)."""

    partitioner = None

    def __init__(
        self,
        model: nn.Module,
        params: List[nn.Parameter],
        place: Placement,
        pool: PinnedPool,
        zcfg: ZeroConfig,
        on_grad: Any = None,
    ) -> None:
        self.place = place
        self.pool = pool
        device, dtype, tier = place.device, place.dtype, place.optimizer_tier
        # Remember fp32 weights before a cast to 16 bits loses their low bits. fp32 weights stay exact in
        # the flat buffer: the master is filled from there, no full-size copy.
        fp32_weights: Optional[torch.Tensor] = None
        if dtype != torch.float32:
            fp32_weights = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])
        model.to(device)
        if dtype != torch.float32:
            cast_parameters(model, dtype)
        self.module = model
        host_is_device = device.type == "cpu"
        # fp32 weights on the host: the master *is* the parameter buffer (nothing to copy back)
        self._aliased = host_is_device and dtype == torch.float32 and tier in ("none", "cpu")
        alloc = None
        if self._aliased and tier == "cpu":

            def alloc(numel: int, dt: torch.dtype) -> torch.Tensor:
                # the master is the partition's slice: pinned where the host steps it, the device share not
                return allocate_pinned(
                    pool, numel, "the flat parameter buffers", dt, pinned=self._host_share(numel)
                )

        self.buckets: Optional[GradBuckets] = None
        bucketed = place.stage == 2
        self.flat = FlatParams(params, place.world_size, alloc=alloc, grads=not bucketed)
        self.lo, self.hi = self._partition(self.flat.padded_numel)
        self.part_numel = self.hi - self.lo
        self.padded_numel = self.flat.padded_numel  # all ranks' partitions together
        self.trainable_numel = self.flat.numel

        # the rank's gradient partition as the optimizer reads it
        self._grads_on_host = host_is_device and dtype == torch.float32 and not bucketed
        if self._grads_on_host:
            self.grad_host = self.flat.grad_buffer[self.lo : self.hi]
        elif tier == "none":
            # stage 2: accumulated in the model dtype (DeepSpeed's 16-bit partition); fp32 at the step
            self.grad_host = torch.zeros(
                self.part_numel, dtype=dtype if bucketed else torch.float32, device=device
            )
        else:
            # fresh pinned memory reads as zeros: a zero_() pass would only fault every page in now; only the
            # host share's gradients are pinned (the device share's are pageable; its update copies them)
            d = place.device_share(self.part_numel)
            self.grad_host = allocate_pinned(
                pool, self.part_numel, "the fp32 gradient partition", pinned=(d, self.part_numel)
            )
        self._fp32_weights = fp32_weights
        self._on_grad = on_grad

        self.reducer: Optional[Any] = None
        if bucketed:
            self.buckets = GradBuckets(
                self.flat,
                self.grad_host,
                self.lo,
                rank=place.rank,
                world_size=place.world_size,
                bucket_numel=int(zcfg.reduce_bucket_size),
                overlap=bool(zcfg.overlap_comm),
                device=device,
                dtype=dtype,
                pinned=lambda numel, dt: allocate_pinned(pool, numel, "the gradient bucket staging", dt),
                unpin=pool.free,
                on_final=self._final_grad,
            )
            self.reducer = self.buckets
        elif place.world_size > 1:
            self.reducer = GradReducer(
                self.flat,
                stage=place.stage,
                rank=place.rank,
                world_size=place.world_size,
                bucket_numel=int(zcfg.reduce_bucket_size),
                overlap=bool(zcfg.overlap_comm),
            )
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(params)]

    def _partition(self, padded_numel: int) -> Tuple[int, int]:
        """[lo, hi): the rank's optimizer partition of a flat buffer of `padded_numel` elements."""
        place = self.place
        if place.stage == 0 or place.world_size == 1:
            return 0, padded_numel
        return partition_range(padded_numel, place.rank, place.world_size)

    def _host_share(self, padded_numel: int) -> Tuple[int, int]:
        """[start, end) of a flat buffer of `padded_numel` elements the host steps: the rank's partition
        after its device share."""
        lo, hi = self._partition(padded_numel)
        return lo + self.place.device_share(hi - lo), hi

    def param_spans(self) -> List[Tuple[int, int, nn.Parameter]]:
        """[start, end) of each trainable parameter's elements in the rank's partition, with the parameter
        (those with no element in it are left out)."""
        out = []
        for p, off, n in zip(self.flat.params, self.flat.offsets, self.flat.numels):
            a, z = max(off, self.lo), min(off + n, self.hi)
            if a < z:
                out.append((a - self.lo, z - self.lo, p))
        return out

    def _final_grad(self, index: int) -> None:
        if self._on_grad is not None:
            self._on_grad(index)

    def _grad_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self.buckets is not None:  # stage 2: into a bucket; ready once it reached grad_host
                self.buckets.grad_ready(index, param)
                return
            self.flat.claim_grad(index)
            if self.reducer is not None:
                self.reducer.grad_ready(index)
            if self._on_grad is not None:
                self._on_grad(index)

        return hook

    # ---------------------------------------------------------------------------------- the master
    def master_init(self) -> Union[torch.Tensor, Fill]:
        """The initial fp32 master of the partition (taken once: the fp32 copy is dropped after)."""
        fp32_weights, self._fp32_weights = self._fp32_weights, None
        if fp32_weights is None:
            return self.master_from_module()  # the padding is zero there too
        init = torch.zeros(self.part_numel, dtype=torch.float32)
        real = max(0, min(self.hi, self.flat.numel) - self.lo)
        init[:real] = fp32_weights[self.lo : self.lo + real]
        return init

    def master_alias(self) -> Optional[torch.Tensor]:
        """The flat buffer's partition slice when the master shares its storage, else None."""
        return self.flat.param_buffer[self.lo : self.hi] if self._aliased else None

    def master_from_module(self) -> Fill:
        """fill(start, n, out): the module's weights of [start, start + n) of the partition, as fp32."""
        buf, lo = self.flat.param_buffer, self.lo  # the parameters are views of it; the padding is zero

        def fill(start: int, n: int, out: torch.Tensor) -> None:
            src = buf[lo + start : lo + start + n]
            if out.data_ptr() != src.data_ptr():  # aliased (fp32 on the host): the master is the weights
                out.copy_(src)

        return fill

    def make_writer(self, chunk_numel: int) -> ParamWriter:
        """A FlatParamWriter over the partition, staged through the pinned pool on CUDA."""
        cuda = self.place.device.type == "cuda"
        return FlatParamWriter(self.flat, self.lo, self._aliased, chunk_numel, self.pool if cuda else None)

    def put_master(self, writer: ParamWriter, tier: Any) -> None:
        """Copy the committed master into the flat parameter buffer."""
        target, lo = self.flat.param_buffer, self.lo

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            target[lo + start : lo + start + n].copy_(master)

        tier.read_all(put)

    # ----------------------------------------------------------------------------------- gradients
    def grad_gate(self, chunks: List[Tuple[int, int]]) -> Tuple[GradReadiness, Optional[DeviceGradFetch]]:
        """Readiness of the optimizer's chunks; sources are the flat buffer's parameters. On a GPU each
        chunk's gradients are copied to the pinned host partition as the chunk completes. Stage 2: a
        parameter is ready once its bucket reached grad_host (buckets no larger than a chunk); nothing to
        fetch."""
        if self.buckets is not None:
            self.buckets.cap(max(n for _, n in chunks))
            return GradReadiness.for_flat(self.flat, self.lo, chunks), None
        if self.place.device.type == "cuda":
            src = self.flat.grad_buffer[self.lo : self.hi]
            fetch = DeviceGradFetch(src, self.grad_host, chunks, self.place.device)
            return GradReadiness.for_flat(self.flat, self.lo, chunks, fetch.chunk_ready), fetch
        return GradReadiness.for_flat(self.flat, self.lo, chunks), None

    def early_grads(self, fetching: bool) -> torch.Tensor:
        """The gradients a pass during backward reads: the host partition the fetch fills, or else the
        gradient buffer itself (the kernel reads 16-bit gradients in place, never copied)."""
        if self.buckets is not None:
            return self.grad_host
        return self.grad_host if fetching else self.flat.grad_buffer[self.lo : self.hi]

    def gradients_to_host(self) -> int:
        """The partition's gradients into grad_host after backward; returns the bytes copied.

        From 16-bit GPU gradients in pieces (`D2H_PIECE_NUMEL`): a non-blocking copy that changes dtype
        converts on the GPU first, into a temporary as large as what it copies. Stage 2: the buckets
        already moved them; the bytes they moved to the host since the last step."""
        if self.buckets is not None:
            return self.buckets.take_host_bytes()
        if self._grads_on_host:
            return 0
        src = self.flat.grad_buffer[self.lo : self.hi]
        copy_to_host(self.grad_host, src, 0, src.numel())
        if src.is_cuda:
            torch.cuda.current_stream(self.place.device).synchronize()
        return self.part_numel * self.flat.grad_buffer.element_size()

    def moved_grad_bytes(self) -> int:
        """Gradient bytes stage 2's buckets moved from the device to the host since the last call (0 at
        stages 0-1, whose copies the overlap's fetch or `gradients_to_host` count)."""
        return self.buckets.take_host_bytes() if self.buckets is not None else 0

    def device_grad(self, grad_scale: float) -> torch.Tensor:
        """The partition's gradients as fp32, divided by `grad_scale` (a new tensor from 16 bits; in place
        from fp32)."""
        return self.grad_host.float().div_(grad_scale)

    def zero_grads(self) -> None:
        """Zero the gradient buckets (stage 2) or the flat gradient buffer."""
        if self.buckets is not None:
            self.buckets.zero()  # the next gradients overwrite the partition
            return
        self.flat.zero_grads()

    def grad_memory(self) -> GradMemory:
        """The gradient bytes this rank allocated, by kind and place."""
        g = self.grad_host
        part = g.numel() * g.element_size()
        on_device = self.place.optimizer_tier == "none"
        full = self.flat.grad_buffer.numel() * self.flat.grad_buffer.element_size()
        if self._grads_on_host:  # the partition is a slice of the full buffer
            part = 0
        b = self.buckets
        return GradMemory(
            full_buffer_bytes=full,
            partition_device_bytes=part if on_device else 0,
            partition_host_bytes=0 if on_device else part,
            bucket_bytes=b.bucket_bytes if b is not None else 0,
            staging_bytes=b.staging_bytes if b is not None else 0,
            buckets_reduced=b.buckets_reduced if b is not None else 0,
        )

    # ------------------------------------------------------------------------------ after the step
    def after_step(self) -> None:
        """Stages 1-2 with several ranks: every rank gets every updated partition."""
        if self.place.world_size == 1 or self.place.stage == 0:
            return
        size = self.part_numel
        buf = self.flat.param_buffer
        outs = [buf[r * size : (r + 1) * size] for r in range(self.place.world_size)]
        settle(dist.all_gather(outs, buf[self.lo : self.hi].clone(), async_op=True))

    @property
    def gathers_after_step(self) -> bool:
        """True at stages 1-2 with several ranks: the updated partitions are all-gathered after a step."""
        return self.place.world_size > 1 and self.place.stage >= 1

    def take_param_io(self) -> Optional[Dict[str, int]]:
        """None: the parameters have no tier of their own at stages 0-2."""
        return None

    @property
    def param_nvme_bytes(self) -> int:
        """0: parameters are never on NVMe at stages 0-2."""
        return 0

    # ------------------------------------------------------------------------------- state dicts
    def module_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's state dict on the CPU (model dtype)."""
        return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}

    def master_state_dict(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The trainable parameters from `master` (this rank's fp32 partition), all-gathered at stages 1-2
        (collective)."""
        if self.gathers_after_step:
            full = torch.empty(self.flat.padded_numel, dtype=torch.float32)
            settle(dist.all_gather_into_tensor(full, master, async_op=True))
            master = full
        names = {id(p): n for n, p in self.module.named_parameters()}
        return {
            names[id(p)]: master[a : a + n].view(p.shape).clone()
            for p, a, n in zip(self.flat.params, self.flat.offsets, self.flat.numels)
        }

    def master_index(self) -> Dict[str, Any]:
        """What each element of the master is, for readers of checkpoints (zero.checkpoint.to_fp32): the
        trainable parameters in flat-buffer order as `[[name, *tied aliases], shape]`, back to back from
        element 0 (ranks' partitions [lo, hi) of it); the state dict's keys and buffers. Plain types only."""
        names, keys, buffers = index_names(self.module)
        params = [[names[id(p)], list(p.shape)] for p in self.flat.params]
        return {"kind": "flat", "keys": keys, "buffers": buffers, "params": params}

    # ------------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove the hooks and give the parameters storage of their own (the model stays usable)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.buckets is not None:
            self.buckets.close()
        with torch.no_grad():
            for p in self.flat.params:
                p.data = p.data.clone()
                p.grad = None
        self.flat.release()
        self.grad_host = None  # type: ignore[assignment]

    def describe(self) -> str:
        """The stage, parameter count and gradient bucket size, for logs."""
        buckets = f", grad buckets={self.buckets.capacity}" if self.buckets is not None else ""
        return f"stage={self.place.stage}, params={self.flat.numel}{buckets}"
