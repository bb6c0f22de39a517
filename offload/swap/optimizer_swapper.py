"""OptimizerSwapper: fp32 master weights and optimizer states of one partition, stepped from NVMe.

Layout. The partition is cut into chunks of at most `chunk_numel` elements (a sub-group, or a piece of one
when a sub-group is larger than a staging slot). A chunk of n elements is stored as one aligned region,
`[master | state_1 | ... | state_k]` (an fp32 master, states in their dtype: fp32, bf16, or int8 codes
followed by their fp32 absmax scales; `offload.swap.slots.StateFormat`), so one read and one write move
it. There are two copies of the whole layout (files `.a` and `.b`): a step reads every chunk from the live
copy and writes the updated chunk to the other one, and only `commit()` makes the other copy live. A step
that fails half way (disk full, an I/O error, a gradient overflow found in the fused pass) therefore leaves
the previous state intact, at the price of twice the disk space.

Pipeline. `buffer_count` pinned staging slots, each with its own aio handle (a handle's `wait()` waits for
everything queued on it, so one handle per slot lets us wait for exactly one slot). For chunk i the step
waits for the read of i, runs the update on the slot, queues the write of i, and - before that - queues the
read of chunk i+1 into the next slot once that slot's earlier write has finished. With three or more slots
the read of i+1, the update of i and the write of i-1 all run at the same time.

Deferred write-back (`defer_writes`, on by default with two copies). A step returns as soon as the last
chunk is updated: the writes of the last `buffer_count` chunks are still in flight, and the engine's forward
(which only needs the 16-bit parameters the update function already copied out) overlaps them. Everything
that touches the files or the slots next - `prefetch`, `step`, `read_all`, `load`, `close` - first settles
them (`settle()`). A step committed with writes in flight is live-pending: if one of them fails, the copy
it wrote is not the state, so the swapper goes back to the previous copy (intact: a step never writes the
live copy, and nothing writes the old one before the settle). The chunks whose writes were in flight are
still in their slots, so the settle first writes them again; only if that fails too is the step *held*:
its chunks stay in the slots (nothing else uses them), the live copy is not read, and every later settle
writes them again until it succeeds. While held, `step`, `read_all`, `rewrite` and `take_lost` raise (or
hand over) a `DeferredWriteError` naming the file with `steps_lost` 0 - nothing was lost, the state is the
last step's and the failed call changed nothing; `prefetch` reads nothing; `load` replaces the state and
drops the held chunks; `close` raises it with `steps_lost` 1 (the held step goes with the slots). A
failure before `commit()` loses that uncommitted step (`steps_lost` 1: `commit` raises it). In-place steps
(`copies=1`) always drain: a failed write there would have nothing to go back to. `keep_lost` puts back a
failure a discarded step had taken. `rewrite` changes every chunk in place through the pipeline (the
engine rebuilds the master from the module's weights with it).

The module is long because the pipeline, the two-copy commit and the deferred write-back share one set
of slots and files; splitting them would spread that state over several owners.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from offload.config.aio import AioConfig
from offload.swap.slots import FP32_BYTES, StateFormat, slot_bytes
from offload.swap.space import SwapFile, SwapSpace, align_up

__all__ = ["STATE_TORCH_DTYPES", "ChunkFn", "DeferredWriteError", "OptimizerSwapper", "ReadyFn", "SwapStats"]

# How each state dtype is held in torch (int8 states are uint8 codes with fp32 absmax scales beside them).
STATE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


# (start element within the partition, numel, master view, state views) -> all values finite
ChunkFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], bool]
# chunk index -> go on (blocks until the chunk's inputs are ready; False cancels the pass)
ReadyFn = Callable[[int], bool]


@dataclass
class SwapStats:
    """Counters since the last `reset()`: bytes moved and where the time went."""

    bytes_read: int = 0
    bytes_written: int = 0
    io_wait_s: float = 0.0  # time blocked waiting for a slot's I/O
    compute_s: float = 0.0  # time inside the update function
    gate_wait_s: float = 0.0  # time waiting for a chunk's inputs (gradients still being produced)
    # part of io_wait_s: blocked on the writes the previous step left in flight (what forward did not hide)
    write_back_wait_s: float = 0.0
    chunks: int = 0
    extra: dict = field(default_factory=dict)

    def reset(self) -> None:
        """Zero every count and time."""
        self.bytes_read = self.bytes_written = self.chunks = 0
        self.io_wait_s = self.compute_s = self.gate_wait_s = self.write_back_wait_s = 0.0


class DeferredWriteError(OSError):
    """A write a step left in flight failed after the step returned: that step's state is lost.

    `steps_lost` 1: the swapper is back on the state before that step. `steps_lost` 0: the step is held -
    its chunks wait in the staging slots and are written again at the next settle, so nothing is lost and
    the call that raised changed nothing. errno and filename are those of the failed write.
    """

    steps_lost = 1

    def __init__(self, *args: Any, steps_lost: int = 1) -> None:
        super().__init__(*args)
        self.steps_lost = steps_lost


class OptimizerSwapper:
    """Master + `n_states` states of `numel` elements in swap files, stepped chunk by chunk. The master
    is fp32; the states are in `state_dtype` ("fp32", "bf16", or "int8" codes with per-block absmax)."""

    def __init__(
        self,
        space: SwapSpace,
        numel: int,
        n_states: int,
        pool: Any,
        *,
        chunk_numel: int,
        buffer_count: int = 4,
        aio: Optional[AioConfig] = None,
        name: str = "optimizer",
        copies: int = 2,
        defer_writes: bool = True,
        state_dtype: str = "fp32",
    ) -> None:
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        if copies not in (1, 2):
            raise ValueError(f"copies must be 1 (update in place) or 2 (atomic steps), got {copies}")
        if buffer_count < 1:
            raise ValueError(f"buffer_count must be >= 1, got {buffer_count}")
        self.space = space
        self.numel = int(numel)
        self.n_states = int(n_states)
        self.fmt = StateFormat(self.n_states, state_dtype)
        self.n_tensors = self.fmt.n_tensors
        self.chunk_numel = min(int(chunk_numel), self.numel)
        self.chunks: List[Tuple[int, int]] = [
            (s, min(self.chunk_numel, self.numel - s)) for s in range(0, self.numel, self.chunk_numel)
        ]
        self.alignment = space.alignment
        self.region_bytes = slot_bytes(self.chunk_numel, self.n_states, self.alignment, state_dtype)
        self.stats = SwapStats()
        self._pool = pool
        self._aio = aio or AioConfig()
        self._slots: List[torch.Tensor] = []
        self._handles: List[Any] = []
        self._files: List[SwapFile] = []
        self._fresh: List[bool] = []  # per copy: nothing written yet, so it reads as zeros (fallocated)
        self._master_only = False  # a load pass that writes only the masters (its states are known zeros)
        self._live = 0
        self._pending = False
        self._closed = False
        # Deferred write-back. `_in_flight`: a step's writes may still be queued on the slots' handles.
        # `_fallback`: the copy to go back to if they fail after commit(). `_lost`: the error of such a
        # failure not yet raised by step(); `_lost_raised`: read_all/close already raised it once.
        self.defer_writes = bool(defer_writes)
        self._in_flight = False
        self._fallback: Optional[int] = None
        self._lost: Optional[DeferredWriteError] = None
        self._lost_raised = False
        # (chunk, slot) of the writes a step left in flight; `_held`: their second write failed too, so
        # the chunks wait in the slots (the live copy lacks them) until a settle writes them
        self._deferred: List[Tuple[int, int]] = []
        self._held = False
        self._prefetched = 0  # chunks at positions 0..n-1 of _prefetch_order queued into slots 0..n-1
        self._prefetch_order: List[int] = []
        # The order `step` (and `prefetch`) visit chunks in. The engine reverses it when it steps
        # sub-groups during backward, which produces the last parameters' gradients first.
        self.step_order: List[int] = list(range(len(self.chunks)))
        try:
            n_slots = min(buffer_count, len(self.chunks))
            for _ in range(n_slots):
                self._slots.append(pool.allocate(self.region_bytes // FP32_BYTES, torch.float32))
                self._handles.append(self._aio.handle())
            for copy in ("a", "b")[:copies]:
                self._files.append(space.create(f"{name}.{copy}.swp", self.region_bytes * len(self.chunks)))
                self._fresh.append(True)
            for h in self._handles:  # every request uses the descriptor opened here, never the path again
                for f in self._files:
                    h.register_file(f)  # relative to the space's directory fd
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------------- sizes
    @property
    def copies(self) -> int:
        """2: a step writes the spare copy (atomic); 1: in place (half the disk, a failed step is lost)."""
        return len(self._files)

    @property
    def _spare(self) -> int:
        return (self._live + 1) % len(self._files)

    @property
    def buffer_count(self) -> int:
        """The number of pinned staging slots."""
        return len(self._slots)

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes of the staging slots."""
        return sum(s.numel() * FP32_BYTES for s in self._slots)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the swap files on disk."""
        return sum(f.nbytes for f in self._files)

    @property
    def state_bytes(self) -> int:
        """Bytes of live state (one copy) in the states' dtype, before the swap alignment pads each chunk."""
        return self.fmt.whole_bytes(self.numel)

    # ------------------------------------------------------------------------------------------------- I/O
    @property
    def pass_bytes(self) -> int:
        """Bytes one full pass reads (and, committing, writes): every chunk's aligned region."""
        return sum(self._io_bytes(n) for _, n in self.chunks)

    def _io_bytes(self, n: int) -> int:
        return align_up(self.fmt.chunk_bytes(n), self.alignment)

    def _views(self, slot: int, n: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The chunk's master, states and (int8) absmax scales inside slot `slot`."""
        raw = self._slots[slot].view(torch.uint8)
        views = [
            raw[off : off + numel * STATE_TORCH_DTYPES[d].itemsize].view(STATE_TORCH_DTYPES[d])
            for d, numel, off in self.fmt.parts(n)
        ]
        return views[0], views[1:]

    def _read(self, i: int, slot: int, f: SwapFile) -> None:
        nbytes = self._io_bytes(self.chunks[i][1])
        self._handles[slot].async_pread(self._slots[slot][: nbytes // FP32_BYTES], f, i * self.region_bytes)
        self.stats.bytes_read += nbytes

    def _write(self, i: int, slot: int, f: SwapFile) -> None:
        n = self.chunks[i][1]
        # [master | states] is one region; the master is its head, so writing it alone is one shorter write
        nbytes = n * FP32_BYTES if self._master_only else self._io_bytes(n)
        self._fresh[self._files.index(f)] = False
        self._handles[slot].async_pwrite(self._slots[slot][: nbytes // FP32_BYTES], f, i * self.region_bytes)
        self.stats.bytes_written += nbytes

    def _wait(self, slot: int) -> None:
        t0 = time.perf_counter()
        try:
            self._handles[slot].wait()
        finally:
            self.stats.io_wait_s += time.perf_counter() - t0

    def _drain(self) -> None:
        """Wait for every slot, keeping only the first error: nothing may still write into a slot after."""
        first: Optional[BaseException] = None
        for slot in range(len(self._handles)):
            try:
                self._wait(slot)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OptimizerSwapper is closed")

    def _pipeline(
        self,
        src: Optional[SwapFile],
        dst: Optional[SwapFile],
        fn: ChunkFn,
        use_prefetch: bool = False,
        order: Optional[Sequence[int]] = None,
        ready: Optional[ReadyFn] = None,
        defer: bool = False,
    ) -> bool:
        """Read chunks from `src` (or none), apply `fn`, write to `dst` (or none). Stops at a False.

        Chunks are visited in `order` (default: ascending); the chunk at position p always uses slot
        p % slots, so a prefetch made with the same order lines up. `ready(i)`, when given, is called
        before chunk i's update and blocks until its inputs are final; False cancels the pass. `defer`:
        return with the last writes in flight (a completed pass only; the caller settles them later).
        """
        order = list(range(len(self.chunks))) if order is None else list(order)
        n_chunks, n_slots = len(order), len(self._slots)
        issued = -1  # highest position whose read is queued
        if use_prefetch and self._prefetched and self._prefetch_order == order:
            issued = self._prefetched - 1
        elif self._prefetched:
            self._drain()  # this pass reuses the slots (or another order): the prefetched chunks are lost
        self._prefetched = 0
        try:
            for p in range(n_chunks):
                slot = p % n_slots
                i = order[p]
                if src is not None and issued < p:
                    self._wait(slot)  # the slot's previous write must be done before it is refilled
                    self._read(i, slot, src)
                    issued = p
                if src is not None and n_slots > 1 and issued < p + 1 < n_chunks:
                    nxt = (p + 1) % n_slots
                    self._wait(nxt)
                    self._read(order[p + 1], nxt, src)
                    issued = p + 1
                elif src is None:
                    self._wait(slot)
                if ready is not None:
                    t0 = time.perf_counter()
                    go = ready(i)
                    self.stats.gate_wait_s += time.perf_counter() - t0
                    if not go:
                        self._drain()
                        return False
                self._wait(slot)  # this chunk's read
                start, n = self.chunks[i]
                master, states = self._views(slot, n)
                t0 = time.perf_counter()
                ok = fn(start, n, master, states)
                self.stats.compute_s += time.perf_counter() - t0
                self.stats.chunks += 1
                if not ok:
                    self._drain()
                    return False
                if dst is not None:
                    self._write(i, slot, dst)
            if defer and dst is not None:
                self._in_flight = True
                self._deferred = [
                    (order[p], p % n_slots) for p in range(max(0, n_chunks - n_slots), n_chunks)
                ]
            else:
                self._drain()
        except BaseException:
            try:
                self._drain()
            except BaseException:  # noqa: BLE001 - the first error is the one the caller needs
                pass
            raise
        return True

    # ------------------------------------------------------------------------------- deferred write-back
    @property
    def writes_in_flight(self) -> bool:
        """True while a step's last writes may still be running (until the next `settle()`)."""
        return self._in_flight

    def settle(self) -> None:
        """Wait for the writes a step left in flight. If one failed, go back to the previous copy.

        Does not raise: the failure is kept as a `DeferredWriteError` for the caller's next step (see the
        module docstring for who raises it when). Idempotent and cheap when nothing is in flight.
        """
        if self._held:
            self._write_held()
            return
        if not self._in_flight:
            return
        self._in_flight = False
        t0 = time.perf_counter()
        try:
            self._drain()
        except OSError as e:
            if self._fallback is not None:  # committed: write the chunks again from their slots
                self._held = True
                self._write_held(e)
            else:
                self._lose_step(e)
        finally:
            self.stats.write_back_wait_s += time.perf_counter() - t0
            if not self._pending and not self._held:
                self._fallback = None  # committed and durable (or aborted): nothing to go back to

    def _write_held(self, first: Optional[OSError] = None) -> None:
        """Write the held chunks (the last step's, still in their slots) to the live copy again, and wait.
        Success: the step is durable. Failure: it stays held, with a `DeferredWriteError` (steps_lost 0)."""
        dst = self._files[self._live]
        try:
            for i, slot in self._deferred:
                self._write(i, slot, dst)
            self._drain()
        except OSError as e:
            path = getattr(e, "filename", None) or dst.path
            err = DeferredWriteError(
                e.errno or 0,
                f"writing back the optimizer state of the last step to {path} failed after the step returned "
                f"({e.strerror or e}), and again when retried; that step is held in memory and written again "
                "before the state is next used: nothing is lost, and this call changed nothing",
                path,
                steps_lost=0,
            )
            err.__cause__ = first if first is not None else e
            self._lost, self._lost_raised = err, False
            return
        self._held, self._deferred, self._fallback = False, [], None
        self._lost, self._lost_raised = None, False

    def _lose_step(self, e: OSError) -> None:
        if self._fallback is not None:
            lost_copy, self._live, self._fallback = self._live, self._fallback, None
        elif self._pending:
            lost_copy, self._pending = self._spare, False  # not committed yet: commit() raises instead
        else:
            return  # an aborted step's writes: that copy was never going to be the state
        path = getattr(e, "filename", None) or self._files[lost_copy].path
        err = DeferredWriteError(
            e.errno or 0,
            f"writing back the optimizer state of the last step to {path} failed after the step returned "
            f"({e.strerror or e}); that step is not durable: the optimizer state is back at the step "
            "before it",
            path,
        )
        err.__cause__ = e
        self._lost, self._lost_raised = err, False

    def _raise_lost(self, always: bool) -> None:
        """Raise a kept deferred failure: `always` (a step) consumes it, otherwise only once. A held step's
        failure is raised every time and stays until a settle writes the step."""
        err = self._lost
        if err is None:
            return
        if self._held:
            raise err
        if always:
            self._lost = None
            raise err
        if not self._lost_raised:
            self._lost_raised = True
            raise err

    # ---------------------------------------------------------------------------------------------- public
    def prefetch(self) -> None:
        """Queue the reads of the first chunks (one per slot) now, e.g. while backward still runs.

        The next `step` starts with them in flight. Any other pass over the slots (read_all, load)
        discards them, so a prefetch is never stale. The last step's deferred writes are settled first
        (the slots are about to be refilled, and the live copy read); a failure of one of them is kept
        for the next `step`, which raises it before touching anything.
        """
        self._check_open()
        if self._prefetched:
            return
        self.settle()
        if self._lost is not None:
            return
        src = self._files[self._live]
        order = self.step_order
        count = min(len(self._slots), len(order))
        for p in range(count):
            self._wait(p)
            self._read(order[p], p, src)
        self._prefetched = count
        self._prefetch_order = list(order)

    def step(self, fn: ChunkFn, ready: Optional[ReadyFn] = None) -> bool:
        """Run `fn` over every chunk of the live state (in `step_order`), writing results to the spare copy.

        Returns False (and stops early) when `fn` returns False, or `ready(i)` (called before chunk i's
        update, e.g. to wait until its gradients are final) returns False. The result becomes the state
        only after `commit()`; `abort()` (or simply not committing) keeps the previous state. With deferred
        write-back it returns with the last writes in flight. Raises `DeferredWriteError` (before running
        any chunk) when the previous step's deferred writes failed: the state is then the one before it.
        """
        self._check_open()
        self.settle()
        self._raise_lost(always=True)
        self._pending = False
        ok = self._pipeline(
            self._files[self._live],
            self._files[self._spare],
            fn,
            use_prefetch=True,
            order=self.step_order,
            ready=ready,
            defer=self.defer_writes and self.copies > 1,
        )
        self._pending = ok
        return ok

    def take_lost(self) -> Optional[DeferredWriteError]:
        """Settle the deferred writes and hand over a failure of theirs that no `step` has raised yet.

        The caller takes over undoing its side of the lost step (the swapper is back at the step before
        it): the failure is forgotten here, so a later `step`, `read_all` or `close` does not raise it again.
        """
        self._check_open()
        self.settle()
        if self._held:  # not forgotten: the step is still held and its writes still due
            return self._lost
        err, self._lost, self._lost_raised = self._lost, None, False
        return err

    def keep_lost(self, err: DeferredWriteError) -> None:
        """Keep a failure a discarded step had taken (raised to it), for the next `step` or `take_lost`."""
        self._lost, self._lost_raised = err, False

    def rewrite(self, fn: Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]) -> None:
        """Read every chunk of the live state, let `fn(start, n, master, states)` change it, write it back.

        With two copies the chunks go to the spare copy, which becomes live only once every write finished
        (atomic: a failure leaves the state as it was); with one copy they are written in place, so a
        failure part way leaves some chunks changed. No write is left in flight. Raises a deferred write
        failure of the last step first (the engine takes it with `take_lost` before).
        """
        self._check_open()
        self.settle()
        self._raise_lost(always=True)
        self._pending = False

        def visit(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> bool:
            fn(start, n, master, states)
            return True

        self._pipeline(self._files[self._live], self._files[self._spare], visit)
        self._live = self._spare

    def commit(self) -> None:
        """Make the last step's copy the state (live-pending while its writes are in flight)."""
        self._raise_lost(always=True)  # the step being committed lost its writes already
        if not self._pending:
            raise RuntimeError("OptimizerSwapper.commit() without a completed step")
        previous, self._live = self._live, self._spare
        self._pending = False
        self._fallback = previous if self._in_flight else None

    def abort(self) -> None:
        """Drop the step in progress: wait for its writes to the spare copy (errors ignored); the committed
        state stays."""
        self._pending = False
        if self._in_flight:
            # The aborted step's writes went to the spare copy, which is not the state: wait for them (the
            # slots must be quiet before reuse) but their errors do not matter.
            self._in_flight = False
            try:
                self._drain()
            except OSError:
                pass

    def read_all(self, fn: Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]) -> None:
        """Call `fn(start, n, master, states)` on every chunk of the live state (views valid in the call).

        Raises a deferred write failure of the last step (once; the state read afterwards is the one
        before that step).
        """
        self._check_open()
        self.settle()
        self._raise_lost(always=False)

        def visit(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> bool:
            fn(start, n, master, states)
            return True

        self._pipeline(self._files[self._live], None, visit)

    def load(
        self, fn: Callable[[int, int, torch.Tensor, List[torch.Tensor]], None], *, states_zero: bool = False
    ) -> None:
        """Replace the whole state: `fn(start, n, master, states)` fills each chunk's views; atomic.

        `states_zero`: a new optimizer. `fn` fills only `master`; every state starts at zero. Into a copy
        nothing has written yet (fallocated: it reads as zeros) only the masters are written, which saves
        zeroing and writing two thirds of the bytes (Adam) when the engine starts.
        Waits for any deferred writes; a failure among them no longer matters (the state is replaced).
        """
        self._check_open()
        self.settle()
        self._lost, self._held, self._deferred = None, False, []
        self._pending = False
        master_only = states_zero and self._fresh[self._spare]

        def fill(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> bool:
            fn(start, n, master, states)
            if states_zero and not master_only:
                for t in states:
                    t.zero_()
            return True

        self._master_only = master_only
        try:
            self._pipeline(None, self._files[self._spare], fill)
        finally:
            self._master_only = False
        self._live = self._spare

    def close(self) -> None:
        """Release the staging slots and aio handles (the swap files belong to the SwapSpace).

        Deferred writes are finished first; if one failed and nobody was told yet, the `DeferredWriteError`
        is raised after everything is released.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.settle()
        except BaseException:  # noqa: BLE001 - a non-I/O failure of the wait: still free everything
            pass
        for h in self._handles:
            try:
                h.wait()
            except BaseException:  # noqa: BLE001 - closing after a failed step must still free everything
                pass
            close = getattr(h, "close", None)
            if close is not None:
                close()
        self._handles.clear()
        for s in self._slots:
            self._pool.free(s)
        self._slots.clear()
        if self._held and self._lost is not None:  # the held step goes with the slots
            held, self._held = self._lost, False
            reason = getattr(held.__cause__, "strerror", None) or held.__cause__
            self._lost = DeferredWriteError(
                held.errno or 0,
                f"writing back the optimizer state of the last step to {held.filename} kept failing "
                f"({reason}) until the swapper was closed: that step is lost",
                held.filename,
            )
            self._lost.__cause__ = held.__cause__
        self._raise_lost(always=False)
