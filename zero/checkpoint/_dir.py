"""A checkpoint's directory, held open: its files are opened relative to that descriptor, never by a path.

Only regular files directly inside are opened: a symlink (to `/dev/zero`, to a file elsewhere) is refused
by `O_NOFOLLOW`, a FIFO or device by `fstat` - opened with `O_NONBLOCK`, so a FIFO without a writer cannot
block the open - and small files are read only up to a bound, so a huge `latest` costs nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Dict, Optional

from zero.errors import CheckpointIntegrityError

__all__ = ["OpenDir"]

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class OpenDir:
    """Directory `path` (relative to `parent`'s descriptor, not following a symlink, when given), open for
    the life of this object; `open(name)` opens a regular file in it. A context manager; `close()` closes
    the directory and every file still held (`hold`)."""

    def __init__(self, path: str, parent: Optional[OpenDir] = None) -> None:
        self.path = path if parent is None else os.path.join(parent.path, path)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if parent is not None else 0)
        try:
            self.fd = os.open(path, flags, dir_fd=parent.fd if parent is not None else None)
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                raise CheckpointIntegrityError(
                    f"{self.path}: not a directory (or a symlink): refused"
                ) from None
            raise
        self._held: Dict[str, int] = {}

    def name(self, name: str) -> str:
        """`name`'s path, for messages."""
        return os.path.join(self.path, name)

    def kind(self, name: str) -> Optional[str]:
        """'file', 'dir', another kind's word, or None when `name` does not exist (symlinks not followed)."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISREG(st.st_mode):
            return "file"
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        return "symlink" if stat.S_ISLNK(st.st_mode) else "other"

    def open(self, name: str) -> int:
        """A read-only descriptor of regular file `name` in this directory (the caller closes it).
        FileNotFoundError if missing; CheckpointIntegrityError for a symlink, FIFO, device or directory."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointIntegrityError(f"{self.name(name)}: a symbolic link: refused") from None
            if e.errno in (errno.ENXIO, errno.EISDIR):
                raise CheckpointIntegrityError(f"{self.name(name)}: not a regular file: refused") from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                what = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
                raise CheckpointIntegrityError(f"{self.name(name)}: {what}, not a regular file: refused")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_small(self, name: str, limit: int) -> Optional[bytes]:
        """The bytes of regular file `name`, None if it does not exist; CheckpointIntegrityError (content
        never quoted) if it holds more than `limit` bytes. Reads at most `limit + 1` bytes."""
        try:
            fd = self.open(name)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, limit + 1, 0) if size <= limit else b""
        finally:
            os.close(fd)
        if size > limit or len(data) > limit:
            raise CheckpointIntegrityError(
                f"{self.name(name)}: {max(size, len(data))} bytes, more than the {limit} such a file holds: "
                "refused"
            )
        return data

    def hold(self, name: str, fd: int) -> int:
        """Keep `fd` (file `name`) open until close(); returns it."""
        old = self._held.pop(name, None)
        if old is not None:
            os.close(old)
        self._held[name] = fd
        return fd

    def held(self, name: str) -> int:
        """The descriptor kept for `name` (KeyError if none)."""
        return self._held[name]

    def holds(self, name: str) -> bool:
        return name in self._held

    def fd_path(self, name: str) -> str:
        """A path that opens the very file held as `name` (Linux: its /proc/self/fd link), for readers that
        take only a path (torch.load(mmap=True))."""
        return f"/proc/self/fd/{self._held[name]}"

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held = {}
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
