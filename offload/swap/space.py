"""SwapSpace: a private directory of preallocated swap files under the configured `nvme_path`.

The directory is created 0700 and every file 0600, because optimizer state is the model itself. Files are
preallocated (posix_fallocate) at creation, so running out of disk shows up when the engine is built rather
than halfway through a step, and region offsets are aligned for O_DIRECT. Everything is removed on
`close()`, when the object is collected, or at normal interpreter exit (weakref.finalize registers itself
with atexit).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List

__all__ = ["SwapFile", "SwapSpace", "SwapSpaceError", "align_up"]

DEFAULT_ALIGNMENT = 4096


class SwapSpaceError(OSError):
    """The swap directory or one of its files could not be created; carries errno and the path."""


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class SwapFile:
    path: str
    nbytes: int


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def check_nvme_path(nvme_path: str) -> str:
    """Absolute `nvme_path` if it is an existing, writable directory; SwapSpaceError naming it otherwise."""
    if not nvme_path:
        raise SwapSpaceError(
            errno.EINVAL, "offload nvme_path is empty: set zero_optimization.offload_*.nvme_path"
        )
    path = os.path.abspath(os.path.expanduser(nvme_path))
    if not os.path.exists(path):
        raise SwapSpaceError(errno.ENOENT, "offload nvme_path does not exist", path)
    if not os.path.isdir(path):
        raise SwapSpaceError(errno.ENOTDIR, "offload nvme_path is not a directory", path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise SwapSpaceError(errno.EACCES, "offload nvme_path is not writable by this user", path)
    return path


class SwapSpace:
    """Owns `<nvme_path>/zero-offload-XXXX/` and the files in it."""

    def __init__(
        self, nvme_path: str, alignment: int = DEFAULT_ALIGNMENT, prefix: str = "zero-offload-"
    ) -> None:
        root = check_nvme_path(nvme_path)
        try:
            self.dir = tempfile.mkdtemp(prefix=prefix, dir=root)  # mkdtemp creates the directory 0700
        except OSError as e:
            raise SwapSpaceError(
                e.errno, f"cannot create the swap directory under nvme_path: {e.strerror}", root
            ) from e
        os.chmod(self.dir, 0o700)
        self.alignment = max(DEFAULT_ALIGNMENT, int(alignment))
        self._files: Dict[str, SwapFile] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_tree, self.dir)

    @property
    def bytes_allocated(self) -> int:
        with self._lock:
            return sum(f.nbytes for f in self._files.values())

    @property
    def files(self) -> List[SwapFile]:
        with self._lock:
            return list(self._files.values())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def create(self, name: str, nbytes: int) -> SwapFile:
        """A new 0600 file of `nbytes` (rounded up to the alignment), fully allocated on disk."""
        if self.closed:
            raise SwapSpaceError(errno.EBADF, "swap space is closed", self.dir)
        if os.sep in name or name in ("", ".", ".."):
            raise ValueError(f"swap file name must be a plain file name, got {name!r}")
        nbytes = align_up(max(int(nbytes), 1), self.alignment)
        path = os.path.join(self.dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise SwapSpaceError(e.errno, f"cannot create swap file: {e.strerror}", path) from e
        try:
            os.fchmod(fd, 0o600)  # a restrictive umask could only narrow it; make it exact
            _preallocate(fd, nbytes, path)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        f = SwapFile(path, nbytes)
        with self._lock:
            self._files[name] = f
        return f

    def close(self) -> None:
        """Remove every swap file and the directory. Safe to call more than once."""
        self._finalizer()
        with self._lock:
            self._files.clear()

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapSpace({self.dir!r}, files={len(self._files)}, bytes={self.bytes_allocated})"


def _preallocate(fd: int, nbytes: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise SwapSpaceError(
                e.errno, f"cannot allocate {nbytes} bytes for swap file: {e.strerror}", path
            ) from e
    # Filesystems without fallocate: extend by writing the last byte, so the size is at least right.
    try:
        os.pwrite(fd, b"\0", nbytes - 1)
    except OSError as e:
        raise SwapSpaceError(e.errno, f"cannot extend swap file to {nbytes} bytes: {e.strerror}", path) from e
