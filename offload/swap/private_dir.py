"""Directories the engine keeps its files in, opened once and used only through their descriptors.

Swap files hold the model itself, and a path can be turned against its user by anyone who may rename an entry
on the way to it: a directory of symlinks named like the swap files, put in place of the private directory
between two steps, would make the engine write weights into any file its user can write. So:

* a root (`nvme_path`) is accepted only if no other user can rename entries in it: owned by this user or root,
  and not writable by others unless the sticky bit is set (a /tmp-style directory, where only an entry's
  owner may rename or remove it). `unsafe_reason` says what is wrong with one;
* the root is opened once (`open_root`) and every private directory is created (0700) or adopted relative to
  that descriptor, opened with O_NOFOLLOW and checked on its descriptor (`private_subdir`);
* files are opened relative to the held directory descriptor (`DirFd.fd`, openat with O_NOFOLLOW), never by
  a path again, so renaming or replacing anything on the way to them later changes nothing.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from typing import Callable, Optional

__all__ = ["DirFd", "open_root", "private_subdir", "unsafe_reason"]

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

ErrorFactory = Callable[[int, str, str], OSError]


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group_is_private(gid: int, euid: int) -> bool:
    """Whether only this user is in group `gid` (a user private group): its write bit lets no one else in."""
    try:
        members = set(grp.getgrgid(gid).gr_mem)
        others_primary = any(p.pw_gid == gid and p.pw_uid != euid for p in pwd.getpwall())
    except KeyError:
        return False
    return members <= {_user_name(euid)} and not others_primary


def unsafe_reason(st: os.stat_result, euid: Optional[int] = None) -> Optional[str]:
    """Why a directory with status `st` would let another user swap entries in it, or None if it would not.

    Refused: a directory owned by another user than this one or root (its owner can rename anything in it);
    one writable by every user, or by a group with other members, without the sticky bit."""
    euid = os.geteuid() if euid is None else euid
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (0, euid):
        return (
            f"is owned by {_user_name(st.st_uid)}, another user, who could replace the engine's files in it; "
            "use a directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX:
        return None  # only an entry's owner may rename or remove it
    if mode & stat.S_IWOTH:
        return (
            f"is writable by every user (mode {mode:04o}) without the sticky bit, so another user could "
            "replace the engine's files in it; use a directory of your own (or set the sticky bit: chmod +t)"
        )
    if mode & stat.S_IWGRP and not _group_is_private(st.st_gid, euid):
        return (
            f"is writable by group {st.st_gid} (mode {mode:04o}) without the sticky bit, so another member "
            "could replace the engine's files in it; use a directory of your own (or chmod g-w / chmod +t)"
        )
    return None


def open_root(path: str, error: ErrorFactory) -> int:
    """An O_DIRECTORY descriptor of `path` (symlinks on the way are followed once, here), after checking
    that descriptor with `unsafe_reason`; `error(errno, message, path)` builds what is raised."""
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    except OSError as e:
        raise error(e.errno or errno.EIO, f"cannot open the directory: {e.strerror}", path) from e
    try:
        reason = unsafe_reason(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if reason is not None:
        os.close(fd)
        raise error(errno.EPERM, f"refusing the directory: it {reason}", path)
    return fd


def private_subdir(parent_fd: int, name: str, path: str, error: ErrorFactory, create: bool = True) -> int:
    """An O_DIRECTORY descriptor of `name` in the directory open as `parent_fd`: created 0700 when `create`
    (FileExistsError if the name is taken), else adopted if it exists. Either way opened with O_NOFOLLOW and
    checked on its descriptor: a real directory of this user, made 0700 exactly. `path` names it in errors."""
    if create:
        os.mkdir(name, 0o700, dir_fd=parent_fd)  # FileExistsError: the caller decides
    try:
        fd = os.open(name, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=parent_fd)
    except OSError as e:
        what = "is a symlink or not a directory" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
        raise error(e.errno or errno.EIO, f"cannot open the private directory: {what}", path) from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise error(
                errno.EPERM,
                f"the private directory belongs to {_user_name(st.st_uid)}, not to this user: not used",
                path,
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # exact, whatever the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


class DirFd:
    """An open directory descriptor and the path it was opened at (for messages). `fd` raises once closed,
    so a file of a closed space is never opened relative to a descriptor number reused since."""

    def __init__(self, fd: int, path: str, error: ErrorFactory) -> None:
        self._fd: Optional[int] = fd
        self.path = path
        self._error = error

    @property
    def fd(self) -> int:
        """The open directory's descriptor; OSError EBADF once closed."""
        fd = self._fd
        if fd is None:
            raise self._error(errno.EBADF, "the directory was closed", self.path)
        return fd

    @property
    def closed(self) -> bool:
        """Whether the descriptor was closed."""
        return self._fd is None

    def close(self) -> None:
        """Close the descriptor; a second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def is_at(self, parent_fd: int, name: str) -> bool:
        """Whether `name` in `parent_fd` is still this directory (not renamed away or replaced)."""
        try:
            return os.path.samestat(os.fstat(self.fd), os.lstat(name, dir_fd=parent_fd))
        except OSError:
            return False
