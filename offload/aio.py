"""Async file I/O for tensors, arrays and buffers: the Python face of `offload._aio`.

`AioHandle` keeps DeepSpeed's `aio_handle` method names and return values, so code written for
`AsyncIOBuilder().load().aio_handle(...)` runs unchanged, and adds what DeepSpeed lacks: numpy arrays and any
buffer-protocol object, an open fd instead of a path, a file of a held directory (`FileAt`: a directory fd
and a plain name, opened with openat), exceptions carrying errno/file/offset instead of -1, and a choice of
backend (io_uring, Linux AIO, pread/pwrite threads). No file is ever opened through a symlink in its last
component (O_NOFOLLOW: AioError ELOOP), and a name with a NUL byte is a ValueError.

Buffers and their lifetimes: the C++ core takes raw (pointer, length) pairs. This module resolves each buffer
to one contiguous host region, refuses what would need a hidden copy (non-contiguous tensors, read-only
buffers for reads), and holds a reference to every buffer until `wait()` has seen its request finish.
Device memory (CUDA tensors, CuPy arrays) is staged through a pinned host buffer: a read lands there and is
copied to the device when the request completes; a write copies device -> pinned before it is queued.

The module is long because it is the whole Python face of the I/O core: DeepSpeed's aio_handle API for
tensors, numpy arrays and raw buffers, with the buffer-lifetime rules above in one place.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Tuple, Union, runtime_checkable

from offload import _aio
from offload.pinned import HostBuffer, alloc_host_buffer, pinned_tensor

if TYPE_CHECKING:
    import torch

AioError = _aio.AioError
BackendUnavailableError = _aio.BackendUnavailableError
DirectIOFallbackWarning = _aio.DirectIOFallbackWarning
available_backends = _aio.available_backends

__all__ = [
    "AioError",
    "AioHandle",
    "BackendUnavailableError",
    "DeviceBuffer",
    "DirectIOFallbackWarning",
    "FileAt",
    "FileInDir",
    "TorchDeviceBuffer",
    "available_backends",
]


@runtime_checkable
class FileAt(Protocol):
    """A file named relative to a directory the caller holds open: `name` (a plain file name) in the
    directory open as `dir_fd`; `path` names it in errors. The core opens it with openat(O_NOFOLLOW), so
    neither a directory renamed or replaced on the way to it nor a symlink put in its place is ever followed.
    `offload.swap.SwapFile` is one."""

    @property
    def dir_fd(self) -> int:
        """The open directory's file descriptor (the caller keeps it open)."""

    @property
    def name(self) -> str:
        """The file's plain name in that directory."""

    @property
    def path(self) -> str:
        """The file's path, for error messages."""


class FileInDir:
    """A plain FileAt: file `name` of the directory open as `dir_fd` (which the caller keeps open)."""

    __slots__ = ("dir_fd", "name", "path")

    def __init__(self, dir_fd: int, name: str, path: Optional[str] = None) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.path = path if path is not None else name

    def __repr__(self) -> str:
        return f"FileInDir(dir_fd={self.dir_fd}, name={self.name!r}, path={self.path!r})"


PathOrFd = Union[str, bytes, "os.PathLike[str]", int, FileAt]
PathName = Union[str, bytes, "os.PathLike[str]", FileAt]
_Target = Union[str, int, Tuple[int, str, str]]  # a path, an fd, or (dir_fd, name, path)

_BACKENDS = ("auto", "io_uring", "aio", "psync")
_DIRECT_MODES = ("auto", "on", "off")


class DeviceBuffer:
    """Memory the kernel cannot read or write directly; AioHandle stages it through pinned host memory.

    Subclass it to plug in another accelerator. `TorchDeviceBuffer` covers torch device tensors and objects
    with `__cuda_array_interface__` (CuPy). `host` below is a 1-D uint8 CPU tensor of exactly `nbytes`.
    """

    nbytes: int

    def copy_to_host(self, host: torch.Tensor) -> None:
        """Copy the device bytes into `host`; must be complete when it returns."""
        raise NotImplementedError

    def copy_from_host(self, host: torch.Tensor) -> None:
        """Copy `host` into the device bytes; must be complete (or ordered before any later use) on return."""
        raise NotImplementedError


class TorchDeviceBuffer(DeviceBuffer):
    """A contiguous torch tensor on a non-CPU device, seen as bytes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        import torch

        if not tensor.is_contiguous():
            raise ValueError(
                f"{tensor.device} tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} "
                "is not contiguous; call .contiguous() first (a hidden copy would not see data read into it)"
            )
        self.tensor = tensor
        self._bytes = tensor.reshape(-1).view(torch.uint8)
        self.nbytes = self._bytes.numel()

    def copy_to_host(self, host: torch.Tensor) -> None:
        """Copy the device bytes into the pinned `host` buffer (blocking)."""
        host.copy_(self._bytes)  # blocking device -> host copy

    def copy_from_host(self, host: torch.Tensor) -> None:
        # Blocking: the pinned staging buffer is released right after this returns.
        """Copy the pinned `host` buffer into the device bytes, blocking until done."""
        self._bytes.copy_(host)
        if self._bytes.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self._bytes.device).synchronize()


class _Region:
    """One request's host memory: (ptr, nbytes) plus whatever must stay alive until it completes."""

    __slots__ = ("ptr", "nbytes", "keepalive", "device", "staging", "unhold")

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        keepalive: Any,
        device: Optional[DeviceBuffer] = None,
        staging: Optional[Tuple[HostBuffer, torch.Tensor]] = None,
    ) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.keepalive = keepalive
        self.device = device
        self.staging = staging
        # Ends the hold on memory that can be freed explicitly (PinnedBuffer.release()): it stays mapped
        # until the request is done, so a release() meanwhile cannot pull it from under the kernel.
        self.unhold: Optional[Callable[[], None]] = _hold_io(keepalive)

    def finish_read(self) -> None:
        """After the kernel filled the host memory: move staged bytes on to the device."""
        if self.device is not None and self.staging is not None:
            self.device.copy_from_host(self.staging[1])

    def release(self) -> None:
        # Dropping the references frees a staging buffer at once (refcounting) unless a DeviceBuffer kept
        # the host tensor; freeing it explicitly could pull memory from under such a reference.
        self.staging = None
        self.keepalive = None
        self.device = None
        unhold, self.unhold = self.unhold, None
        if unhold is not None:
            unhold()


def _hold_io(keepalive: Any) -> Optional[Callable[[], None]]:
    """Hold the memory behind a buffer that can be unmapped explicitly (an object with `hold_io`: a
    PinnedBuffer, or the HostBuffer behind an `as_ctypes()` array) until the returned callable runs."""
    if not isinstance(keepalive, tuple) or len(keepalive) != 3:
        return None
    _, view, obj = keepalive
    exporters = (getattr(view, "obj", None), obj, getattr(obj, "obj", None))
    for owner in [o for e in exporters for o in (e, getattr(e, "_zo_owner", None))]:
        hold = getattr(owner, "hold_io", None)
        if hold is not None:
            hold()
            return owner.unhold_io
    return None


def _describe(obj: Any) -> str:
    return type(obj).__module__ + "." + type(obj).__qualname__


def _torch_region(
    torch: Any, t: torch.Tensor, for_read: bool
) -> Tuple[int, int, Any, Optional[DeviceBuffer]]:
    if t.layout != torch.strided:
        raise TypeError(
            f"tensor with layout {t.layout} cannot be used for file I/O; only strided tensors can"
        )
    if t.device.type == "meta":
        raise ValueError(
            f"meta tensor of shape {tuple(t.shape)} has no memory to read into or write from; materialize "
            "it first (to_empty(device=...))"
        )
    if t.device.type != "cpu":
        return 0, 0, t, TorchDeviceBuffer(t)
    if not t.is_contiguous():
        raise ValueError(
            f"CPU tensor of shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; call "
            ".contiguous() first (a hidden copy would not see the data read into it)"
        )
    if t.is_conj() or t.is_neg():
        raise ValueError(
            "tensor has a lazy conjugate/negative bit set; call .resolve_conj()/.resolve_neg() first"
        )
    return t.data_ptr(), t.numel() * t.element_size(), t, None


def _buffer_region(obj: Any, for_read: bool) -> Tuple[int, int, Any]:
    import numpy as np

    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{_describe(obj)} is not a usable I/O buffer: pass a contiguous CPU torch.Tensor, a numpy "
            "array, a writable buffer-protocol object (bytearray, memoryview, mmap, PinnedBuffer), a CUDA "
            "tensor, a CuPy array or an offload.aio.DeviceBuffer"
        ) from None
    if not view.c_contiguous:
        shape, strides = view.shape, view.strides
        view.release()
        raise ValueError(
            f"{_describe(obj)} buffer of shape {shape} with strides {strides} is not C-contiguous; "
            "make a contiguous copy first (a hidden copy would not see the data read into it)"
        )
    if for_read and view.readonly:
        view.release()
        raise ValueError(f"{_describe(obj)} buffer is read-only and cannot be read into")
    # numpy gives the address of any contiguous buffer, read-only ones included, without copying; the array
    # holds the memoryview, which holds the export (so e.g. a bytearray cannot be resized while in flight).
    arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    return arr.__array_interface__["data"][0], view.nbytes, (arr, view, obj)


def _resolve(buffer: Any, for_read: bool) -> Tuple[int, int, Any, Optional[DeviceBuffer]]:
    """(ptr, nbytes, keepalive, device) for any supported buffer; device set means staging is needed."""
    if isinstance(buffer, DeviceBuffer):
        return 0, 0, buffer, buffer
    torch = sys.modules.get("torch")  # a tensor can only exist if torch was imported; never import it here
    if torch is not None and isinstance(buffer, torch.Tensor):
        return _torch_region(torch, buffer, for_read)
    if hasattr(buffer, "__cuda_array_interface__"):
        if torch is None or not torch.cuda.is_available():
            raise TypeError(
                f"{_describe(buffer)} lives in CUDA memory, but torch with CUDA is needed to stage it; "
                "pass a host buffer instead"
            )
        t = torch.as_tensor(buffer, device="cuda")
        return 0, 0, (buffer, t), TorchDeviceBuffer(t)
    ptr, nbytes, keep = _buffer_region(buffer, for_read)
    return ptr, nbytes, keep, None


def _check_target(path_or_fd: PathOrFd) -> _Target:
    if isinstance(path_or_fd, bool):
        raise TypeError("file must be a path or an open file descriptor, not a bool")
    if isinstance(path_or_fd, int):
        if path_or_fd < 0:
            raise ValueError(f"file descriptor must be >= 0, got {path_or_fd}")
        return path_or_fd
    if isinstance(path_or_fd, FileAt):
        dir_fd, name, shown = path_or_fd.dir_fd, path_or_fd.name, os.fsdecode(path_or_fd.path)
        if isinstance(dir_fd, bool) or not isinstance(dir_fd, int) or dir_fd < 0:
            raise ValueError(f"dir_fd must be an open directory descriptor (an int >= 0), got {dir_fd!r}")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"a file of an open directory needs a plain file name, got {name!r}")
        return dir_fd, name, shown
    try:
        path = os.fsdecode(os.fspath(path_or_fd))
    except TypeError:
        raise TypeError(
            f"file must be a path or an open file descriptor (or a FileAt), got {_describe(path_or_fd)}"
        ) from None
    if "\0" in path:
        raise ValueError(f"path {path!r} contains a NUL byte: no file can have that name")
    if not path:
        raise ValueError("path is empty")
    return path


def _pick_target(path_or_fd: Optional[PathOrFd], filename: Optional[PathName], fd: Optional[int]) -> PathOrFd:
    """The one file of a call: positional, DeepSpeed's `filename=`, or an open descriptor `fd=`."""
    given = [
        name
        for name, value in (("path_or_fd", path_or_fd), ("filename", filename), ("fd", fd))
        if value is not None
    ]
    if not given:
        raise TypeError("no file given: pass a path (filename=) or an open file descriptor (fd=)")
    if len(given) > 1:
        raise TypeError(f"give one file, got {' and '.join(given)}")
    if fd is not None:
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"fd must be an open file descriptor (an int), got {_describe(fd)}")
        return fd
    if filename is not None:
        if isinstance(filename, int):
            raise TypeError(f"filename must be a path, got the int {filename}; pass a descriptor as fd=")
        return filename
    assert path_or_fd is not None
    return path_or_fd


def _check_offset(file_offset: int) -> int:
    if isinstance(file_offset, bool) or not isinstance(file_offset, int):
        raise TypeError(f"file_offset must be an int, got {_describe(file_offset)}")
    if file_offset < 0:
        raise ValueError(f"file_offset must be >= 0, got {file_offset}")
    return file_offset


class AioHandle:
    """An async I/O queue over one backend; DeepSpeed `aio_handle` compatible.

    Parameters mirror DeepSpeed: `block_size` (bytes per kernel request), `queue_depth` (requests in flight
    per thread), `single_submit` (submit one request per syscall), `overlap_events` (submit while reaping),
    `intra_op_parallelism` (threads splitting each request). Ours: `backend` ("auto", "io_uring", "aio",
    "psync"; naming an unavailable one raises BackendUnavailableError) and `direct` ("auto": O_DIRECT with a
    buffered fallback and one DirectIOFallbackWarning per filesystem, "on": refusal raises, "off": buffered).

    Threads may share a handle (every call is safe, close() included), but wait() then completes and counts
    the requests of all of them; give each thread its own handle for independent progress. A call made once
    close() has begun raises ValueError("the aio Handle is closed"); calls already under way finish first.

    `register_file(path)` opens a file once for the handle's lifetime: requests naming that path then use
    the descriptor opened at registration, whatever the path names later (a file renamed over it, a
    symlink put in its place).
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
        backend: str = "auto",
        direct: str = "auto",
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if direct not in _DIRECT_MODES:
            raise ValueError(f"direct must be one of {_DIRECT_MODES}, got {direct!r}")
        for name, value in (
            ("block_size", block_size),
            ("queue_depth", queue_depth),
            ("intra_op_parallelism", intra_op_parallelism),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self._h = _aio.Handle(
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=bool(single_submit),
            overlap_events=bool(overlap_events),
            intra_op_parallelism=intra_op_parallelism,
            backend=backend,
            direct=direct,
        )
        self._lock = threading.Lock()  # guards the lists below
        self._wait_lock = threading.Lock()
        self._inflight: List[_Region] = []  # queued requests' buffers, kept alive until wait()
        self._reads_to_finish: List[_Region] = []
        self._locked_tensors: dict = {}  # data_ptr -> tensor handed out by new_cpu_locked_tensor

    # -- configuration (DeepSpeed getters) ------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The I/O backend the handle uses."""
        return self._h.backend

    def get_block_size(self) -> int:
        """Bytes per I/O request (DeepSpeed's accessor)."""
        return self._h.block_size

    def get_queue_depth(self) -> int:
        """Requests in flight per thread (DeepSpeed's accessor)."""
        return self._h.queue_depth

    def get_single_submit(self) -> bool:
        """Whether requests are submitted one at a time (DeepSpeed's accessor)."""
        return self._h.single_submit

    def get_overlap_events(self) -> bool:
        """Whether submitting overlaps reaping completions (DeepSpeed's accessor)."""
        return self._h.overlap_events

    def get_intra_op_parallelism(self) -> int:
        """I/O threads per operation (DeepSpeed's accessor)."""
        return self._h.intra_op_parallelism

    get_thread_count = get_intra_op_parallelism  # DeepSpeed < 0.15 name

    def get_alignment(self) -> int:
        """Address/size/offset alignment at which requests go straight to the device without bouncing."""
        return self._h.alignment

    def pending(self) -> int:
        """Requests submitted and not yet waited for."""
        return self._h.pending()

    # -- registered files -----------------------------------------------------------------------------------

    def register_file(self, path: PathName, writable: bool = True) -> None:
        """Open `path` once: until `unregister_file(path)` or `close()`, requests by that path use it.

        The file is opened here (read-write, created with mode 0600 and never truncated, when `writable`;
        read-only otherwise; never through a symlink in its last component) and errors raise here
        (`AioError`). Later requests by this path (spelled any way that names the same absolute path
        without `..`: "d//./f" matches "d/f") are not opened again, so a file renamed over the path or a
        symlink put in its place is never read or written instead. A `FileAt` is opened relative to its
        directory fd and matched by that directory and name. A write to a file registered read-only raises
        `AioError(EBADF)`. Registering a file twice is a ValueError.
        """
        target = _check_target(path)
        if isinstance(target, int):
            raise TypeError("register_file takes a path; a descriptor is already open (pass it to the calls)")
        if isinstance(target, tuple):
            self._h.register_at(target[0], target[1], target[2], bool(writable))
        else:
            self._h.register_file(target, bool(writable))

    def unregister_file(self, path: PathName) -> None:
        """Forget a registration: later requests open the path again. The descriptor is closed now, or once
        the last request queued on it completes. ValueError if the path is not registered."""
        target = _check_target(path)
        if isinstance(target, int):
            raise TypeError("unregister_file takes the path given to register_file")
        if isinstance(target, tuple):
            self._h.unregister_at(*target)
        else:
            self._h.unregister_file(target)

    # -- I/O ------------------------------------------------------------------------------------------------

    def sync_pread(
        self,
        buffer: Any,
        path_or_fd: Optional[PathOrFd] = None,
        file_offset: int = 0,
        *,
        filename: Optional[PathName] = None,
        fd: Optional[int] = None,
    ) -> int:
        """Read len(buffer) bytes at `file_offset` into `buffer`; returns requests completed (DeepSpeed: 1).

        As in DeepSpeed, where a synchronous request queues behind earlier asynchronous ones, requests still
        pending on this handle are completed first and counted in the return value.
        """
        return self._sync(True, buffer, _pick_target(path_or_fd, filename, fd), file_offset)

    def sync_pwrite(
        self,
        buffer: Any,
        path_or_fd: Optional[PathOrFd] = None,
        file_offset: int = 0,
        *,
        filename: Optional[PathName] = None,
        fd: Optional[int] = None,
    ) -> int:
        """Write `buffer` at `file_offset` (creating the file 0600, never truncating); see sync_pread."""
        return self._sync(False, buffer, _pick_target(path_or_fd, filename, fd), file_offset)

    def async_pread(
        self,
        buffer: Any,
        path_or_fd: Optional[PathOrFd] = None,
        file_offset: int = 0,
        *,
        filename: Optional[PathName] = None,
        fd: Optional[int] = None,
    ) -> int:
        """Queue a read into `buffer`; returns 0. The data is there (also on a device) after wait().

        The file is given positionally or as DeepSpeed's `filename=` (a path or a `FileAt`), or as `fd=`, a
        descriptor open for reading that stays open until wait(); exactly one of them.
        """
        self._submit(True, buffer, _pick_target(path_or_fd, filename, fd), file_offset)
        return 0

    def async_pwrite(
        self,
        buffer: Any,
        path_or_fd: Optional[PathOrFd] = None,
        file_offset: int = 0,
        *,
        filename: Optional[PathName] = None,
        fd: Optional[int] = None,
    ) -> int:
        """Queue a write of `buffer`; returns 0. Do not modify `buffer` before wait().

        The file is given as in async_pread: positionally, `filename=`, or `fd=` (open for writing).
        """
        self._submit(False, buffer, _pick_target(path_or_fd, filename, fd), file_offset)
        return 0

    def pread(
        self,
        buffer: Any,
        path_or_fd: Optional[PathOrFd] = None,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        *,
        filename: Optional[PathName] = None,
        fd: Optional[int] = None,
    ) -> int:
        """DeepSpeed's general form; `validate` is not supported (compare the data yourself)."""
        if validate:
            raise ValueError("validate=True is not supported; compare the buffer against the file yourself")
        if async_op:
            return self.async_pread(buffer, _pick_target(path_or_fd, filename, fd), file_offset)
        return self.sync_pread(buffer, _pick_target(path_or_fd, filename, fd), file_offset)

    def pwrite(
        self,
        buffer: Any,
        path_or_fd: Optional[PathOrFd] = None,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        *,
        filename: Optional[PathName] = None,
        fd: Optional[int] = None,
    ) -> int:
        """DeepSpeed's general form; `validate` is not supported."""
        if validate:
            raise ValueError("validate=True is not supported; compare the buffer against the file yourself")
        if async_op:
            return self.async_pwrite(buffer, _pick_target(path_or_fd, filename, fd), file_offset)
        return self.sync_pwrite(buffer, _pick_target(path_or_fd, filename, fd), file_offset)

    def wait(self) -> int:
        """Block until every queued request finished; returns how many completed (0 if none were queued).

        If any request failed, raises AioError for the first failure after all have finished. Staged device
        reads are then not copied to their devices (which of them succeeded is unknown).
        """
        # One wait at a time: a thread whose request another thread's wait() took must not return before
        # that wait has also copied the staged data on to the device.
        with self._wait_lock:
            # Take the requests before waiting: those are surely finished when the core's wait returns. One
            # that another thread queues meanwhile may still be running and stays for the next wait().
            with self._lock:
                regions, self._inflight = self._inflight, []
                to_finish, self._reads_to_finish = self._reads_to_finish, []
            try:
                completed = self._h.wait()
                for region in to_finish:
                    region.finish_read()
            finally:
                for region in regions:
                    region.release()
            return completed + sum(1 for region in regions if region.nbytes == 0)

    def _has_unreaped(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def _drop_inflight(self) -> None:
        with self._lock:
            regions, self._inflight = self._inflight, []
            self._reads_to_finish = []
        for region in regions:
            region.release()

    def _region(self, for_read: bool, buffer: Any) -> _Region:
        ptr, nbytes, keep, device = _resolve(buffer, for_read)
        if device is None:
            return _Region(ptr, nbytes, keep)
        if device.nbytes == 0:
            return _Region(0, 0, keep, device)
        host = alloc_host_buffer(device.nbytes)
        staging = _pinned_view(host)
        region = _Region(host.ptr, device.nbytes, keep, device, (host, staging))
        if not for_read:
            try:
                device.copy_to_host(staging)
            except BaseException:
                region.release()
                raise
        return region

    def _call(self, for_read: bool, region: _Region, target: _Target, offset: int, asynchronous: bool) -> int:
        h = self._h
        if isinstance(target, int):
            fn = h.pread_fd if for_read else h.pwrite_fd
            return fn(region.ptr, region.nbytes, target, offset, asynchronous)
        if isinstance(target, tuple):
            fn = h.pread_at if for_read else h.pwrite_at
            return fn(region.ptr, region.nbytes, *target, offset, asynchronous)
        fn = h.pread if for_read else h.pwrite
        return fn(region.ptr, region.nbytes, target, offset, asynchronous)

    def _sync(self, for_read: bool, buffer: Any, path_or_fd: PathOrFd, file_offset: int) -> int:
        target = _check_target(path_or_fd)
        offset = _check_offset(file_offset)
        region = self._region(for_read, buffer)
        try:
            # _inflight, not pending(): requests that already finished still count until wait() reaps them.
            earlier = self.wait() if self._has_unreaped() else 0
            self._call(for_read, region, target, offset, False)
            if for_read:
                region.finish_read()
        finally:
            region.release()
        return earlier + 1

    def _submit(self, for_read: bool, buffer: Any, path_or_fd: PathOrFd, file_offset: int) -> None:
        target = _check_target(path_or_fd)
        offset = _check_offset(file_offset)
        region = self._region(for_read, buffer)
        try:
            # An empty request only has its checks (open, end of file) to do: run them now, and count the
            # request in the next wait() ourselves, as DeepSpeed would count it.
            self._call(for_read, region, target, offset, region.nbytes > 0)
        except BaseException:
            region.release()  # nothing was queued (open/EOF checks raise before queuing)
            raise
        # Registered only once the core counts the request: a wait() in another thread that takes the lists
        # then also waits for this request. Registered earlier, that wait could return before the request
        # was even queued and free its buffer under it. The other order is safe: a wait() that reaps the
        # request before it is registered leaves the region here, and the next wait() finishes it.
        with self._lock:
            self._inflight.append(region)
            if for_read and region.device is not None:
                self._reads_to_finish.append(region)

    # -- pinned tensors (DeepSpeed names) -------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A pinned 1-D CPU tensor of `num_elem` elements with `example_tensor`'s dtype."""
        t = pinned_tensor(num_elem, example_tensor.dtype)
        with self._lock:
            self._locked_tensors[t.data_ptr()] = t
        return t

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        """Drop the handle's reference; True if the tensor came from new_cpu_locked_tensor on this handle.

        The memory is returned to the system when the last reference to the tensor (and its views) is gone.
        """
        with self._lock:
            return self._locked_tensors.pop(locked_tensor.data_ptr(), None) is not None

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for queued requests (raising their first failure), then free threads, kernel contexts and
        registered files.

        Safe to call from any thread, also while others submit or wait: their calls already under way
        finish first, later ones raise ValueError. A failed request is raised by exactly one call: a
        `wait()` running at the same time, else this `close()`. Closing again returns once the handle is
        closed, raising nothing.
        """
        try:
            if self._has_unreaped():
                self.wait()
        finally:
            self._h.close()  # a second caller returns once the first has finished
            self._drop_inflight()
            with self._lock:
                self._locked_tensors.clear()

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # The kernel may still be writing into queued buffers: the C++ handle must finish (close waits)
        # before the references keeping those buffers alive are dropped.
        h = getattr(self, "_h", None)
        if h is not None:
            try:
                h.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return (
            f"AioHandle(backend={self.backend!r}, block_size={self.get_block_size()}, "
            f"queue_depth={self.get_queue_depth()}, intra_op_parallelism={self.get_intra_op_parallelism()}, "
            f"alignment={self.get_alignment()})"
        )


def _pinned_view(host: HostBuffer) -> torch.Tensor:
    """A 1-D uint8 tensor over a HostBuffer (keeps it alive)."""
    import torch

    return torch.frombuffer(host.as_ctypes(), dtype=torch.uint8)
