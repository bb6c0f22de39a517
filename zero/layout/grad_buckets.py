"""GradBuckets: stage 2's gradients leave the device in buckets while backward runs.

No gradient buffer of the model's size exists. Each parameter's gradient, as soon as autograd produced it
(a post-accumulate-grad hook), is copied into the current bucket (model dtype, `reduce_bucket_size`
elements) and the parameter's `.grad` is released. A full bucket is reduced across ranks - each run of
elements goes to the rank whose partition holds it (`dist.reduce`, a reduce-scatter along partition
boundaries), nothing with one rank - and the rank's own elements are added into its destination, the
gradient partition `dest`: fp32 pinned host memory when the optimizer is offloaded, the device partition in
the model dtype otherwise. Then the bucket is reused.

On CUDA the reduction and the move run on a side stream ordered after the copies that filled the bucket;
to the host they go through a pinned staging buffer (model dtype) and the host adds them once the copy
finished. With `overlap_comm` there are two buckets, so backward fills one while the other is reduced and
moved; without it one, and each reduction finishes before backward goes on. On the CPU the same code runs
synchronously (gloo's collectives may still complete in the background with two buckets); with one rank
on a CPU-only machine there is nothing to reduce or move, and gradients go straight into the partition
(no bucket, which would only be one more copy).

Gradients accumulate over a window in the destination. After `zero()` (the step) the first gradient a
parameter gets is copied instead of added, so the partition is never cleared; at the end of that backward
the regions of parameters that got no gradient are zeroed.

All ranks must produce their gradients in the same order (the same graph), as with DeepSpeed's buckets:
the collectives of a bucket pair up by order.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from zero.comm import settle
from zero.layout.partition import FlatParams

__all__ = ["GradBuckets"]

Allocator = Callable[[int, torch.dtype], torch.Tensor]


@dataclass(eq=False)
class _Bucket:
    """One bucket: its device buffer, what it holds and its reduction in flight."""

    buf: torch.Tensor
    staging: Optional[torch.Tensor]  # pinned host copy of the rank's elements (CUDA, host destination)
    fill: int = 0
    # (flat offset, bucket offset, numel, overwrite) per piece of a parameter's gradient
    pieces: List[Tuple[int, int, int, bool]] = field(default_factory=list)
    finals: List[int] = field(default_factory=list)  # parameters whose last piece is in this bucket
    works: List[dist.Work] = field(default_factory=list)
    event: Optional[torch.cuda.Event] = None


class GradBuckets:
    """Stage 2's bucketed gradient path (see the module doc); the layout's `reducer`.

    `begin()` before each backward, `finish()` after it; `zero()` when the partition's gradients were
    used (the step). `on_final(i)` is told once parameter i's gradient is in `dest` (the optimizer pass
    during backward waits on it)."""

    every_backward = True  # the engine calls begin()/finish() on every backward, not only at boundaries

    def __init__(
        self,
        flat: FlatParams,
        dest: torch.Tensor,
        lo: int,
        *,
        rank: int,
        world_size: int,
        bucket_numel: int,
        overlap: bool,
        device: torch.device,
        dtype: torch.dtype,
        pinned: Optional[Allocator] = None,
        unpin: Optional[Callable[[torch.Tensor], None]] = None,
        on_final: Optional[Callable[[int], None]] = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.flat, self.dest, self.lo = flat, dest, lo
        self.hi = lo + dest.numel()
        self.rank, self.world_size, self.group = rank, world_size, group
        self.part_size = flat.padded_numel // world_size
        self.device = device
        self.cuda = device.type == "cuda"
        largest = max(flat.numels)
        # 0: one bucket per parameter (DeepSpeed's meaning); never larger than the model
        self.per_param = int(bucket_numel) <= 0
        self.capacity = min(largest if self.per_param else int(bucket_numel), flat.numel)
        # one rank on a CPU-only machine: nothing to reduce and nothing to move between devices, so a
        # bucket would only be one more copy; gradients go straight into the partition
        self.direct = world_size == 1 and not self.cuda
        if self.direct:
            self.capacity = 0
        self._to_host = dest.device.type == "cpu" and self.cuda
        self._dtype, self._pinned, self._unpin = dtype, pinned, unpin
        self.buckets: List[_Bucket] = []
        for _ in range(0 if self.direct else 2 if overlap else 1):
            self.buckets.append(self._new_bucket())
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        if flat.numel < self.hi:  # the padding at the end: no gradient ever lands there
            self.dest[max(0, flat.numel - lo) :].zero_()
        self._cur = 0
        self._pending: Deque[_Bucket] = collections.deque()
        self._on_final = on_final
        self._overwrite = True  # the destination holds nothing of this window yet
        self._seen: Set[int] = set()  # parameters with a gradient in this backward
        self.active = False
        self.bytes_sent = 0  # sent to other ranks (the engine's comm_bytes)
        self.bytes_to_host = 0  # device-to-host bytes since take_host_bytes()
        self.buckets_reduced = 0  # buckets flushed since construction

    def _new_bucket(self) -> _Bucket:
        staging = None
        if self._to_host:
            assert self._pinned is not None, "a host destination from CUDA needs pinned staging"
            staging = self._pinned(self.capacity, self._dtype)
        buf = torch.empty(self.capacity, dtype=self._dtype, device=self.device)
        return _Bucket(buf, staging, event=torch.cuda.Event() if self.cuda else None)

    def cap(self, numel: int) -> None:
        """Make the buckets at most `numel` elements (reallocated, smaller): the optimizer pass during
        backward steps a chunk once its gradients reached the partition, so they must leave the device
        at least once per chunk's worth of elements, not once per large bucket."""
        numel = max(1, int(numel))
        if self.direct or numel >= self.capacity or self.active:
            return
        self._drain()
        self._release_staging()
        self.capacity = numel
        self.buckets = [self._new_bucket() for _ in self.buckets]
        self._cur = 0

    def _release_staging(self) -> None:
        for b in self.buckets:
            if b.staging is not None and self._unpin is not None:
                self._unpin(b.staging)
            b.staging = None

    # ------------------------------------------------------------------------------- memory
    @property
    def bucket_bytes(self) -> int:
        """Bytes of the bucket buffers on the compute device."""
        return sum(b.buf.numel() * b.buf.element_size() for b in self.buckets)

    @property
    def staging_bytes(self) -> int:
        """Bytes of pinned host staging (CUDA with a host destination)."""
        return sum(
            b.staging.numel() * b.staging.element_size() for b in self.buckets if b.staging is not None
        )

    # ---------------------------------------------------------------------------- lifetime
    def begin(self) -> None:
        """Before a backward: empty buckets (what a backward that raised left half-sent is waited for)."""
        self._drain()
        for b in self.buckets:
            b.fill, b.pieces, b.finals = 0, [], []
        self._cur = 0
        self._seen = set()
        self.active = True

    def grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s gradient is final in this backward: into the buckets, `.grad` released."""
        grad = param.grad
        if not self.active or grad is None:
            return
        g = grad.detach().reshape(-1)
        off, n = self.flat.offsets[index], self.flat.numels[index]
        overwrite = self._overwrite and index not in self._seen
        self._seen.add(index)
        if self.direct:
            dst = self.dest[off - self.lo : off - self.lo + n]
            if overwrite:
                dst.copy_(g)
            else:
                dst.add_(g)
            param.grad = None
            if self._on_final is not None:
                self._on_final(index)
            return
        done = 0
        while done < n:
            b = self.buckets[self._cur]
            space = self.capacity - b.fill
            if space == 0:
                self._flush()
                continue
            k = min(space, n - done)
            b.buf[b.fill : b.fill + k].copy_(g[done : done + k])
            b.pieces.append((off + done, b.fill, k, overwrite))
            b.fill += k
            done += k
        self.buckets[self._cur].finals.append(index)
        param.grad = None
        if self.per_param:
            self._flush()

    def finish(self) -> None:
        """After backward: send the last bucket, wait for every bucket to reach the destination."""
        if not self.active:
            return
        self._flush()
        self._drain()
        if self._overwrite:  # parameters without a gradient in this window's first backward: zero
            for i, (off, n) in enumerate(zip(self.flat.offsets, self.flat.numels)):
                if i not in self._seen:
                    a, z = max(off, self.lo), min(off + n, self.hi)
                    if a < z:
                        self.dest[a - self.lo : z - self.lo].zero_()
            self._overwrite = False
        self.active = False

    def zero(self) -> None:
        """The destination's gradients were used: the next gradients overwrite it (no clearing pass)."""
        self._drain()
        self._overwrite = True

    def take_host_bytes(self) -> int:
        """Gradient bytes copied from the device to the host since the last call."""
        out, self.bytes_to_host = self.bytes_to_host, 0
        return out

    # ------------------------------------------------------------------------------- buckets
    def _mine(self, b: _Bucket) -> List[Tuple[int, int, int, bool]]:
        """The pieces of `b` inside this rank's partition: (dest offset, bucket offset, numel, overwrite)."""
        out = []
        for off, at, k, overwrite in b.pieces:
            a, z = max(off, self.lo), min(off + k, self.hi)
            if a < z:
                out.append((a - self.lo, at + a - off, z - a, overwrite))
        return out

    def _owner_runs(self, b: _Bucket) -> List[Tuple[int, int, int]]:
        """(owner rank, start, end) in bucket coordinates: consecutive pieces of one owner merged."""
        runs: List[Tuple[int, int, int]] = []
        size = self.part_size
        for off, at, k, _ in b.pieces:
            a = off
            while a < off + k:
                owner = a // size
                z = min(off + k, (owner + 1) * size)
                s, e = at + a - off, at + z - off
                if runs and runs[-1][0] == owner and runs[-1][2] == s:
                    runs[-1] = (owner, runs[-1][1], e)
                else:
                    runs.append((owner, s, e))
                a = z
        return runs

    def _flush(self) -> None:
        """Reduce the current bucket and start its move; the next bucket is made free for backward."""
        if self.direct:
            return
        b = self.buckets[self._cur]
        if b.fill == 0:
            return
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the copies that filled it
            ctx = torch.cuda.stream(self.stream)
        with ctx:
            if self.world_size > 1:
                for owner, s, e in self._owner_runs(b):
                    b.works.append(dist.reduce(b.buf[s:e], dst=owner, group=self.group, async_op=True))
                self.bytes_sent += b.fill * b.buf.element_size()
            if self.stream is not None:
                for w in b.works:
                    w.wait()  # NCCL: the side stream waits, the host does not
                self._move(b, b.buf if b.staging is None else None)
                assert b.event is not None
                b.event.record(self.stream)
        self.buckets_reduced += 1
        self._pending.append(b)
        self._cur = (self._cur + 1) % len(self.buckets)
        nxt = self.buckets[self._cur]
        if any(p is nxt for p in self._pending):
            self._complete()

    def _move(self, b: _Bucket, src: Optional[torch.Tensor]) -> None:
        """On CUDA, queued on the side stream: add the rank's elements into a device destination, or copy
        them to the pinned staging (`src` None)."""
        for d, at, k, overwrite in self._mine(b):
            if src is None:
                assert b.staging is not None
                b.staging[at : at + k].copy_(b.buf[at : at + k], non_blocking=True)
                self.bytes_to_host += k * b.buf.element_size()
            elif overwrite:
                self.dest[d : d + k].copy_(src[at : at + k])
            else:
                self.dest[d : d + k].add_(src[at : at + k])

    def _complete(self) -> None:
        """The oldest bucket in flight reaches the destination; it may then be filled again."""
        b = self._pending.popleft()
        if self.stream is None:
            for w in b.works:
                settle(w)
            for d, at, k, overwrite in self._mine(b):
                if overwrite:
                    self.dest[d : d + k].copy_(b.buf[at : at + k])
                else:
                    self.dest[d : d + k].add_(b.buf[at : at + k])
        else:
            assert b.event is not None
            if b.staging is not None:
                b.event.synchronize()
                for d, at, k, overwrite in self._mine(b):
                    if overwrite:
                        self.dest[d : d + k].copy_(b.staging[at : at + k])
                    else:
                        self.dest[d : d + k].add_(b.staging[at : at + k])
            torch.cuda.current_stream(self.device).wait_event(b.event)  # before the bucket is refilled
            for w in b.works:
                settle(w)
        b.works = []
        finals, b.fill, b.pieces, b.finals = b.finals, 0, [], []
        if self._on_final is not None:
            for i in finals:
                self._on_final(i)

    def _drain(self) -> None:
        while self._pending:
            self._complete()

    def close(self) -> None:
        """Wait for what is in flight and give the pinned staging back."""
        self._drain()
        self._release_staging()
        self.active = False
