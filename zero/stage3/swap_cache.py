"""SwapCache: parameter swap files kept between runs, so that a later load of the same checkpoint reuses them.

`zero.from_pretrained(..., swap_cache=True)` puts the stage-3 parameter swap files of a load in a persistent
directory instead of private scratch swap (offload.swap.space):

    <root>/zero-offload-cache/<fingerprint>/         0700: the swap files (0600) and manifest.json
    <root>/zero-offload-cache/<fingerprint>.lock     0600: flock'd by every process using the directory

`<root>` is `offload_param.nvme_path` (or the directory given as `swap_cache=`). The fingerprint is a hash of
everything that decides the files' names and bytes (`inputs`, assembled by the loader: checkpoint files'
names, sizes and mtimes, config.json, dtype, quantization, world size and rank, ...), and the manifest repeats
those inputs in full, so a hash collision or a different package version is never taken for a match.

Building: the first process takes the lock exclusively, removes whatever an earlier, unfinished build left,
creates the files (preallocated, 0600) and the loader writes them; `seal()` then fsyncs every file and writes
the manifest last, atomically (temporary file, fsync, rename, fsync of the directory), and turns the lock
into a shared one. A directory without a manifest is never used: it is removed on close, at exit or on
SIGTERM (offload.cleanup), and a build cut short by a crash is removed by the next `open_swap_cache` under
the same root, once nobody holds its lock.

Reusing: a process that finds a manifest whose inputs equal its own checks that every file it lists exists
with the listed size and holds the lock shared for as long as it uses the files; `create` then hands out the
existing files (the names and sizes the store asks for must be the manifest's: `SwapCacheMismatch`
otherwise). A complete cache is read-only (`read_only`): the store refuses to write into it. Its files
stay after close and exit; delete the directory to drop it.

Two processes: any number may reuse a complete cache at once (shared locks). One that finds the cache
missing or broken while another process holds the lock (building it, or reading it) does not wait: it
returns None and the loader falls back to private scratch swap, with a warning.

What is not checked: the checkpoint's bytes are not hashed. A shard rewritten with the same size and mtime
(or the cache files edited in place) is not noticed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional

from offload import cleanup
from offload.swap.space import (
    DEFAULT_ALIGNMENT,
    SwapFile,
    SwapSpaceError,
    align_up,
    create_swap_file,
    is_file_at,
)

__all__ = [
    "CACHE_DIR",
    "LAYOUT_VERSION",
    "SwapCache",
    "SwapCacheError",
    "SwapCacheMismatch",
    "fingerprint",
    "open_swap_cache",
]

logger = logging.getLogger("zero")

CACHE_DIR = "zero-offload-cache"
LAYOUT_VERSION = 1  # raised whenever the swap files' names or bytes change for the same inputs
MANIFEST = "manifest.json"
_LOCK_SUFFIX = ".lock"


class SwapCacheError(SwapSpaceError):
    """A swap cache directory or file cannot be used: names the file, the sizes and the errno."""


class SwapCacheMismatch(SwapCacheError):
    """The model asks for a swap file the complete cache does not hold with that size (the fingerprint
    missed something that changes the layout): the loader rebuilds the cache."""


def fingerprint(inputs: Mapping[str, Any]) -> str:
    """The hex digest (32 characters) naming the cache directory of `inputs` (JSON-serialisable)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _private_dir(path: str) -> None:
    """Create `path` 0700 if missing; refuse one that is not a real directory of this user."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SwapCacheError(e.errno, f"cannot create the swap cache directory: {e.strerror}", path) from e
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SwapCacheError(errno.EPERM, "swap cache path is not a directory of this user", path)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _open_lock(path: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise SwapCacheError(e.errno, f"cannot open the swap cache lock: {e.strerror}", path) from e
    os.fchmod(fd, 0o600)
    return fd


def _read_manifest(directory: str) -> Optional[Dict[str, Any]]:
    """The manifest, or None when there is none or it cannot be read (an unfinished or damaged cache)."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("swap cache %s: unreadable %s (%s): rebuilding it", directory, MANIFEST, e)
        return None
    return m if isinstance(m, dict) else None


def _file_problem(directory: str, manifest: Dict[str, Any]) -> Optional[str]:
    """None if every file the manifest lists exists with its listed size, else what is wrong with one."""
    for name, nbytes in manifest.get("files", {}).items():
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, e.errno)
            return f"{path}: expected {nbytes} bytes, cannot stat it ({code})"
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            return f"{path}: expected {nbytes} bytes, found {st.st_size} bytes"
    return None


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        raise SwapCacheError(errno.ENOTEMPTY, "cannot remove the unfinished swap cache directory", path)


def _reclaim_unfinished(root: str, keep: str) -> None:
    """Remove the directories under `root` that have no manifest and whose lock nobody holds (a build
    that died); `keep` (a fingerprint) is left to the caller."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if name == keep or name.endswith(_LOCK_SUFFIX) or os.path.exists(os.path.join(path, MANIFEST)):
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = _open_lock(path + _LOCK_SUFFIX)
        except (OSError, SwapCacheError):
            continue
        try:
            if _lock(fd, fcntl.LOCK_EX) and is_file_at(fd, path + _LOCK_SUFFIX):
                if not os.path.exists(os.path.join(path, MANIFEST)):
                    shutil.rmtree(path, ignore_errors=True)
                    logger.warning("removed unfinished swap cache %s (its builder is gone)", path)
        finally:
            os.close(fd)


class SwapCache:
    """One fingerprint's cache directory, held through its lock: being built (`reused` False) or complete
    and reused. Has SwapSpace's interface for the stage-3 store (`create`, `close`, `dir`,
    `bytes_allocated`, `read_only`); `open_swap_cache` makes one."""

    def __init__(self, directory: str, fd: int, inputs: Mapping[str, Any], manifest: Optional[Dict]) -> None:
        self.dir = directory
        self.alignment = DEFAULT_ALIGNMENT
        self.inputs = dict(inputs)
        self.reused = manifest is not None
        self._expected: Dict[str, int] = dict(manifest["files"]) if manifest is not None else {}
        self._files: Dict[str, SwapFile] = {}
        self._sealed = self.reused
        self._lock = threading.Lock()
        state = {"fd": fd, "dir": directory, "sealed": self._sealed, "pid": os.getpid()}
        self._state = state
        self._finalizer = weakref.finalize(self, SwapCache._release, state)
        self._registration = cleanup.register(self._finalizer)

    @staticmethod
    def _release(state: Dict[str, Any]) -> None:
        fd = state.pop("fd", None)
        if fd is None:
            return
        try:
            if not state["sealed"] and state["pid"] == os.getpid():
                shutil.rmtree(state["dir"], ignore_errors=True)  # unfinished: never used by anyone
        finally:
            os.close(fd)  # drops the lock

    @property
    def read_only(self) -> bool:
        """True once complete (sealed, or reused): the weights in it are never written again."""
        return self._sealed

    @property
    def closed(self) -> bool:
        """Whether `close` ran (the lock is released)."""
        return not self._finalizer.alive

    @property
    def files(self) -> List[SwapFile]:
        """The files handed out so far."""
        with self._lock:
            return list(self._files.values())

    @property
    def bytes_allocated(self) -> int:
        """Bytes of the files handed out so far."""
        with self._lock:
            return sum(f.nbytes for f in self._files.values())

    def create(self, name: str, nbytes: int) -> SwapFile:
        """Building: a new preallocated 0600 file. Reusing: the existing file `name`, which must be listed
        in the manifest with `nbytes` rounded up to the alignment (SwapCacheMismatch otherwise)."""
        if self.closed:
            raise SwapCacheError(errno.EBADF, "swap cache is closed", self.dir)
        if os.sep in name or name in ("", ".", "..", MANIFEST):
            raise ValueError(f"swap file name must be a plain file name, got {name!r}")
        path = os.path.join(self.dir, name)
        size = align_up(max(int(nbytes), 1), self.alignment)
        if self.reused:
            listed = self._expected.get(name)
            if listed != size:
                found = "does not list it" if listed is None else f"lists it with {listed} bytes"
                raise SwapCacheMismatch(
                    errno.ENOENT if listed is None else errno.EINVAL,
                    f"the model needs this swap file with {size} bytes; the cache's manifest {found}",
                    path,
                )
            f = SwapFile(path, size)
        else:
            f = create_swap_file(path, size, self.alignment)
        with self._lock:
            self._files[name] = f
        return f

    def check_complete(self) -> None:
        """Reusing: every file of the manifest was handed out (SwapCacheMismatch naming one that was not)."""
        unused = sorted(set(self._expected) - set(self._files))
        if unused:
            raise SwapCacheMismatch(
                errno.EINVAL,
                f"the model did not ask for {len(unused)} file(s) of the manifest, e.g. {unused[0]!r}",
                self.dir,
            )

    def seal(self) -> None:
        """Building: fsync every file, then write the manifest atomically, last; the cache is complete and
        read-only from now on, and the lock shared. Errors name the file and the errno."""
        if self._sealed:
            return
        for f in self.files:
            _fsync(f.path, os.O_RDONLY)
        manifest = {
            "layout": LAYOUT_VERSION,
            "inputs": self.inputs,
            "files": {os.path.basename(f.path): f.nbytes for f in self.files},
        }
        tmp = os.path.join(self.dir, MANIFEST + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                json.dump(manifest, out, sort_keys=True, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, os.path.join(self.dir, MANIFEST))
        except OSError as e:
            raise SwapCacheError(e.errno, f"cannot write the swap cache manifest: {e.strerror}", tmp) from e
        _fsync(self.dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self._sealed = self._state["sealed"] = True
        fcntl.flock(self._state["fd"], fcntl.LOCK_SH)  # other processes may reuse it now

    def close(self) -> None:
        """Release the lock. An unfinished cache (never sealed) is removed; a complete one stays."""
        self._finalizer()
        reg, self._registration = self._registration, None
        if reg is not None:
            reg.cancel()

    def __repr__(self) -> str:
        kind = "reused" if self.reused else "sealed" if self._sealed else "building"
        return f"SwapCache({self.dir!r}, {kind}, files={len(self._files)})"


def _fsync(path: str, flags: int) -> None:
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise SwapCacheError(e.errno, f"cannot fsync the swap cache file: {e.strerror}", path) from e


def open_swap_cache(root: str, inputs: Mapping[str, Any], rebuild: bool = False) -> Optional[SwapCache]:
    """The cache of `inputs` under `<root>/zero-offload-cache/`: complete and reused, or empty and to be
    built (this process holds it exclusively until `seal`). A cache without a manifest, with other inputs,
    or with a file missing or of the wrong size is removed and rebuilt (with a warning naming the file and
    both sizes); `rebuild`: a complete one too. None, with a warning, when another process holds the lock
    and the cache is not complete (being built or broken): the caller uses private scratch swap. Removes
    unfinished caches of other fingerprints whose builder is gone."""
    base = os.path.join(os.path.abspath(os.path.expanduser(root)), CACHE_DIR)
    _private_dir(base)
    fp = fingerprint({**inputs, "layout": LAYOUT_VERSION})
    _reclaim_unfinished(base, fp)
    directory = os.path.join(base, fp)
    lock_path = directory + _LOCK_SUFFIX
    for _ in range(100):
        fd = _open_lock(lock_path)
        try:
            exclusive = _lock(fd, fcntl.LOCK_EX)
            if not exclusive and not _lock(fd, fcntl.LOCK_SH):
                logger.warning(
                    "swap cache %s is being built by another process: this load uses private scratch swap",
                    directory,
                )
                os.close(fd)
                return None
            if not is_file_at(fd, lock_path):  # replaced since we opened it: try the new one
                os.close(fd)
                continue
            manifest = None if rebuild else _usable(directory, inputs)
            if manifest is not None:
                if exclusive:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                return SwapCache(directory, fd, inputs, manifest)
            if not exclusive:
                logger.warning(
                    "swap cache %s is incomplete or does not match, and another process uses it: this load "
                    "uses private scratch swap",
                    directory,
                )
                os.close(fd)
                return None
            if os.path.lexists(directory):
                _remove_dir(directory)
            _private_dir(directory)
            return SwapCache(directory, fd, inputs, None)
        except BaseException:
            os.close(fd)
            raise
    raise SwapCacheError(errno.EAGAIN, "could not lock the swap cache", lock_path)


def _usable(directory: str, inputs: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The manifest if the cache is complete, for these inputs, with every file of its listed size."""
    manifest = _read_manifest(directory)
    if manifest is None:
        if os.path.lexists(directory):
            logger.warning("swap cache %s has no manifest (an unfinished build): rebuilding it", directory)
        return None
    if manifest.get("layout") != LAYOUT_VERSION or manifest.get("inputs") != json.loads(json.dumps(inputs)):
        logger.warning("swap cache %s was made from other inputs: rebuilding it", directory)
        return None
    if not isinstance(manifest.get("files"), dict):
        logger.warning("swap cache %s: %s lists no files: rebuilding it", directory, MANIFEST)
        return None
    problem = _file_problem(directory, manifest)
    if problem is not None:
        logger.warning("swap cache file %s: rebuilding the cache from the checkpoint", problem)
        return None
    return manifest
