"""Exported weights (`save_16bit_model`, `zero-to-fp32`): each file written whole or not at all.

A file is written into a fresh temporary beside it - a random name created with `O_EXCL | O_NOFOLLOW`
relative to the target directory's descriptor (or, for writers that take a path, a file in a fresh 0700
directory held open), so a file or symlink another user planted there is never written through - then
fsynced and renamed over the target, and the directory fsynced. Every output gets
the mode any new file of the user gets: 0666 less the umask (0644 with the usual umask 022), owned by the
user writing it.
"""

from __future__ import annotations

import os
import secrets
import stat
from typing import IO, Any, Callable

import torch

__all__ = ["output_mode", "save_atomic", "write_atomic", "write_atomic_path"]


def output_mode() -> int:
    """0666 less the process's umask (read from /proc, so no other thread sees the umask change)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _create_temp(dir_fd: int, base: str) -> tuple[str, int]:
    for _ in range(100):
        name = f".{base}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
            )
        except FileExistsError:
            continue
        return name, fd
    raise FileExistsError(f"no free temporary name for {base}")  # pragma: no cover - 100 collisions


def write_atomic(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """`write(f)` writes, through binary file object `f`, the file that becomes `path` (its directory is
    created if needed): into a fresh temporary beside it, fsynced, renamed over `path` (module docstring)."""
    directory, base = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tmp, fd = _create_temp(dir_fd, base)
        try:
            with os.fdopen(fd, "w+b") as f:
                write(f)
                f.flush()
                os.fchmod(f.fileno(), output_mode())
                os.fsync(f.fileno())
            os.replace(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_atomic(obj: Any, path: str) -> None:
    """torch.save `obj` as `path` atomically (`write_atomic`)."""
    write_atomic(path, lambda f: torch.save(obj, f))


def write_atomic_path(path: str, write: Callable[[str], None]) -> None:
    """As `write_atomic`, for writers that take only a path (safetensors' save_file): `write(p)` writes `p`
    inside a fresh private (0700) directory beside `path`, held open; the file is then opened relative to
    that directory's descriptor (a regular file, no symlink followed), fsynced and renamed over `path`."""
    directory, base = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for _ in range(100):
            private = f".{base}.{secrets.token_hex(6)}.tmp.d"
            try:
                os.mkdir(private, 0o700, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue
        priv_fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            write(os.path.join(directory, private, base))
            fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=priv_fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{path}: the writer did not leave a regular file")
                os.fchmod(fd, output_mode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(base, base, src_dir_fd=priv_fd, dst_dir_fd=dir_fd)
        finally:
            for name in os.listdir(priv_fd):  # what a failed writer left
                try:
                    os.unlink(name, dir_fd=priv_fd)
                except OSError:
                    pass
            os.close(priv_fd)
            try:
                os.rmdir(private, dir_fd=dir_fd)
            except OSError:
                pass
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
