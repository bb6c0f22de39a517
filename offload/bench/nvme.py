"""Timed sequential reads and writes of one benchmark file through our async I/O library.

Honesty rules, so the numbers mean the drive and not a cache:
- O_DIRECT whenever the filesystem allows it; when it refuses, buffered I/O with the writes' fsync inside
  the timed region and the file's pages dropped (fsync + POSIX_FADV_DONTNEED) before every read, and the
  profile says so.
- Before each read the sampled pages of the buffer are poisoned; after it they must hold the pattern
  again, so a read that moved nothing, or the wrong bytes, fails instead of looking fast.
"""

from __future__ import annotations

import errno as errno_mod
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .errors import BenchError
from .grid import AioParams, MiB
from .pattern import PAGE, Pattern

GB = 1e9  # bandwidths are decimal GB/s, as drive vendors and fio's "GB/s" use them
LAYOUT_PARAMS = AioParams(1 * MiB, 32, 1, False, True, "auto")


@dataclass
class Sample:
    """One timed pass: wall seconds, CPU seconds and bytes moved."""

    seconds: float
    cpu_seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        """GB/s of this sample."""
        return self.nbytes / self.seconds / GB

    @property
    def cpu_s_per_gb(self) -> float:
        """CPU seconds per GB moved."""
        return self.cpu_seconds / (self.nbytes / GB)


@dataclass
class Measurement:
    """The read and write samples of one parameter set."""

    params: AioParams
    read: List[Sample] = field(default_factory=list)
    write: List[Sample] = field(default_factory=list)

    def gbps(self, op: str) -> Optional[float]:
        """Median GB/s of the `op` ("read" or "write") samples; None without any."""
        samples = getattr(self, op)
        return statistics.median(s.gbps for s in samples) if samples else None

    def cpu_s_per_gb(self, op: str) -> Optional[float]:
        """Median CPU seconds per GB of the `op` samples; None without any."""
        samples = getattr(self, op)
        return statistics.median(s.cpu_s_per_gb for s in samples) if samples else None

    def combined_gbps(self) -> Optional[float]:
        """Bandwidth of moving the same bytes in and out (harmonic mean): what a swap round trip sees."""
        r, w = self.gbps("read"), self.gbps("write")
        if r is None or w is None:
            return None
        return 2.0 / (1.0 / r + 1.0 / w)

    def as_dict(self) -> Dict[str, Any]:
        """The settings and per-op medians, CPU costs and sample GB/s as JSON-ready values."""
        out: Dict[str, Any] = dict(self.params.as_dict())
        for op in ("read", "write"):
            out[f"{op}_gbps"] = self.gbps(op)
            out[f"{op}_cpu_s_per_gb"] = self.cpu_s_per_gb(op)
            out[f"{op}_samples_gbps"] = [round(s.gbps, 4) for s in getattr(self, op)]
        out["combined_gbps"] = self.combined_gbps()
        return out


def describe_os_error(e: BaseException, doing: str) -> str:
    """One line naming the operation, file, offset and errno of a failed I/O."""
    if not isinstance(e, OSError):
        return f"{doing}: {e}"
    code = e.errno
    name = errno_mod.errorcode.get(code, "?") if code is not None else "?"
    parts = [doing]
    filename = getattr(e, "filename", None)
    if filename:
        parts.append(str(filename))
    offset = getattr(e, "offset", None)
    if offset is not None:
        parts.append(f"at offset {offset}")
    text = e.strerror or str(e)
    hint = ""
    if code in (errno_mod.ENOSPC, errno_mod.EFBIG, errno_mod.EDQUOT):
        hint = " (the disk, quota or file size limit is full: use a smaller --size or another --path)"
    return f"{' '.join(parts)} failed: {text} (errno {code} {name}){hint}"


class BenchFile:
    """The benchmark file in --path, the pinned buffer that feeds it, and the timed operations."""

    def __init__(self, directory: str, size: int, buffer_bytes: int, seed: int = 20240611) -> None:
        from offload import _aio
        from offload.pinned import alloc_host_buffer

        self._aio = _aio
        self.directory = directory
        self.path = os.path.join(directory, f".ds_nvme_bench.{os.getpid()}.dat")
        self.size = size
        self.buffer_bytes = min(buffer_bytes, size)
        self.pattern = Pattern(seed)
        self.direct = True
        self.notes: List[str] = []
        self._created = False
        self._cleanup: Any = None  # offload.cleanup registration that removes the file on exit or SIGTERM
        # Our pinned buffers (huge pages, page-locked), as the engine's swappers use them.
        self._buf: Any = alloc_host_buffer(self.buffer_bytes)
        self.buffer_locked = bool(self._buf.locked)
        self.buffer_huge_pages = bool(self._buf.huge_pages)
        self.view: np.ndarray = np.ctypeslib.as_array(self._buf.as_ctypes())
        self.pattern.fill(self.view)
        self.npages = self.buffer_bytes // PAGE

    # -- lifecycle ---------------------------------------------------------------------------------
    def _remove_file(self) -> None:
        if self._created:
            self._created = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Remove the file and free its pinned buffer; a second call does nothing."""
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup()  # removes the file (once) and drops the registration
        self._remove_file()
        if self._buf is not None:
            self.view = np.empty(0, dtype=np.uint8)
            self._buf.release()
            self._buf = None

    def __enter__(self) -> BenchFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def handle(self, params: AioParams) -> Iterator[Any]:
        """An aio handle with `params`, closed on exit."""
        try:
            h = self._aio.Handle(
                block_size=params.block_size,
                queue_depth=params.queue_depth,
                single_submit=params.single_submit,
                overlap_events=params.overlap_events,
                intra_op_parallelism=params.intra_op_parallelism,
                backend=params.backend,
                direct="on" if self.direct else "off",
            )
        except (ValueError, RuntimeError) as e:
            raise BenchError(f"cannot create an I/O handle with {params.label()}: {e}") from None
        try:
            yield h
        finally:
            h.close()

    def _chunks(self) -> List[Tuple[int, int]]:
        return [
            (off, min(self.buffer_bytes, self.size - off)) for off in range(0, self.size, self.buffer_bytes)
        ]

    # -- preparation -------------------------------------------------------------------------------
    def layout(self) -> None:
        """Write the whole file once (untimed), so every measurement overwrites allocated blocks, as fio does.

        This is also where O_DIRECT is tried and where a full disk shows up first. From here on the file is
        removed by close(), at normal exit, and on SIGTERM/SIGHUP (offload.cleanup), whichever comes first.
        """
        from offload.cleanup import register

        if self._cleanup is None:
            self._cleanup = register(self._remove_file)
        self._created = True  # before the file exists, so that no moment has it on disk and unaccounted for
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except BaseException:
            self._created = False  # not ours to remove
            raise
        os.close(fd)
        try:
            self._layout_once()
        except OSError as e:
            if e.errno != errno_mod.EINVAL or not self.direct:
                raise
            # O_DIRECT refused (EINVAL at open): measure buffered I/O, with the precautions in the module doc.
            self.direct = False
            self.notes.append(
                f"O_DIRECT refused on {self.directory} ({e.strerror}): measured buffered I/O with fsync "
                "in the timed writes and the page cache dropped before every read"
            )
            self._layout_once()
        written = os.stat(self.path).st_size
        if written < self.size:
            raise BenchError(f"writing {self.path}: only {written} of {self.size} bytes reached the file")

    def _layout_once(self) -> None:
        with self.handle(LAYOUT_PARAMS) as h:
            for off, n in self._chunks():
                moved = h.pwrite(self._buf.ptr, n, self.path, off, False)
                if moved != n:
                    raise BenchError(f"writing {self.path} at offset {off}: wrote {moved} of {n} bytes")
        self._sync_and_drop()

    def _sync_and_drop(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    # -- timed operations --------------------------------------------------------------------------
    def _timed(self, body: Callable[[], None]) -> Sample:
        cpu0, t0 = time.process_time(), time.perf_counter()
        body()
        t1, cpu1 = time.perf_counter(), time.process_time()
        return Sample(seconds=max(t1 - t0, 1e-9), cpu_seconds=cpu1 - cpu0, nbytes=self.size)

    def write(self, h: Any) -> Sample:
        """Time writing the buffer to the file through `h` (fsynced unless O_DIRECT)."""

        def body() -> None:
            for off, n in self._chunks():
                h.pwrite(self._buf.ptr, n, self.path, off, True)
            h.wait()
            if not self.direct:
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        return self._timed(body)

    def read(self, h: Any, what: str) -> Sample:
        """Time reading the file back through `h` after dropping the page cache, then verify sampled pages."""
        self._sync_and_drop()
        sample = self.pattern.sample(self.npages)
        self.pattern.poison(self.view, sample)

        def body() -> None:
            for off, n in self._chunks():
                h.pread(self._buf.ptr, n, self.path, off, True)
            h.wait()

        result = self._timed(body)
        try:
            self.pattern.verify(self.view, sample, f"read of {self.path} with {what}")
        finally:
            # The buffer is the source of the next write: put the pattern back whatever the read did.
            self.pattern.fill(self.view)
        return result

    def verify_file(self, what: str) -> None:
        """Check sampled pages of the file itself (write-only runs have no timed read to do it)."""
        self._sync_and_drop()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for index in self.pattern.sample(max(1, self.size // PAGE), count=32):
                offset = int(index) * PAGE
                data = np.frombuffer(os.pread(fd, PAGE, offset), dtype=np.uint8)
                buffer_page = (offset % self.buffer_bytes) // PAGE
                self.pattern.verify_page(data, buffer_page, f"file written with {what}", file_offset=offset)
        finally:
            os.close(fd)


def run_sweep(
    bench: BenchFile,
    points: Sequence[AioParams],
    ops: Sequence[str],
    repeats: int,
    on_step: Callable[[str], None],
) -> List[Measurement]:
    """Measure every point `repeats` times, in rounds (all points, then all again), so that a burst of
    load from other processes costs one sample of many configurations rather than all of one."""
    measurements = [Measurement(p) for p in points]
    for _ in range(repeats):
        for m in measurements:
            what = m.params.label()
            with bench.handle(m.params) as h:
                try:
                    if "write" in ops:
                        m.write.append(bench.write(h))
                        if "read" not in ops:
                            bench.verify_file(what)
                    if "read" in ops:
                        m.read.append(bench.read(h, what))
                except OSError as e:
                    raise BenchError(describe_os_error(e, f"I/O with {what}:")) from None
            on_step(_step_text(m))
    return measurements


def _step_text(m: Measurement) -> str:
    parts = [m.params.label()]
    for op, samples in (("read", m.read), ("write", m.write)):
        if samples:
            parts.append(f"{op} {samples[-1].gbps:.2f} GB/s")
    return "  ".join(parts)


def best(
    measurements: Sequence[Measurement], key: Callable[[Measurement], Optional[float]]
) -> Optional[Measurement]:
    """The measurement with the highest `key` (None values skipped), or None if none has one."""
    scored = [(key(m), i) for i, m in enumerate(measurements) if key(m) is not None]
    if not scored:
        return None
    return measurements[max(scored)[1]]
