"""A swap cache's directory on disk: its lock, its manifest and the checks on them (zero.stage3.swap_cache).

Every directory, lock and manifest is opened relative to a held descriptor with O_NOFOLLOW and checked on
the descriptor (owned by this user, 0700 / 0600); see zero.stage3.swap_cache for the layout and protocol.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
from typing import Any, Dict, Mapping, Optional, Tuple

from offload.swap.private_dir import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, private_subdir
from offload.swap.space import SwapSpaceError

__all__ = [
    "LAYOUT_VERSION",
    "LOCK_SUFFIX",
    "MANIFEST",
    "SwapCacheError",
    "SwapCacheMismatch",
    "cache_error",
    "check_manifest",
    "file_problem",
    "fsync_file",
    "has_manifest",
    "is_file_in",
    "open_dir",
    "open_lock",
    "private_dir",
    "read_manifest",
    "reclaim_unfinished",
    "remove_dir",
    "try_lock",
    "usable_cache",
]

logger = logging.getLogger("zero")

LAYOUT_VERSION = 1  # raised whenever the swap files' names or bytes change for the same inputs
MANIFEST = "manifest.json"
LOCK_SUFFIX = ".lock"


class SwapCacheError(SwapSpaceError):
    """A swap cache directory or file cannot be used: names the file, the sizes and the errno."""


class SwapCacheMismatch(SwapCacheError):
    """The model asks for a swap file the complete cache does not hold with that size (the fingerprint
    missed something that changes the layout): the loader rebuilds the cache."""


def cache_error(err: int, message: str, path: str) -> OSError:
    """A SwapCacheError (the error factory the private-directory helpers take)."""
    return SwapCacheError(err, message, path)


def private_dir(parent_fd: int, name: str, path: str) -> int:
    """A descriptor of `name` in `parent_fd`, created 0700 if missing; a file, a symlink or a directory of
    another user there is refused (SwapCacheError, EPERM)."""
    try:
        return private_subdir(parent_fd, name, path, cache_error)
    except FileExistsError:
        pass
    except OSError as e:
        if isinstance(e, SwapCacheError):
            raise
        raise SwapCacheError(e.errno, f"cannot create the swap cache directory: {e.strerror}", path) from e
    try:
        return private_subdir(parent_fd, name, path, cache_error, create=False)
    except SwapCacheError as e:
        raise SwapCacheError(errno.EPERM, "swap cache path is not a directory of this user", path) from e


def try_lock(fd: int, how: int) -> bool:
    """flock `fd` (`how`: LOCK_EX or LOCK_SH) without waiting; whether it was taken."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def open_lock(name: str, base_fd: int, path: str) -> int:
    """The lock file `name` of `base_fd`, created 0600, a regular file of this user (SwapCacheError else)."""
    flags = os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o600, dir_fd=base_fd)
    except OSError as e:
        raise SwapCacheError(e.errno, f"cannot open the swap cache lock: {e.strerror}", path) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise SwapCacheError(errno.EPERM, "swap cache lock is not a file of this user", path)
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_file_in(fd: int, dir_fd: int, name: str) -> bool:
    """Whether `fd` is the file `name` of `dir_fd` now (not replaced since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(name, dir_fd=dir_fd))
    except OSError:
        return False


def open_dir(base_fd: int, name: str) -> Optional[int]:
    """A descriptor of the existing directory `name` (O_NOFOLLOW), or None if there is none there."""
    try:
        return os.open(name, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=base_fd)
    except OSError:
        return None


def read_manifest(dir_fd: int, directory: str) -> Optional[Dict[str, Any]]:
    """The manifest, or None when there is none or it cannot be read (an unfinished or damaged cache)."""
    try:
        fd = os.open(MANIFEST, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("swap cache %s: unreadable %s (%s): rebuilding it", directory, MANIFEST, e)
        return None
    try:
        with open(fd, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("swap cache %s: unreadable %s (%s): rebuilding it", directory, MANIFEST, e)
        return None
    return m if isinstance(m, dict) else None


def file_problem(dir_fd: int, directory: str, manifest: Dict[str, Any]) -> Optional[str]:
    """None if every file the manifest lists exists with its listed size, else what is wrong with one."""
    for name, nbytes in manifest.get("files", {}).items():
        path = os.path.join(directory, name)
        if not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or os.sep in name:
            return f"{path}: not a plain file name"
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, e.errno)
            return f"{path}: expected {nbytes} bytes, cannot stat it ({code})"
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes or st.st_uid != os.geteuid():
            return f"{path}: expected {nbytes} bytes, found {st.st_size} bytes"
    return None


def remove_dir(base_fd: int, name: str, path: str) -> None:
    """Remove the directory `name` of `base_fd` and all in it (SwapCacheError ENOTEMPTY if it stays)."""
    shutil.rmtree(name, ignore_errors=True, dir_fd=base_fd)
    try:
        os.lstat(name, dir_fd=base_fd)
    except FileNotFoundError:
        return
    raise SwapCacheError(errno.ENOTEMPTY, "cannot remove the unfinished swap cache directory", path)


def has_manifest(base_fd: int, name: str) -> bool:
    """Whether the directory `name` of `base_fd` holds a manifest (a complete cache)."""
    try:
        os.lstat(os.path.join(name, MANIFEST), dir_fd=base_fd)
        return True
    except OSError:
        return False


def reclaim_unfinished(base_fd: int, base: str, keep: str) -> None:
    """Remove the directories under `base` that have no manifest and whose lock nobody holds (a build
    that died); `keep` (a fingerprint) is left to the caller."""
    try:
        names = os.listdir(base_fd)
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        if name == keep or name.endswith(LOCK_SUFFIX) or has_manifest(base_fd, name):
            continue
        try:
            st = os.lstat(name, dir_fd=base_fd)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = open_lock(name + LOCK_SUFFIX, base_fd, path + LOCK_SUFFIX)
        except (OSError, SwapCacheError):
            continue
        try:
            if try_lock(fd, fcntl.LOCK_EX) and is_file_in(fd, base_fd, name + LOCK_SUFFIX):
                if not has_manifest(base_fd, name):
                    shutil.rmtree(name, ignore_errors=True, dir_fd=base_fd)
                    logger.warning("removed unfinished swap cache %s (its builder is gone)", path)
        finally:
            os.close(fd)


def fsync_file(dir_fd: int, name: str, path: str, flags: int) -> None:
    """fsync the file `name` of `dir_fd` (SwapCacheError naming `path` and the errno)."""
    try:
        fd = os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise SwapCacheError(e.errno, f"cannot fsync the swap cache file: {e.strerror}", path) from e


def usable_cache(
    base_fd: int, name: str, directory: str, inputs: Mapping[str, Any]
) -> Optional[Tuple[Dict[str, Any], int]]:
    """The manifest and a descriptor of the directory if the cache is complete, for these inputs, with every
    file of its listed size, in a private directory of this user."""
    dir_fd = open_dir(base_fd, name)
    if dir_fd is None:
        return None
    manifest = None
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            logger.warning("swap cache %s is not a private directory of this user: rebuilding it", directory)
        else:
            manifest = check_manifest(dir_fd, directory, inputs)
    finally:
        if manifest is None:
            os.close(dir_fd)
    return (manifest, dir_fd) if manifest is not None else None


def check_manifest(dir_fd: int, directory: str, inputs: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The manifest if it is for `inputs` and every file it lists is there with its size; else None,
    with a warning saying why the cache is rebuilt."""
    manifest = read_manifest(dir_fd, directory)
    if manifest is None:
        logger.warning("swap cache %s has no manifest (an unfinished build): rebuilding it", directory)
        return None
    if manifest.get("layout") != LAYOUT_VERSION or manifest.get("inputs") != json.loads(json.dumps(inputs)):
        logger.warning("swap cache %s was made from other inputs: rebuilding it", directory)
        return None
    if not isinstance(manifest.get("files"), dict):
        logger.warning("swap cache %s: %s lists no files: rebuilding it", directory, MANIFEST)
        return None
    problem = file_problem(dir_fd, directory, manifest)
    if problem is not None:
        logger.warning("swap cache file %s: rebuilding the cache from the checkpoint", problem)
        return None
    return manifest
