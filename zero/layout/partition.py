"""Flat parameter/gradient buffers, rank partitions and the bucketed gradient reduction.

Every trainable parameter becomes a view into one flat buffer, and its `.grad` a view into a second flat
buffer of the same layout, so autograd accumulates each gradient straight into its final place: no copy at
the end of backward, and a rank's partition is just a slice. The buffers are padded to a multiple of
`world_size * PAD_ELEMS`, so every partition has the same size and starts on an aligned element.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zero.comm import settle

__all__ = ["FlatParams", "GradReadiness", "GradReducer", "partition_range"]

PAD_ELEMS = 1024  # partitions start on 4 KiB (fp32) boundaries: aligned I/O and SIMD-friendly slices

Allocator = Callable[[int, torch.dtype], torch.Tensor]


def partition_range(padded_numel: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[lo, hi) of rank `rank`'s equal share of a buffer of `padded_numel` elements."""
    if padded_numel % world_size:
        raise ValueError(
            f"buffer of {padded_numel} elements does not split evenly into {world_size} partitions"
        )
    size = padded_numel // world_size
    return rank * size, (rank + 1) * size


class FlatParams:
    """The trainable parameters of a model as views of one flat buffer, with a flat gradient buffer."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        world_size: int = 1,
        alloc: Optional[Allocator] = None,
        grads: bool = True,
    ) -> None:
        """`grads=False`: no flat gradient buffer (stage 2 moves gradients out in buckets; `.grad`s are
        left to autograd)."""
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device, got {dtypes} on {devices}"
            )
        self.params: List[torch.nn.Parameter] = list(params)
        self.dtype = next(iter(dtypes))
        self.device = next(iter(devices))
        self.numels = [p.numel() for p in self.params]
        self.offsets: List[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        quantum = PAD_ELEMS * world_size
        self.padded_numel = (total + quantum - 1) // quantum * quantum

        def new(dtype: torch.dtype) -> torch.Tensor:
            if alloc is not None:
                t = alloc(self.padded_numel, dtype)
                return t.zero_()
            return torch.zeros(self.padded_numel, dtype=dtype, device=self.device)

        self.param_buffer = new(self.dtype)
        with torch.no_grad():
            for p, off, n in zip(self.params, self.offsets, self.numels):
                view = self.param_buffer[off : off + n]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)  # the parameter's own storage is freed here
        # Allocated only now that the original parameters are gone: the peak stays at 2 x, not 3 x.
        self.grad_buffer = new(self.dtype) if grads else torch.empty(0, dtype=self.dtype, device=self.device)
        self._grad_views: List[torch.Tensor] = []
        if grads:
            self._grad_views = [
                self.grad_buffer[off : off + n].view_as(p)
                for p, off, n in zip(self.params, self.offsets, self.numels)
            ]
            self.attach_grads()

    def attach_grads(self) -> None:
        """Point every `.grad` at its view of the flat gradient buffer."""
        for p, g in zip(self.params, self._grad_views):
            p.grad = g

    def claim_grad(self, index: int) -> None:
        """Make parameter `index`'s `.grad` its flat view again if something replaced it (zero_grad(None))."""
        if not self._grad_views:
            return
        p, view = self.params[index], self._grad_views[index]
        g = p.grad
        if g is None or g.data_ptr() == view.data_ptr():
            return
        with torch.no_grad():
            view.copy_(g)
        p.grad = view

    def release(self) -> None:
        """Forget the flat buffers (the parameters must already own other storage)."""
        self._grad_views = []
        self.param_buffer = self.grad_buffer = torch.empty(0, dtype=self.dtype)

    def zero_grads(self) -> None:
        """Zero the flat gradient buffer and point the `.grad`s at it again."""
        self.grad_buffer.zero_()
        self.attach_grads()


class GradReducer:
    """Averages gradients across ranks in buckets of about `bucket_numel` elements.

    Stage 0 all-reduces each bucket. Stages 1 and 2 reduce each bucket only to the ranks owning parts of
    it (a reduce-scatter along partition boundaries), so a rank ends up with the summed gradient of its own
    partition only. With `overlap`, a bucket is sent as soon as backward has produced all its gradients
    (post-accumulate-grad hooks), overlapping communication with the rest of backward.
    The sum is left unscaled: the optimizer divides by the world size in its fused pass.
    """

    def __init__(
        self,
        flat: FlatParams,
        *,
        stage: int,
        rank: int,
        world_size: int,
        bucket_numel: int,
        overlap: bool,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.flat = flat
        self.stage = stage
        self.rank = rank
        self.world_size = world_size
        self.overlap = overlap
        self.group = group
        bucket_numel = max(1, int(bucket_numel))
        self.buckets: List[Tuple[int, int]] = []
        self.param_bucket: List[int] = []
        start = 0
        for i, (off, n) in enumerate(zip(flat.offsets, flat.numels)):
            self.param_bucket.append(len(self.buckets))
            end = off + n
            last = i == len(flat.numels) - 1
            if end - start >= bucket_numel or last:
                self.buckets.append((start, flat.padded_numel if last else end))
                start = end
        self._count = [0] * len(self.buckets)
        for b in self.param_bucket:
            self._count[b] += 1
        self._remaining: List[int] = []
        self._launched: List[bool] = []
        self._works: List[dist.Work] = []
        self.active = False
        self.bytes_sent = 0

    def begin(self) -> None:
        """Arm the hooks for the backward that ends an accumulation window."""
        self._remaining = list(self._count)
        self._launched = [False] * len(self.buckets)
        self._works = []
        self.active = True

    def grad_ready(self, index: int) -> None:
        """A hook reported parameter `index` final: with the overlap, send its bucket once it is complete."""
        if not (self.active and self.overlap):
            return
        b = self.param_bucket[index]
        self._remaining[b] -= 1
        if self._remaining[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        self._launched[b] = True
        lo, hi = self.buckets[b]
        buf = self.flat.grad_buffer
        self.bytes_sent += (hi - lo) * buf.element_size()
        if self.stage == 0:
            self._works.append(dist.all_reduce(buf[lo:hi], group=self.group, async_op=True))
            return
        size = self.flat.padded_numel // self.world_size
        for owner in range(lo // size, (hi - 1) // size + 1):
            a, z = max(lo, owner * size), min(hi, (owner + 1) * size)
            work = dist.reduce(buf[a:z], dst=owner, group=self.group, async_op=True)
            self._works.append(work)

    def finish(self) -> None:
        """Send the buckets the hooks did not (unused parameters, overlap off) and wait for all of them."""
        if not self.active:
            return
        for b, launched in enumerate(self._launched):
            if not launched:
                self._launch(b)
        for w in self._works:
            settle(w)
        self._works = []
        self.active = False


class GradReadiness:
    """Tells when every gradient inside a chunk of the partition is final, during backward.

    The optimizer can step a sub-group as soon as backward has produced all gradients overlapping it. Each
    gradient source (a parameter at stages 0-2, a unit's partition at stage 3) covers one segment of the
    partition; the engine calls `param_ready(source)` when that source's gradient is final. A worker thread
    blocks in `wait(chunk)`; the engine calls `all_ready()` when backward returns (sources without a gradient
    this time never report) and `cancel()` when it raised. `on_ready(chunk)`, when given, runs on the thread
    whose `param_ready` completed the chunk, before any waiter wakes (on a GPU: where backward's stream is).
    """

    def __init__(
        self,
        segments: Sequence[Tuple[int, int]],
        chunks: Sequence[Tuple[int, int]],
        on_ready: Optional[Callable[[int], None]] = None,
    ) -> None:
        """segments[i]: (start, numel) of source i; chunks: (start, numel); both in partition coordinates."""
        import threading

        self.on_ready = on_ready
        self._cond = threading.Condition()
        self.chunks_of: List[List[int]] = []
        self.counts = [0] * len(chunks)
        for off, n in segments:
            hit = []
            for c, (a, cn) in enumerate(chunks):
                if off < a + cn and a < off + n:
                    hit.append(c)
                    self.counts[c] += 1
            self.chunks_of.append(hit)
        self._remaining = list(self.counts)
        self._all = True
        self._cancelled = False

    @classmethod
    def for_flat(
        cls,
        flat: FlatParams,
        lo: int,
        chunks: Sequence[Tuple[int, int]],
        on_ready: Optional[Callable[[int], None]] = None,
    ) -> GradReadiness:
        """Stages 0-2: one source per parameter of the flat buffer; the partition starts at element `lo`."""
        return cls([(off - lo, n) for off, n in zip(flat.offsets, flat.numels)], chunks, on_ready)

    def begin(self) -> None:
        """Start a pass: every chunk waits for all of its gradient sources again."""
        with self._cond:
            self._remaining = list(self.counts)
            self._all = self._cancelled = False

    def param_ready(self, index: int) -> None:
        """Gradient source `index` is final: wake the waiters of the chunks it completed."""
        with self._cond:
            woke = False
            for c in self.chunks_of[index]:
                self._remaining[c] -= 1
                if self._remaining[c] == 0:
                    woke = True
                    if self.on_ready is not None:
                        self.on_ready(c)
            if woke:
                self._cond.notify_all()

    def all_ready(self) -> None:
        """Backward ended: every chunk is ready, also those whose sources no hook reported."""
        with self._cond:
            self._all = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """Cancel the pass: every waiter returns False."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def wait(self, chunk: int) -> bool:
        """Block until chunk's gradients are final; False when the pass was cancelled."""
        with self._cond:
            while not (self._cancelled or self._all or self._remaining[chunk] <= 0):
                self._cond.wait()
            return not self._cancelled
