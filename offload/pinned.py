"""Pinned host buffers: exact size, 2 MiB aligned, huge pages and page-locking where the system allows.

The memory comes from `offload._aio.alloc_pinned` (mmap + madvise/MAP_HUGETLB + mlock, no torch). This module
adds what the C++ core must not know about:

* the one-time warning when RLIMIT_MEMLOCK stops page-locking (with the limit and how to raise it);
* registration with CUDA (`cudaHostRegister`) when torch has CUDA, undone before the memory is freed;
* torch views (`pinned_tensor`) that keep the allocation alive for exactly as long as any view exists;
* process-wide accounting (`pinned_bytes_in_use`) and a capped, thread-safe `PinnedPool`;
* buffers pinned in part (`lock_range`, `PinnedPool.allocate_partly`): one contiguous tensor of which only
  a range of pages is page-locked (and CUDA-registered), the rest ordinary pageable memory.

When the pages fault in (`populate`): page-locking with mlock faults in every page before it returns, which
for the gigabytes of staging buffers an engine takes costs seconds at initialisation. `pinned_tensor` and
`PinnedPool` therefore lock with MLOCK_ONFAULT and let a thread of each buffer fault the pages in
("background") while the caller goes on; `alloc_host_buffer` keeps the synchronous default ("sync"). The
memory is usable at once either way, its bytes are charged to the budget at allocation, and a fresh buffer
reads as zeros (anonymous memory), so callers need no `zero_()` pass.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Mapping, Optional, Tuple

from offload import _aio

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGNMENT",
    "CGROUP_ROOT",
    "LOCAL_WORLD_SIZE_ENVS",
    "PINNED_BUDGET_ENV",
    "automatic_pinned_budget",
    "cgroup_memory_limit",
    "default_pinned_budget",
    "local_world_size",
    "physical_memory_bytes",
    "HostBuffer",
    "MemlockLimitWarning",
    "PinnedMemoryBudgetError",
    "PinnedPool",
    "Populate",
    "alloc_host_buffer",
    "pinned_bytes_in_use",
    "pinned_tensor",
]

ALIGNMENT = 2 << 20  # one huge page: lets the kernel back the buffer with 2 MiB pages

# "sync": pages faulted in before the allocation returns; "background": by a thread of the buffer;
# "none": on first touch. Only locked buffers are populated ahead of use.
Populate = Literal["sync", "background", "none"]
_POPULATE_MODES = ("sync", "background", "none")


class MemlockLimitWarning(UserWarning):
    """Pinned buffers could not be page-locked because of RLIMIT_MEMLOCK; they work, unlocked."""


class PinnedMemoryBudgetError(MemoryError):
    """An allocation would take a PinnedPool past its byte cap."""

    def __init__(self, requested: int, in_use: int, cap: int) -> None:
        super().__init__(
            f"pinned memory budget exceeded: requested {requested} bytes with {in_use} bytes in use, "
            f"cap {cap} bytes ({cap - in_use} bytes free)"
        )
        self.requested = requested
        self.in_use = in_use
        self.cap = cap


_accounting_lock = threading.Lock()
_live_bytes = 0
_warned_memlock = False


def pinned_bytes_in_use() -> int:
    """Bytes of pinned host memory allocated through this module and not yet freed, process-wide."""
    with _accounting_lock:
        return _live_bytes


def _format_limit(value: int) -> str:
    if value == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{value // 1024} KiB"


def _warn_unlocked_once(nbytes: int, lock_errno: int) -> None:
    global _warned_memlock
    with _accounting_lock:
        if _warned_memlock:
            return
        _warned_memlock = True
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    warnings.warn(
        f"pinned host buffers are not page-locked (mlock of {nbytes} bytes failed, errno {lock_errno}): "
        f"RLIMIT_MEMLOCK is {_format_limit(soft)} (hard limit {_format_limit(hard)}). They still work, but "
        "the kernel may page them out and CUDA copies from them are slower. Raise the limit with "
        "`ulimit -l unlimited` in the launching shell, a `memlock` line in /etc/security/limits.conf, "
        "LimitMEMLOCK=infinity for systemd services, or `--ulimit memlock=-1` for docker. "
        "This warning is shown once per process.",
        MemlockLimitWarning,
        stacklevel=4,
    )


def _cuda_runtime() -> Optional[Any]:
    """torch's cudart binding when CUDA is usable, else None. Never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MLOCK_ONFAULT = 1  # linux/mman.h


def _page_range(byte_range: Tuple[int, int], nbytes: int) -> Tuple[int, int]:
    """[start, end) rounded out to whole pages within [0, nbytes); (0, 0) when empty."""
    start, end = int(byte_range[0]), int(byte_range[1])
    if not 0 <= start <= end <= nbytes:
        raise ValueError(f"lock_range {byte_range} is not a byte range within the buffer's {nbytes} bytes")
    if start == end:
        return 0, 0
    return start // PAGE_BYTES * PAGE_BYTES, min(nbytes, -(-end // PAGE_BYTES) * PAGE_BYTES)


def _lock_pages(ptr: int, nbytes: int, populate: Populate) -> int:
    """Page-lock [ptr, ptr + nbytes) of a mapping: mlock (faults every page in) for "sync", else
    mlock2(MLOCK_ONFAULT) (each page is locked as it faults in). Returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    addr, size = ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes)
    if populate != "sync" and hasattr(libc, "mlock2"):
        rc = libc.mlock2(addr, size, ctypes.c_uint(_MLOCK_ONFAULT))
    else:
        rc = libc.mlock(addr, size)
    return 0 if rc == 0 else ctypes.get_errno()


class HostBuffer:
    """One pinned host allocation and its CUDA registration, freed in the right order exactly once.

    Views (`as_ctypes`, tensors from `pinned_tensor`) hold a reference to this object, so the memory lives
    until the last view is gone; `release()` frees it at once and is only safe when no view is in use, except
    that memory an `offload.aio` request is reading into or writing from is unmapped once the request is done.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        huge_pages: bool = True,
        lock: bool = True,
        cudart: Any = None,
        populate: Populate = "sync",
        lock_range: Optional[Tuple[int, int]] = None,
    ) -> None:
        """`lock_range`: byte range [start, end) that alone is pinned (rounded out to whole pages; the
        rest of the buffer is pageable); None: all of it (when `lock`)."""
        global _live_bytes
        if nbytes <= 0:
            raise ValueError(f"pinned buffer size must be positive, got {nbytes} bytes")
        if populate not in _POPULATE_MODES:
            raise ValueError(f"populate must be one of {_POPULATE_MODES}, got {populate!r}")
        start, end = 0, nbytes
        if lock_range is not None:
            start, end = _page_range(lock_range, nbytes)
        whole = (start, end) == (0, nbytes)
        self._buf = _aio.alloc_pinned(nbytes, ALIGNMENT, huge_pages, lock and whole, populate)
        self._mem = self._buf  # kept after release(): ends the I/O holds that release() waits for
        self.nbytes = nbytes
        self.ptr: int = self._buf.ptr
        self.locked: bool = self._buf.locked
        self.huge_pages: bool = self._buf.huge_pages
        self._cudart = cudart
        self.cuda_registered = False
        self.pinned_range = (start, end)  # the bytes page-locked for the device
        self.pinned_nbytes = end - start
        with _accounting_lock:
            _live_bytes += self.pinned_nbytes
        lock_errno = self._buf.lock_errno
        if lock and not whole and self.pinned_nbytes:
            lock_errno = _lock_pages(self.ptr + start, self.pinned_nbytes, populate)
            self.locked = lock_errno == 0
        if lock and self.pinned_nbytes and not self.locked:
            _warn_unlocked_once(self.pinned_nbytes, lock_errno)
        if cudart is not None and self.pinned_nbytes:
            # cudaHostRegisterDefault (0): page-locks for the device; works on unlocked memory as well.
            err = cudart.cudaHostRegister(self.ptr + start, self.pinned_nbytes, 0)
            if int(err) != 0:
                self.release()
                raise RuntimeError(
                    f"cudaHostRegister of {self.pinned_nbytes} bytes at {self.ptr + start:#x} failed: {err}"
                )
            self.cuda_registered = True

    def as_ctypes(self) -> ctypes.Array:
        """A writable ctypes byte array over the buffer that keeps this object alive."""
        if self._buf is None:
            raise ValueError("pinned buffer was already released")
        arr = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
        arr._zo_owner = self  # type: ignore[attr-defined]
        return arr

    @property
    def released(self) -> bool:
        """Whether the buffer was given back (its memory is gone)."""
        return self._buf is None

    def hold_io(self) -> None:
        """Keep the memory mapped until the matching `unhold_io()`, even if `release()` runs meanwhile
        (offload.aio holds every buffer it reads into or writes from until the request is done)."""
        if self._buf is None:
            raise ValueError("pinned buffer was already released")
        self._buf.hold_io()

    def unhold_io(self) -> None:
        """End a `hold_io()`; the memory is unmapped now if `release()` ran meanwhile."""
        self._mem.unhold_io()

    @property
    def populated(self) -> bool:
        """Every page is resident (faulted in and, when locked, locked). Always true once registered with
        CUDA: cudaHostRegister faults in and pins the whole range before it returns."""
        if self._buf is None:
            raise ValueError("pinned buffer was already released")
        return self.cuda_registered or bool(self._buf.populated)

    def wait_populated(self) -> None:
        """Block until a background population finished; OSError with its errno if it failed (the buffer
        still works: the remaining pages fault in on first touch)."""
        if self._buf is None:
            raise ValueError("pinned buffer was already released")
        err = self._buf.wait_populated()
        if err != 0:
            raise OSError(err, f"populating {self.nbytes} pinned bytes at {self.ptr:#x}: {os.strerror(err)}")

    def release(self) -> None:
        """Give the memory back (CUDA-unregistered first); a second call does nothing."""
        global _live_bytes
        buf, self._buf = self._buf, None
        if buf is None:
            return
        if self.cuda_registered:
            # Unregister while the pages still exist: CUDA must drop its mapping before munmap.
            self._cudart.cudaHostUnregister(self.ptr + self.pinned_range[0])
            self.cuda_registered = False
        buf.release()  # munmap: page locks of a partly pinned buffer go with its pages
        with _accounting_lock:
            _live_bytes -= self.pinned_nbytes

    def __del__(self) -> None:
        # Interpreter shutdown may have torn down module globals; the C++ object frees itself then.
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "released" if self._buf is None else f"ptr={self.ptr:#x}"
        return (
            f"HostBuffer({self.nbytes} bytes ({self.pinned_nbytes} pinned), {state}, locked={self.locked}, "
            f"huge_pages={self.huge_pages}, "
            f"cuda_registered={self.cuda_registered})"
        )


def alloc_host_buffer(
    nbytes: int,
    *,
    huge_pages: bool = True,
    lock: bool = True,
    populate: Populate = "sync",
    lock_range: Optional[Tuple[int, int]] = None,
) -> HostBuffer:
    """Allocate `nbytes` of pinned host memory (exact size, 2 MiB aligned, zero-filled), CUDA-registered if
    CUDA is up. `populate`: when its pages fault in (see the module doc). `lock_range`: only these bytes
    (whole pages) are pinned, the rest is pageable."""
    return HostBuffer(
        nbytes,
        huge_pages=huge_pages,
        lock=lock,
        cudart=_cuda_runtime(),
        populate=populate,
        lock_range=lock_range,
    )


def _itemsize(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def pinned_tensor(
    numel: int,
    dtype: torch.dtype,
    *,
    populate: Populate = "background",
    pinned: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements in pinned memory, all zeros; the memory is freed with the last
    view. Its pages fault in on a background thread by default (see the module doc). `pinned`: the element
    range [start, end) that alone is pinned (whole pages around it), the rest pageable."""
    import torch

    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    size = _itemsize(dtype)
    lock_range = None if pinned is None else (pinned[0] * size, pinned[1] * size)
    host = alloc_host_buffer(numel * size, populate=populate, lock_range=lock_range)
    with warnings.catch_warnings():
        # The ctypes array is writable; torch only warns for read-only buffers, but stay quiet regardless.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(host.as_ctypes(), dtype=dtype, count=numel)


PINNED_BUDGET_ENV = "ZERO_OFFLOAD_PINNED_BUDGET"

# Where the automatic budget looks for the memory limit of this process's cgroup. Module attributes (read at
# call time) so that tests can point them at fake trees.
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"

# Launchers' "processes on this node", first set one wins: torchrun / torch.distributed, the DeepSpeed
# launcher, Open MPI.
LOCAL_WORLD_SIZE_ENVS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")

# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number (9223372036854771712); v2 writes
# "max". Limits at or above 2**60 bytes (1 EiB) are read as no limit.
_CGROUP_NO_LIMIT = 1 << 60


def physical_memory_bytes() -> int:
    """Physical memory of the machine in bytes (what the kernel reports, not what a container may use)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _read_cgroup_limit(path: str) -> Optional[int]:
    """The byte limit in a memory.max / memory.limit_in_bytes file; None for absent, "max" or unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    if value <= 0 or value >= _CGROUP_NO_LIMIT:
        return None
    return value


def _cgroup_paths(self_cgroup: str) -> Dict[str, str]:
    """This process's cgroup per hierarchy from /proc/self/cgroup: "" for cgroup v2, "memory" for v1's
    memory controller. Empty when the file is missing (not Linux, or /proc not mounted)."""
    paths: Dict[str, str] = {}
    try:
        with open(self_cgroup, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths[""] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    return paths


def _ancestor_dirs(base: str, cgroup_path: Optional[str]) -> List[str]:
    """``base/<cgroup_path>`` and every directory above it, up to ``base`` itself: a limit set on any
    ancestor applies to this process too. A path with ".." (a cgroup outside this cgroup namespace) is not
    followed; only ``base`` is read then."""
    parts = [p for p in (cgroup_path or "").split("/") if p and p != "."]
    if ".." in parts:
        parts = []
    dirs = [os.path.join(base, *parts[:n]) for n in range(len(parts), 0, -1)]
    dirs.append(base)
    return dirs


def cgroup_memory_limit(root: Optional[str] = None, self_cgroup: Optional[str] = None) -> Optional[int]:
    """The memory limit of this process's cgroup in bytes, or None when there is none.

    Reads cgroup v2 ``memory.max`` and cgroup v1 ``memory/memory.limit_in_bytes`` under ``root`` (default
    /sys/fs/cgroup), in the process's own cgroup (from ``self_cgroup``, default /proc/self/cgroup) and each
    of its ancestors, and returns the tightest. Inside a container the container's limit is the one at
    ``root`` itself. "max" and values of 1 EiB or more mean no limit.
    """
    root = CGROUP_ROOT if root is None else root
    paths = _cgroup_paths(PROC_SELF_CGROUP if self_cgroup is None else self_cgroup)
    files = [os.path.join(d, "memory.max") for d in _ancestor_dirs(root, paths.get(""))]
    v1 = os.path.join(root, "memory")
    files += [os.path.join(d, "memory.limit_in_bytes") for d in _ancestor_dirs(v1, paths.get("memory"))]
    limits = [v for v in map(_read_cgroup_limit, files) if v is not None]
    return min(limits) if limits else None


def local_world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """Processes of this job on this node: the first of LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (DeepSpeed's
    launcher) and OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI) that holds a positive integer, else 1."""
    env = os.environ if environ is None else environ
    for name in LOCAL_WORLD_SIZE_ENVS:
        text = env.get(name, "").strip()
        try:
            value = int(text)
        except ValueError:
            continue
        if value >= 1:
            return value
    return 1


def automatic_pinned_budget(
    *,
    physical: Optional[int] = None,
    cgroup_root: Optional[str] = None,
    self_cgroup: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> int:
    """The pinned-memory cap of one process when nothing sets it: half of the memory this node's processes
    may use, min(physical memory, cgroup limit), divided among the local processes (`local_world_size`).

    Each argument overrides what would be read from the system: `physical` bytes of RAM, the cgroup tree at
    `cgroup_root` with this process's membership in the file `self_cgroup`, and the environment `environ`.
    """
    memory = physical_memory_bytes() if physical is None else int(physical)
    limit = cgroup_memory_limit(cgroup_root, self_cgroup)
    if limit is not None:
        memory = min(memory, limit)
    return memory // 2 // local_world_size(environ)


def default_pinned_budget(configured: Optional[int] = None) -> int:
    """The process's pinned-memory cap in bytes: `configured` (the config's zero_offload.pinned_budget_bytes)
    if given, else $ZERO_OFFLOAD_PINNED_BUDGET, else `automatic_pinned_budget()`: half of min(physical
    memory, cgroup memory limit), divided by the number of processes on this node."""
    if configured is not None:
        return int(configured)
    env = os.environ.get(PINNED_BUDGET_ENV)
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{PINNED_BUDGET_ENV} must be a byte count (an integer), got {env!r}") from None
        if value < 0:
            raise ValueError(f"{PINNED_BUDGET_ENV} must be >= 0, got {value}")
        return value
    return automatic_pinned_budget()


class PinnedPool:
    """Pinned tensors under a hard byte cap, with in-use and peak accounting. Thread-safe.

    `free(t)` returns the tensor's bytes to the budget; the memory itself goes back to the system when the
    tensor and all its views are gone (freeing memory a live tensor still points at would corrupt it).
    """

    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
        self._cap = int(cap_bytes)
        self._lock = threading.Lock()
        self._in_use = 0
        self._peak = 0
        self._live: Dict[int, int] = {}  # data_ptr -> bytes charged

    @property
    def cap_bytes(self) -> int:
        """The pool's cap in bytes."""
        return self._cap

    @property
    def bytes_in_use(self) -> int:
        """Bytes handed out and not yet freed."""
        with self._lock:
            return self._in_use

    @property
    def peak_bytes(self) -> int:
        """The most bytes in use at once so far."""
        with self._lock:
            return self._peak

    def allocate(self, numel: int, dtype: torch.dtype, *, populate: Populate = "background") -> torch.Tensor:
        """A pinned 1-D tensor of `numel` zeros; PinnedMemoryBudgetError if it would exceed the cap.
        `populate`: when its pages fault in (see the module doc); the bytes are charged now either way."""
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        return self._charged(numel * _itemsize(dtype), lambda: pinned_tensor(numel, dtype, populate=populate))

    def allocate_partly(self, numel: int, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        """A 1-D tensor of `numel` zeros of which only elements [start, end) are pinned (the whole pages
        around them; the rest is pageable host memory): only those bytes are charged. The pages lock as
        they fault in. PinnedMemoryBudgetError if they would exceed the cap; `free` gives them back."""
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        size = _itemsize(dtype)
        lo, hi = _page_range((start * size, end * size), numel * size)
        pinned = (start, end)
        return self._charged(hi - lo, lambda: pinned_tensor(numel, dtype, populate="none", pinned=pinned))

    def _charged(self, nbytes: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`make()`'s tensor, with `nbytes` charged to the pool until `free`."""
        with self._lock:
            # Charge before allocating so concurrent callers can never overshoot the cap together.
            if self._in_use + nbytes > self._cap:
                raise PinnedMemoryBudgetError(nbytes, self._in_use, self._cap)
            self._in_use += nbytes
            self._peak = max(self._peak, self._in_use)
        try:
            t = make()
        except BaseException:
            with self._lock:
                self._in_use -= nbytes
            raise
        with self._lock:
            self._live[t.data_ptr()] = nbytes
        return t

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` of host memory held elsewhere (pageable partitions placed against this budget)
        as in use; PinnedMemoryBudgetError if that would exceed the cap. `uncharge` gives them back."""
        with self._lock:
            if self._in_use + nbytes > self._cap:
                raise PinnedMemoryBudgetError(nbytes, self._in_use, self._cap)
            self._in_use += nbytes
            self._peak = max(self._peak, self._in_use)

    def uncharge(self, nbytes: int) -> None:
        """Give back bytes counted by `charge`."""
        with self._lock:
            self._in_use -= min(int(nbytes), self._in_use)

    def free(self, t: torch.Tensor) -> None:
        """Return `t`'s bytes to the budget. `t` must be a tensor this pool allocated (not a view of one)."""
        with self._lock:
            nbytes = self._live.pop(t.data_ptr(), None)
            if nbytes is None:
                raise ValueError(
                    f"tensor at {t.data_ptr():#x} ({t.numel()} x {t.dtype}) was not allocated by this "
                    "PinnedPool, or was already freed"
                )
            self._in_use -= nbytes

    def __repr__(self) -> str:
        return (
            f"PinnedPool(cap_bytes={self._cap}, bytes_in_use={self.bytes_in_use}, "
            f"peak_bytes={self.peak_bytes})"
        )
