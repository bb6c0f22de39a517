"""WriteBack: a stage-3 store's NVMe partition writes, left in flight while the caller goes on.

The optimizer pass writes each updated NVMe partition once all its elements are assembled. Written one at
a time and waited for, the writes run at queue depth 1 and the pass waits for every one. `submit` queues
the write on one of `depth` aio handles (one write per handle, so that one write can be waited for alone)
and returns; only when every handle holds a write does it wait for the oldest. The source tensor is held
until its write ended: nothing else refers to it (the writer hands over a buffer of its own), so no later
step can change it in flight. Anything that reads or writes the unit's swap file again - a prefetch, a
read, the next write - first calls `settle(unit)`, which waits for that unit's write alone; `settle_all`
waits for every one (the optimizer's next step, a checkpoint save, state access, close).

Failure rule (the optimizer swapper's deferred write-back, docs/engine.md "retry rule"): a write that
fails is written again once from the held source, at once. Found while a pass still runs (`submit` waiting
for the oldest write) a second failure is raised as the OSError it is: the pass fails and the parameters are
put back from the committed master, which writes every partition anew. Found after the step returned, the
write is *held*: its source stays here, every later `settle` of that unit (and `settle_all`) writes it
again and, while that fails, raises `DeferredWriteError` with `steps_lost` 0 - nothing is lost and the call
that raised changed nothing. `close` with a write still held returns it with `steps_lost` 1.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

from offload.swap.optimizer_swapper import DeferredWriteError
from offload.swap.space import SwapFile
from zero.stage3.store_stats import StoreStats

__all__ = ["WriteBack"]


@dataclass
class _Write:
    """One partition write: its unit's name, the source held until it ended, the file, and its handle."""

    name: str
    src: torch.Tensor
    path: SwapFile
    handle: Any = None  # None once the write failed twice (held)
    error: Optional[DeferredWriteError] = None


class WriteBack:
    """The writes of one store in flight (by unit index), at most `depth` at a time."""

    def __init__(self, new_handle: Callable[[], Any], depth: int, stats: StoreStats) -> None:
        """`new_handle()`: a new aio handle (one per write in flight); `depth`: writes in flight at most."""
        self._new_handle = new_handle
        self.depth = max(1, int(depth))
        self._stats = stats
        self._idle: List[Any] = []  # handles with no write
        self._handles = 0
        self._own: Any = None  # the writer's handle for what it waits on at once (and writes again)
        self._writes: OrderedDict[int, _Write] = OrderedDict()  # unit index -> write, oldest first
        # the optimizer's thread submits while the main thread's prefetches settle: one lock for the map
        self._lock = threading.RLock()

    @property
    def in_flight(self) -> int:
        """Writes queued and not waited for yet (held ones excluded)."""
        with self._lock:
            return sum(1 for w in self._writes.values() if w.handle is not None)

    @property
    def held(self) -> int:
        """Writes that failed twice and wait here for the next `settle`."""
        with self._lock:
            return sum(1 for w in self._writes.values() if w.handle is None)

    @property
    def own(self) -> Any:
        """The writer's own aio handle for synchronous reads and writes (never one a prefetch waits on)."""
        if self._own is None:
            self._own = self._new_handle()
        return self._own

    def write_now(self, index: int, src: torch.Tensor, path: SwapFile) -> None:
        """Write `src` to `path` from offset 0 and wait for it (an earlier write of the unit is superseded);
        a failure raises AioError naming the file, offset and errno."""
        self.discard(index)
        self.own.sync_pwrite(src, path, 0)

    def submit(self, index: int, name: str, src: torch.Tensor, path: SwapFile) -> None:
        """Queue the write of `src` (the unit's whole stored bytes, host memory, held until the write ended)
        to `path` from offset 0. An earlier write of the unit is waited for and superseded (this one
        writes every byte); with `depth` writes in flight the oldest is waited for (a failure there,
        written again and failing again, raises: the pass that submits fails)."""
        self.discard(index)
        with self._lock:  # queued before another thread's settle can look for it
            handle = self._take_handle()
            try:
                handle.async_pwrite(src, path, 0)
            except BaseException:
                self._idle.append(handle)
                raise
            self._writes[index] = _Write(name, src, path, handle)
        st = self._stats
        st.async_writes += 1
        st.async_bytes_written += src.numel() * src.element_size()
        st.peak_writes_in_flight = max(st.peak_writes_in_flight, self.in_flight)

    def _take_handle(self) -> Any:
        """An idle handle; a new one below `depth`, else the oldest write's once it ended (under the lock)."""
        if self._idle:
            return self._idle.pop()
        if self._handles < self.depth:
            self._handles += 1
            return self._new_handle()
        oldest = next(i for i, w in self._writes.items() if w.handle is not None)
        self._finish(oldest, during_pass=True)
        return self._idle.pop()

    def settle(self, index: int) -> None:
        """Wait for the unit's write, if one is in flight or held; DeferredWriteError while it fails."""
        with self._lock:
            if index in self._writes:
                self._finish(index, during_pass=False)

    def discard(self, index: int) -> None:
        """Wait for the unit's write, if any, and drop it whatever its outcome: a new write of every byte
        of the partition supersedes it."""
        with self._lock:
            w = self._writes.pop(index, None)
            if w is None or w.handle is None:
                return
            handle, w.handle = w.handle, None
            self._idle.append(handle)
            t0 = time.perf_counter()
            try:
                handle.wait()
            except OSError:
                pass  # superseded: the new write puts every byte of the partition
            finally:
                self._stats.write_wait_s += time.perf_counter() - t0

    def settle_all(self) -> None:
        """Wait for every write; raises the first DeferredWriteError (every held write was tried again)."""
        first: Optional[BaseException] = None
        with self._lock:
            for index in list(self._writes):
                try:
                    self._finish(index, during_pass=False)
                except DeferredWriteError as e:
                    first = first or e
        if first is not None:
            raise first

    def _finish(self, index: int, during_pass: bool) -> None:
        """Wait for write `index` (under the lock); a failure is written again once, then raised (during a
        pass: the OSError, the write dropped) or held (DeferredWriteError, steps_lost 0). Done: the source
        and handle are let go."""
        w = self._writes[index]
        t0 = time.perf_counter()
        try:
            first = w.error
            if w.handle is not None:
                handle, w.handle = w.handle, None
                self._idle.append(handle)
                try:
                    handle.wait()  # raises AioError (an OSError) naming the file if the write failed
                    first = None
                except OSError as e:
                    first = e
            if first is not None:
                self._write_again(w, first, during_pass)
        except BaseException:
            if during_pass:
                self._writes.pop(index, None)  # the failed pass puts every partition back anew
            raise
        finally:
            self._stats.write_wait_s += time.perf_counter() - t0
        self._writes.pop(index, None)

    def _write_again(self, w: _Write, first: BaseException, during_pass: bool) -> None:
        self._stats.write_retries += 1
        try:
            self.own.sync_pwrite(w.src, w.path, 0)
        except OSError as e:
            if during_pass:
                raise
            path = getattr(e, "filename", None) or w.path.path
            err = DeferredWriteError(
                e.errno or 0,
                f"writing back the updated weights of {w.name!r} to {path} failed after the step returned "
                f"({e.strerror or e}), and again when retried; they are held in memory and written again "
                "before the partition is next used: nothing is lost, and this call changed nothing",
                path,
                steps_lost=0,
            )
            cause = first.__cause__ if isinstance(first, DeferredWriteError) else first
            w.error = err
            raise err from cause

    def close(self) -> Optional[DeferredWriteError]:
        """Wait for every write and close the handles. A write still failing then is lost: returns its
        DeferredWriteError (steps_lost 1) for the caller to raise once it closed the rest, else None."""
        lost: Optional[DeferredWriteError] = None
        try:
            self.settle_all()
        except DeferredWriteError as e:
            lost = DeferredWriteError(
                e.errno or 0,
                f"writing back the updated weights to {e.filename} kept failing until the store was closed: "
                "the last step's weights of that partition are lost",
                e.filename,
            )
            lost.__cause__ = e.__cause__
        with self._lock:
            self._writes.clear()
            for h in self._idle + ([self._own] if self._own is not None else []):
                h.close()
            self._idle, self._handles, self._own = [], 0, None
        return lost
