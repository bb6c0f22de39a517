"""SwapCache: parameter swap files kept between runs, so that a later load of the same checkpoint reuses them.

`zero.from_pretrained(..., swap_cache=True)` puts the stage-3 parameter swap files of a load in a persistent
directory instead of private scratch swap (offload.swap.space):

    <root>/zero-offload-cache-<uid>/<fingerprint>/         0700: the swap files (0600) and manifest.json
    <root>/zero-offload-cache-<uid>/<fingerprint>.lock     0600: flock'd by every process using the directory

`<root>` is `offload_param.nvme_path` (or the directory given as `swap_cache=`); `<uid>` is the user's id, so
users sharing a root never meet in one directory. The root must be one no other user can rename entries in
(offload.swap.space.check_nvme_path); it is opened once, the per-user directory and every directory, lock,
manifest and swap file below it are opened relative to held descriptors with O_NOFOLLOW and checked on the
descriptor (owned by this user, 0700 / 0600), and the swap files are read and written relative to the
fingerprint directory's descriptor (`SwapFile` is an `offload.aio.FileAt`). A per-user directory that
another user created first, or a symlink in its place, is refused (SwapCacheError, EPERM).

The fingerprint is a hash of everything that decides the files' names and bytes (`inputs`, assembled by the
loader: checkpoint files' names, sizes and mtimes, config.json, dtype, quantization, world size and rank,
...), and the manifest repeats those inputs in full, so a hash collision or a different package version is
never taken for a match.

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

The directory, lock and manifest helpers are in zero.stage3.cache_dir.

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
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional

from offload import cleanup
from offload.swap.private_dir import O_CLOEXEC, O_NOFOLLOW, DirFd, open_root
from offload.swap.space import (
    DEFAULT_ALIGNMENT,
    SwapFile,
    align_up,
    create_swap_file,
)
from zero.stage3.cache_dir import (
    LAYOUT_VERSION,
    LOCK_SUFFIX,
    MANIFEST,
    SwapCacheError,
    SwapCacheMismatch,
    cache_error,
    fsync_file,
    is_file_in,
    open_lock,
    private_dir,
    reclaim_unfinished,
    remove_dir,
    try_lock,
    usable_cache,
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

CACHE_DIR = f"zero-offload-cache-{os.geteuid()}"  # per user: users sharing a root never share it


def fingerprint(inputs: Mapping[str, Any]) -> str:
    """The hex digest (32 characters) naming the cache directory of `inputs` (JSON-serialisable)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class SwapCache:
    """One fingerprint's cache directory, held through its lock: being built (`reused` False) or complete
    and reused. Has SwapSpace's interface for the stage-3 store (`create`, `close`, `dir`,
    `bytes_allocated`, `read_only`); `open_swap_cache` makes one."""

    def __init__(
        self,
        directory: str,
        fd: int,
        inputs: Mapping[str, Any],
        manifest: Optional[Dict],
        base_fd: int,
        dir_fd: int,
    ) -> None:
        self.dir = directory
        self.dir_fd = DirFd(dir_fd, directory, cache_error)  # every file is opened relative to it
        self.alignment = DEFAULT_ALIGNMENT
        self.inputs = dict(inputs)
        self.reused = manifest is not None
        self._expected: Dict[str, int] = dict(manifest["files"]) if manifest is not None else {}
        self._files: Dict[str, SwapFile] = {}
        self._sealed = self.reused
        self._lock = threading.Lock()
        state = {
            "fd": fd,
            "base_fd": base_fd,
            "dir": self.dir_fd,
            "name": os.path.basename(directory),
            "sealed": self._sealed,
            "pid": os.getpid(),
        }
        self._state = state
        self._finalizer = weakref.finalize(self, SwapCache._release, state)
        self._registration = cleanup.register(self._finalizer)

    @staticmethod
    def _release(state: Dict[str, Any]) -> None:
        fd = state.pop("fd", None)
        if fd is None:
            return
        try:
            held: DirFd = state["dir"]
            if (
                not state["sealed"]
                and state["pid"] == os.getpid()
                and held.is_at(state["base_fd"], state["name"])
            ):
                # unfinished: never used by anyone
                shutil.rmtree(state["name"], ignore_errors=True, dir_fd=state["base_fd"])
        finally:
            state["dir"].close()
            os.close(state["base_fd"])
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
            f = SwapFile(path, size, self.dir_fd)
        else:
            f = create_swap_file(path, size, self.alignment, self.dir_fd)
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
            fsync_file(self.dir_fd.fd, f.name, f.path, os.O_RDONLY)
        manifest = {
            "layout": LAYOUT_VERSION,
            "inputs": self.inputs,
            "files": {os.path.basename(f.path): f.nbytes for f in self.files},
        }
        tmp_name = MANIFEST + ".tmp"
        tmp = os.path.join(self.dir, tmp_name)
        dfd = self.dir_fd.fd
        try:
            try:
                os.unlink(tmp_name, dir_fd=dfd)  # left by a failed seal: the directory is ours alone
            except FileNotFoundError:
                pass
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
            with open(os.open(tmp_name, flags, 0o600, dir_fd=dfd), "w", encoding="utf-8") as out:
                os.fchmod(out.fileno(), 0o600)
                json.dump(manifest, out, sort_keys=True, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as e:
            raise SwapCacheError(e.errno, f"cannot write the swap cache manifest: {e.strerror}", tmp) from e
        try:
            os.fsync(dfd)
        except OSError as e:
            raise SwapCacheError(e.errno, f"cannot fsync the swap cache file: {e.strerror}", self.dir) from e
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


def open_swap_cache(root: str, inputs: Mapping[str, Any], rebuild: bool = False) -> Optional[SwapCache]:
    """The cache of `inputs` under `<root>/zero-offload-cache/`: complete and reused, or empty and to be
    built (this process holds it exclusively until `seal`). A cache without a manifest, with other inputs,
    or with a file missing or of the wrong size is removed and rebuilt (with a warning naming the file and
    both sizes); `rebuild`: a complete one too. None, with a warning, when another process holds the lock
    and the cache is not complete (being built or broken): the caller uses private scratch swap. Removes
    unfinished caches of other fingerprints whose builder is gone."""
    root = os.path.abspath(os.path.expanduser(root))
    base = os.path.join(root, CACHE_DIR)
    root_fd = open_root(root, cache_error)
    try:
        base_fd = private_dir(root_fd, CACHE_DIR, base)
    finally:
        os.close(root_fd)
    try:
        cache = _open_in(base_fd, base, inputs, rebuild)
    except BaseException:
        os.close(base_fd)
        raise
    if cache is None:
        os.close(base_fd)
    return cache


def _open_in(base_fd: int, base: str, inputs: Mapping[str, Any], rebuild: bool) -> Optional[SwapCache]:
    fp = fingerprint({**inputs, "layout": LAYOUT_VERSION})
    reclaim_unfinished(base_fd, base, fp)
    directory = os.path.join(base, fp)
    lock_name = fp + LOCK_SUFFIX
    lock_path = directory + LOCK_SUFFIX
    for _ in range(100):
        fd = open_lock(lock_name, base_fd, lock_path)
        try:
            exclusive = try_lock(fd, fcntl.LOCK_EX)
            if not exclusive and not try_lock(fd, fcntl.LOCK_SH):
                logger.warning(
                    "swap cache %s is being built by another process: this load uses private scratch swap",
                    directory,
                )
                os.close(fd)
                return None
            if not is_file_in(fd, base_fd, lock_name):  # replaced since we opened it: try the new one
                os.close(fd)
                continue
            found = None if rebuild else usable_cache(base_fd, fp, directory, inputs)
            if found is not None:
                manifest, dir_fd = found
                if exclusive:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                return SwapCache(directory, fd, inputs, manifest, base_fd, dir_fd)
            if not exclusive:
                logger.warning(
                    "swap cache %s is incomplete or does not match, and another process uses it: this load "
                    "uses private scratch swap",
                    directory,
                )
                os.close(fd)
                return None
            try:
                os.lstat(fp, dir_fd=base_fd)
                remove_dir(base_fd, fp, directory)
            except FileNotFoundError:
                pass
            dir_fd = private_dir(base_fd, fp, directory)
            return SwapCache(directory, fd, inputs, None, base_fd, dir_fd)
        except BaseException:
            os.close(fd)
            raise
    raise SwapCacheError(errno.EAGAIN, "could not lock the swap cache", lock_path)
