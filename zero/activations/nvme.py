"""The NVMe tier of the activation stash: checkpoints in per-pass scratch files of a swap space.

`NvmeTier` (offload_device "nvme") moves checkpoints through pinned staging memory into a scratch file of
the swap space, written and read by one I/O thread with the aio core (O_DIRECT), so the compute thread never
blocks on the disk except to wait for a read it needs now. One scratch file per pass (a forward and its
backward): 0600 in the swap space's private directory, grown on the compute thread (a full disk fails in the
forward, naming the file and the size), removed once the pass's last checkpoint is released; an I/O error
fails the pass and the next pass writes a new file. Restored tensors are allocated on the compute thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.config.aio import AioConfig
from offload.pinned import PinnedPool
from offload.swap.space import SwapFile, SwapSpace, align_up
from zero.activations.tiers import Entry, HostBuffers, HostTier, Tier, bytes_view

__all__ = ["NvmeTier"]

logger = logging.getLogger("zero")


class _ScratchPass:
    """One pass's scratch file: its name, size, bytes reserved, and the first I/O error seen in it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path: Optional[str] = None
        self.file: Optional[SwapFile] = None  # opened relative to the space's directory fd, never by path
        self.size = 0
        self.cursor = 0
        self.error: Optional[BaseException] = None

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"activation checkpoint I/O on {self.path} failed earlier in this pass: {self.error}"
            ) from self.error


class NvmeTier(Tier):
    """offload_device "nvme": a scratch file per pass, written and read on one I/O thread."""

    name = "nvme"

    def __init__(self, nvme_path: str, aio: AioConfig, pool: PinnedPool, slots: Optional[int] = None) -> None:
        self.space = SwapSpace(nvme_path, prefix="zero-offload-act-")
        try:
            self._aio = aio.handle()
        except BaseException:
            self.space.close()
            raise
        self._alignment = max(self.space.alignment, self._aio.get_alignment())
        self._pool = pool
        self._buffers = HostBuffers(pool, None)
        self._host = HostTier(self._buffers)  # device tensors stage through pinned memory on a side stream
        self._slots = slots
        self._staging: Dict[str, Optional[torch.Tensor]] = {}  # pinned, used by the I/O thread only
        self._jobs: queue.SimpleQueue[Optional[Tuple[Callable[[], Any], Future]]] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._passes = 0
        self._high_water = 0  # the largest pass so far: the next file is allocated at that size at once
        self._io = {"nvme_write_bytes": 0, "nvme_read_bytes": 0}
        self._io_lock = threading.Lock()
        self._closed = False

    # -- the I/O thread --------------------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> Future:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zero-act-io", daemon=True)
            self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to whoever waits for this job
                fut.set_exception(e)

    def _stage(self, kind: str, nbytes: int) -> torch.Tensor:
        buf = self._staging.get(kind)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._staging[kind] = None
                self._pool.free(buf)
            buf = self._staging[kind] = self._pool.allocate(nbytes, torch.uint8, populate="sync")
        return buf

    def _count(self, key: str, n: int) -> None:
        with self._io_lock:
            self._io[key] += n

    # -- the tier --------------------------------------------------------------------------------------------

    def moves(self, t: torch.Tensor) -> bool:
        """True: every tensor is written to the scratch file."""
        return True

    def begin_pass(self) -> _ScratchPass:
        """A new scratch file for this pass's offloads."""
        p = _ScratchPass(f"pass-{self._passes}.bin")
        self._passes += 1
        return p

    def _reserve(self, p: _ScratchPass, nbytes: int) -> int:
        """Room for `nbytes` in the pass's file, which is created or grown here, on the compute thread: a full
        disk fails the forward at the checkpoint that did not fit."""
        p.check()
        offset = p.cursor
        p.cursor = offset + align_up(nbytes, self._alignment)
        if p.path is None:
            first = max(p.cursor, self._high_water, (self._slots or 0) * (p.cursor - offset))
            f = self.space.create(p.name, first)
            p.file, p.path, p.size = f, f.path, f.nbytes
            self._aio.register_file(f)
        elif p.cursor > p.size:
            p.size = self.space.grow(p.name, max(p.cursor, 2 * p.size)).nbytes
        return offset

    def offload(self, entry: Entry, pass_token: Any) -> int:
        """Queue the write of `entry`'s bytes to the pass's scratch file (staged through pinned memory from a
        device); the bytes moved."""
        p: _ScratchPass = pass_token
        offset = self._reserve(p, entry.nbytes)
        length = align_up(entry.nbytes, self._alignment)
        src: Optional[torch.Tensor] = None
        staged = None
        if entry.device.type == "cpu":
            src, entry.tensor = entry.tensor, None
        else:
            self._host.offload(entry, None)  # device -> pinned on the side stream; the I/O thread waits
            staged = entry.token

        def write() -> None:
            nonlocal src
            if staged is not None:
                buf, key, done, _ = staged
                done.synchronize()
            else:
                buf = self._stage("write", length)
                buf[: entry.nbytes].copy_(bytes_view(src))
                src = None  # the compute thread's memory goes back now
            try:
                p.check()
                self._aio.sync_pwrite(buf[:length], p.file, offset)
            except BaseException as e:
                p.error = p.error or e
                raise
            finally:
                if staged is not None:
                    self._buffers.give(key)
            self._count("nvme_write_bytes", length)

        entry.token = [p, offset, self._submit(write), None]
        return entry.nbytes

    def prefetch(self, entry: Entry) -> bool:
        """Queue the read of `entry` back from the scratch file; False if it was queued already."""
        token = entry.token
        if token[3] is not None:
            return False
        p, offset, written, _ = token
        length = align_up(entry.nbytes, self._alignment)

        def read() -> Tuple[torch.Tensor, Any]:
            written.result()  # a failed write fails its read
            p.check()
            buf, key = self._buffers.take(length)  # recycled pinned memory, handed back by restore
            try:
                self._aio.sync_pread(buf[:length], p.file, offset)
            except BaseException as e:
                self._buffers.give(key)
                p.error = p.error or e
                raise
            self._count("nvme_read_bytes", length)
            return buf, key

        token[3] = self._submit(read)
        return True

    def restore(self, entry: Entry) -> torch.Tensor:
        """Wait for `entry`'s read and return its tensor on its device; a failed read raises RuntimeError
        naming the file."""
        self.prefetch(entry)
        p, read = entry.token[0], entry.token[3]
        entry.token = None
        error = read.exception()  # not re-raised as is: the stored error must not hold the caller's frames
        if error is not None:
            raise RuntimeError(
                f"restoring a checkpointed block's input from {p.path} failed: {error}; the step cannot go on"
                " (the next pass writes a new scratch file)"
            ) from error
        buf, key = read.result()
        # allocated here, on the compute thread: its memory is the compute thread's to reuse (a tensor made on
        # the I/O thread would come from that thread's malloc arena and swell the process)
        out = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
        out.copy_(buf[: entry.nbytes])  # synchronous: the pinned buffer is free again after it
        self._buffers.give(key)
        return entry.from_bytes(out)

    def release(self, entry: Entry) -> None:
        """Forget `entry`: its bytes in the scratch file go with the pass."""
        entry.token = None  # its bytes in the scratch file go with the pass

    def end_pass(self, pass_token: Any) -> None:
        """Delete the pass's scratch file once its queued writes and reads are done."""
        p: _ScratchPass = pass_token
        if p.path is None:
            return
        self._high_water = max(self._high_water, p.cursor)

        def drop() -> None:  # queued behind the pass's last write and read
            try:
                self._aio.unregister_file(p.file)
            finally:
                self.space.remove(p.name)

        error = self._submit(drop).exception()  # gone when the pass is: a later listing never shows it
        if error is not None:
            logger.warning("could not close activation scratch file %s: %s", p.path, error)

    def flush(self) -> None:
        """Wait until every write and read started so far has finished."""
        if self._thread is not None:
            self._submit(lambda: None).result()

    def take_io(self) -> Dict[str, int]:
        """NVMe bytes written and read since the last call (resets the counts)."""
        with self._io_lock:
            out, self._io = self._io, {"nvme_write_bytes": 0, "nvme_read_bytes": 0}
        return out

    def scratch_files(self) -> List[str]:
        """Paths of the scratch files that exist now (one per pass whose inputs are still alive)."""
        return [f.path for f in self.space.files]

    def close(self) -> None:
        """Stop the I/O thread after its queued jobs and close the aio handle; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
        self._aio.close()
        for buf in self._staging.values():
            if buf is not None:
                self._pool.free(buf)
        self._host.close()
        self.space.close()
