"""SwapSpace: a private directory of preallocated swap files under the configured `nvme_path`.

The directory is created 0700 and every file 0600, because optimizer state is the model itself. Files are
preallocated (posix_fallocate) at creation, so running out of disk shows up when the engine is built rather
than halfway through a step, and region offsets are aligned for O_DIRECT.

Lifetime. Everything is removed on `close()`, when the object is collected, at interpreter exit (an
uncaught exception and Ctrl-C included) and when the process is told to stop with SIGTERM or SIGHUP
(`offload.cleanup`). A process that dies without running any code (SIGKILL, the OOM killer, a crash, a lost
node) cannot remove anything, so every swap directory has a lock that proves its owner is alive:

    <nvme_path>/.zero-offload-XXXX.lock   0600, flock(LOCK_EX) held by the owner for the directory's life
    <nvme_path>/zero-offload-XXXX/        0700, the swap files

The kernel drops an flock when its holder dies, however it dies. The lock file is created, locked, checked
to still be the file at that name, and stamped (pid, host, boot) before the directory exists, and it is
unlinked only after the directory is gone, by whoever holds the lock. `reclaim_stale(nvme_path)` (run by
every new SwapSpace) removes each directory whose lock it can take without waiting: its owner is dead. A
directory whose lock is held is never touched, nor anything that is not exactly such a pair (our prefix,
our uid, a regular 0600 lock file with our stamp, a real 0700 directory: never a symlink). On a filesystem
shared between machines a lock need not be visible across them, so a directory is reclaimed only on the
machine that stamped it: under the same kernel boot (/proc/sys/kernel/random/boot_id: its flock is the
truth), or under a later boot of the same machine (/etc/machine-id: every process of the earlier boot is
gone). A host name is never enough: two machines can share one.

Paths: `nvme_path` must be a directory no other user can rename entries in (`check_nvme_path`). It is opened
once, the lock file and directory are created relative to that descriptor (O_EXCL, O_NOFOLLOW), and the
directory stays open for the space's life (`dir_fd`): swap files are created, grown, opened for I/O
(`SwapFile` is an `offload.aio.FileAt`) and removed relative to it, never by path.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import socket
import stat
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from offload import cleanup
from offload.swap.private_dir import O_CLOEXEC, O_NOFOLLOW, DirFd, open_root, private_subdir, unsafe_reason

__all__ = [
    "SWAP_PREFIXES",
    "ReclaimedSpace",
    "SwapFile",
    "SwapSpace",
    "SwapSpaceError",
    "align_up",
    "check_nvme_path",
    "create_swap_file",
    "is_file_at",
    "reclaim_stale",
]

logger = logging.getLogger("offload.swap")

DEFAULT_ALIGNMENT = 4096
DEFAULT_PREFIX = "zero-offload-"
# The prefixes our engines give their swap directories (optimizer state; stage-3 parameters).
SWAP_PREFIXES: Tuple[str, ...] = ("zero-offload-", "zero-stage3-")
_LOCK_PREFIX, _LOCK_SUFFIX = ".", ".lock"  # <nvme_path>/.zero-offload-XXXX.lock: hidden beside its directory
_STAMP_MAGIC = "zero-offload swap space"


class SwapSpaceError(OSError):
    """The swap directory or one of its files could not be created; carries errno and the path."""


def align_up(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class SwapFile:
    """One preallocated 0600 file of a SwapSpace: its path and size in bytes.

    Also an `offload.aio.FileAt`: `dir_fd` is the space's open directory and `name` the file's name in it,
    so I/O handed a SwapFile opens it relative to that descriptor (openat, O_NOFOLLOW), never by its path."""

    path: str
    nbytes: int
    dir: Optional[DirFd] = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """The file's name in the swap directory."""
        return os.path.basename(self.path)

    @property
    def dir_fd(self) -> int:
        """The open directory the file is in; SwapSpaceError (EBADF) once its space is closed."""
        if self.dir is None:
            raise AttributeError(f"swap file {self.path} was made without its directory descriptor")
        return self.dir.fd


def _swap_error(err: int, message: str, path: str) -> OSError:
    return SwapSpaceError(err, message, path)


def check_nvme_path(nvme_path: str, key: str = "offload nvme_path") -> str:
    """Absolute `nvme_path` if it is an existing, writable directory that no other user can rename entries
    in (owned by this user or root; writable by others only with the sticky bit); SwapSpaceError (EPERM for
    an unsafe one) naming it and the config `key` it came from (e.g.
    "zero_optimization.offload_optimizer.nvme_path") otherwise."""
    if not nvme_path:
        raise SwapSpaceError(errno.EINVAL, f"{key} is empty: set zero_optimization.offload_*.nvme_path")
    path = os.path.abspath(os.path.expanduser(nvme_path))
    if not os.path.exists(path):
        raise SwapSpaceError(errno.ENOENT, f"{key} does not exist", path)
    if not os.path.isdir(path):
        raise SwapSpaceError(errno.ENOTDIR, f"{key} is not a directory", path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise SwapSpaceError(errno.EACCES, f"{key} is not writable by this user", path)
    reason = unsafe_reason(os.stat(path))
    if reason is not None:
        raise SwapSpaceError(errno.EPERM, f"{key} {reason}", path)
    return path


def create_swap_file(
    path: str, nbytes: int, alignment: int = DEFAULT_ALIGNMENT, dir: Optional[DirFd] = None
) -> SwapFile:
    """A new 0600 file at `path` (which must not exist) of `nbytes` rounded up to `alignment`, fully
    allocated on disk; SwapSpaceError naming the file, the size and the errno otherwise. With `dir`, the file
    is `os.path.basename(path)` in that open directory (openat, O_EXCL | O_NOFOLLOW) and the SwapFile keeps
    the directory for the I/O on it."""
    nbytes = align_up(max(int(nbytes), 1), alignment)
    name, dir_fd = (os.path.basename(path), dir.fd) if dir is not None else (path, None)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise SwapSpaceError(e.errno, f"cannot create swap file: {e.strerror}", path) from e
    try:
        os.fchmod(fd, 0o600)  # a restrictive umask could only narrow it; make it exact
        _preallocate(fd, nbytes, path)
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        raise
    os.close(fd)
    return SwapFile(path, nbytes, dir)


class SwapSpace:
    """Owns `<nvme_path>/zero-offload-XXXX/`, its lock file and the files in it.

    Creating one first reclaims the directories that dead processes left under the same `nvme_path`
    (`reclaim_stale`; pass `reclaim=False` to skip)."""

    def __init__(
        self,
        nvme_path: str,
        alignment: int = DEFAULT_ALIGNMENT,
        prefix: str = DEFAULT_PREFIX,
        reclaim: bool = True,
    ) -> None:
        root = check_nvme_path(nvme_path)
        if not prefix or os.sep in prefix:
            raise ValueError(f"swap directory prefix must be a non-empty file name, got {prefix!r}")
        if reclaim:
            prefixes = SWAP_PREFIXES if prefix.startswith(SWAP_PREFIXES) else SWAP_PREFIXES + (prefix,)
            try:
                reclaim_stale(root, prefixes)
            except OSError as e:  # never a reason not to start
                logger.debug("could not scan %s for stale swap directories: %s", root, e)
        self._lease = _Lease.create(root, prefix)
        self.dir = self._lease.dir
        self.lock_path = self._lease.lock_path
        self.dir_fd = self._lease.held  # every file is opened relative to it
        self.alignment = max(DEFAULT_ALIGNMENT, int(alignment))
        self._files: Dict[str, SwapFile] = {}
        self._lock = threading.Lock()
        # Collected, closed, normal exit (finalize's own atexit hook) or SIGTERM/SIGHUP (cleanup's).
        self._finalizer = weakref.finalize(self, self._lease.release)
        self._lease.registration = cleanup.register(self._finalizer)

    @property
    def bytes_allocated(self) -> int:
        """Bytes of the swap files allocated now."""
        with self._lock:
            return sum(f.nbytes for f in self._files.values())

    @property
    def files(self) -> List[SwapFile]:
        """The swap files allocated now."""
        with self._lock:
            return list(self._files.values())

    @property
    def closed(self) -> bool:
        """Whether the space was closed (its directory removed)."""
        return not self._finalizer.alive

    @property
    def read_only(self) -> bool:
        """False: scratch swap files are written as often as their owner likes (a persistent cache of
        weights, zero.stage3.swap_cache, is read-only once complete)."""
        return False

    def create(self, name: str, nbytes: int) -> SwapFile:
        """A new 0600 file of `nbytes` (rounded up to the alignment), fully allocated on disk."""
        if self.closed:
            raise SwapSpaceError(errno.EBADF, "swap space is closed", self.dir)
        if os.sep in name or name in ("", ".", ".."):
            raise ValueError(f"swap file name must be a plain file name, got {name!r}")
        f = create_swap_file(os.path.join(self.dir, name), nbytes, self.alignment, self.dir_fd)
        with self._lock:
            self._files[name] = f
        return f

    def grow(self, name: str, nbytes: int) -> SwapFile:
        """Extend file `name` to at least `nbytes` (rounded up to the alignment), allocated on disk; a full
        disk raises SwapSpaceError naming the file, the size asked for and the space left."""
        with self._lock:
            f = self._files.get(name)
        if f is None:
            raise SwapSpaceError(errno.ENOENT, f"no swap file named {name!r} in this swap space", self.dir)
        nbytes = align_up(max(int(nbytes), 1), self.alignment)
        if nbytes <= f.nbytes:
            return f
        try:
            fd = os.open(name, os.O_RDWR | O_NOFOLLOW | O_CLOEXEC, dir_fd=self.dir_fd.fd)
        except OSError as e:
            raise SwapSpaceError(e.errno, f"cannot open swap file to grow it: {e.strerror}", f.path) from e
        try:
            _preallocate(fd, nbytes, f.path)
        finally:
            os.close(fd)
        grown = SwapFile(f.path, nbytes, self.dir_fd)
        with self._lock:
            self._files[name] = grown
        return grown

    def remove(self, name: str) -> None:
        """Delete file `name` (its space returns to the disk); unknown names are ignored."""
        with self._lock:
            f = self._files.pop(name, None)
        if f is not None and not self.dir_fd.closed:
            try:
                os.unlink(name, dir_fd=self.dir_fd.fd)
            except OSError:
                pass

    def close(self) -> None:
        """Remove every swap file, the directory and its lock file. Safe to call more than once."""
        self._finalizer()
        with self._lock:
            self._files.clear()

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapSpace({self.dir!r}, files={len(self._files)}, bytes={self.bytes_allocated})"


class _Lease:
    """The directory, its lock file and the locked fd: created together, released together, once.

    `nvme_path` is opened once (`root_fd`); the lock file and the directory are created relative to it
    (O_EXCL, O_NOFOLLOW) and the directory is held open (`held`) for the space's life: every swap file is
    opened relative to that descriptor, so renaming or replacing anything under `nvme_path` later changes
    nothing. `release` may run from a signal handler that interrupted the main thread anywhere (even inside
    `release` itself), so it takes no lock: the state is claimed by an atomic `list.pop`. A forked child
    shares the parent's lock (the same open file description) and removes nothing."""

    def __init__(self, dir: str, lock_path: str, fd: int, root_fd: int, held: DirFd) -> None:
        self.dir = dir
        self.lock_path = lock_path
        self.root_fd = root_fd
        self.held = held
        self.pid = os.getpid()
        self.registration: Optional[cleanup.Registration] = None
        self._state = [fd]

    @classmethod
    def create(cls, root: str, prefix: str) -> _Lease:
        stamp = _stamp()
        root_fd = open_root(root, _swap_error)
        try:
            for _ in range(100):
                stem = prefix + secrets.token_hex(6)
                lock_name = _LOCK_PREFIX + stem + _LOCK_SUFFIX
                lock_path, path = os.path.join(root, lock_name), os.path.join(root, stem)
                lease = cls._try_create(root, root_fd, stem, lock_name, lock_path, path, stamp)
                if lease is not None:
                    return lease
            raise SwapSpaceError(errno.EEXIST, "cannot find a free swap directory name under nvme_path", root)
        except BaseException:
            os.close(root_fd)
            raise

    @classmethod
    def _try_create(
        cls, root: str, root_fd: int, stem: str, lock_name: str, lock_path: str, path: str, stamp: bytes
    ) -> Optional[_Lease]:
        try:
            fd = _open_lock_file(lock_name, root_fd)
        except FileExistsError:
            return None
        except OSError as e:
            raise SwapSpaceError(
                e.errno, f"cannot create the swap directory under nvme_path: {e.strerror}", root
            ) from e
        try:
            os.fchmod(fd, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a reclaimer got it first and unlinks it: take a fresh name
                os.close(fd)
                return None
            except OSError as e:  # no flock here (some network filesystems): nothing is reclaimable
                logger.debug("swap directory lock unsupported under %s: %s", root, e)
            if not _is_file_in(fd, root_fd, lock_name):  # unlinked by a reclaimer before we locked it
                os.close(fd)
                return None
            _write_all(fd, stamp)
            try:
                dir_fd = private_subdir(root_fd, stem, path, _swap_error)
            except FileExistsError:  # a directory without a lock: not ours to use or remove
                os.unlink(lock_name, dir_fd=root_fd)
                os.close(fd)
                return None
        except BaseException as e:
            _unlink_quietly(lock_name, root_fd)
            os.close(fd)
            if isinstance(e, OSError) and not isinstance(e, SwapSpaceError):
                raise SwapSpaceError(
                    e.errno, f"cannot create the swap directory under nvme_path: {e.strerror}", root
                ) from e
            raise
        return cls(path, lock_path, fd, root_fd, DirFd(dir_fd, path, _swap_error))

    def release(self) -> None:
        try:
            fd = self._state.pop()
        except IndexError:
            return  # released already (or being released by the frame this signal interrupted)
        try:
            if self.pid == os.getpid():
                self._remove()
        finally:
            self.held.close()
            os.close(self.root_fd)
            os.close(fd)  # drops the lock (in a forked child, only its reference to the parent's)
            reg, self.registration = self.registration, None
            if reg is not None:
                reg.cancel()

    def _remove(self) -> None:
        """Remove the directory and then its lock file, through the held descriptors only."""
        name = os.path.basename(self.dir)
        if self.held.is_at(self.root_fd, name):
            shutil.rmtree(name, ignore_errors=True, dir_fd=self.root_fd)
        else:  # renamed or replaced under us: empty the directory we hold, touch nothing at the name
            for entry in os.listdir(self.held.fd):
                _unlink_quietly(entry, self.held.fd)
            logger.warning("swap directory %s was moved or replaced while in use", self.dir)
        try:
            os.lstat(name, dir_fd=self.root_fd)
        except FileNotFoundError:
            _unlink_quietly(os.path.basename(self.lock_path), self.root_fd)
        except OSError:
            pass  # else keep the lock file: a later run reclaims the rest


def _open_lock_file(name: str, root_fd: int) -> int:
    """A new 0600 lock file `name` in the directory `root_fd` (O_EXCL, O_NOFOLLOW)."""
    return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=root_fd)


def _is_file_in(fd: int, dir_fd: int, name: str) -> bool:
    """Whether the open file `fd` is the file `name` of the directory `dir_fd` now."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(name, dir_fd=dir_fd))
    except OSError:
        return False


@dataclass(frozen=True)
class ReclaimedSpace:
    """A swap directory left by a dead process and removed by `reclaim_stale`."""

    path: str
    nbytes: int  # disk space freed (allocated blocks of its files)
    pid: int  # the process that created it, as recorded in its lock file
    host: str  # for messages only: a host name proves nothing about whose lock it is


def reclaim_stale(nvme_path: str, prefixes: Iterable[str] = SWAP_PREFIXES) -> List[ReclaimedSpace]:
    """Remove the swap directories under `nvme_path` whose owner is dead; returns what was removed.

    Considered are only `.<prefix>XXXX.lock` files (a prefix from `prefixes`) that are regular 0600 files of
    this user carrying a swap-space stamp, with the 0700 directory `<prefix>XXXX` of this user beside
    them. Each lock is tried with LOCK_NB: a live owner holds it, so its directory is skipped. The directory
    is removed while the lock is held, then the lock file. A stamp from another machine (a filesystem
    shared between hosts, where the lock may not be visible across them) is left for that machine. Each
    removal is logged as a warning on the `offload.swap` logger. Raises OSError if `nvme_path` cannot be
    listed; anything else that goes wrong leaves that one directory alone."""
    root = os.path.abspath(os.path.expanduser(nvme_path))
    prefixes = tuple(p for p in prefixes if p and os.sep not in p)
    if not prefixes:
        return []
    me = _identity()
    reclaimed = []
    for name in sorted(os.listdir(root)):
        if _is_lock_name(name, prefixes):
            r = _reclaim_one(root, name, me)
            if r is not None:
                reclaimed.append(r)
    return reclaimed


def _reclaim_one(root: str, lock_name: str, me: Tuple[str, str, str]) -> Optional[ReclaimedSpace]:
    lock_path = os.path.join(root, lock_name)
    path = _dir_of(lock_path)
    try:
        st = os.lstat(lock_path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600:
        return None
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not os.path.samestat(st, os.fstat(fd)) or not _lock_nb(fd) or not is_file_at(fd, lock_path):
            return None  # replaced since the lstat, owner alive, or removed by another reclaimer
        data = os.pread(fd, 4096, 0)
        if not data:
            # Created but never stamped: its creator died before locking it, or has not locked it yet (it
            # then finds the name gone and takes another). No directory belongs to it.
            os.unlink(lock_path)
            return None
        owner = _parse_stamp(data)
        if owner is None:
            return None  # not a lock file of ours
        pid, host, boot, machine = owner
        if not _same_machine(boot, machine, me):
            logger.info(
                "swap directory %s belongs to host %s (another machine, or one this process cannot tell is "
                "this one): left for a process there to reclaim",
                path,
                host,
            )
            return None
        nbytes = 0
        try:
            dst = os.lstat(path)
        except FileNotFoundError:
            dst = None
        if dst is not None:
            if (
                not stat.S_ISDIR(dst.st_mode)
                or dst.st_uid != os.geteuid()
                or stat.S_IMODE(dst.st_mode) != 0o700
            ):
                logger.warning("not reclaiming %s: not a private swap directory of this user", path)
                return None
            nbytes = _disk_bytes(path)
            shutil.rmtree(path, ignore_errors=True)  # refuses a symlink swapped in since the lstat
            if os.path.lexists(path):
                logger.warning("could not remove all of stale swap directory %s", path)
                return None
        os.unlink(lock_path)
    except OSError as e:
        logger.debug("not reclaiming %s: %s", path, e)
        return None
    finally:
        os.close(fd)
    logger.warning(
        "reclaimed stale swap directory %s (%s) left by process %d on %s, which is gone",
        path,
        _human_bytes(nbytes),
        pid,
        host,
    )
    return ReclaimedSpace(path, nbytes, pid, host)


def _is_lock_name(name: str, prefixes: Tuple[str, ...]) -> bool:
    stem = name[len(_LOCK_PREFIX) : -len(_LOCK_SUFFIX)]
    return name.startswith(_LOCK_PREFIX) and name.endswith(_LOCK_SUFFIX) and stem.startswith(prefixes)


def _dir_of(lock_path: str) -> str:
    head, name = os.path.split(lock_path)
    return os.path.join(head, name[len(_LOCK_PREFIX) : -len(_LOCK_SUFFIX)])


def _lock_nb(fd: int) -> bool:
    """True if this fd now holds the exclusive lock; False if another holds it or flock is unsupported
    (then whether its owner lives cannot be told: the directory is left alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def is_file_at(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the file at `path` now (not unlinked or replaced since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def _read_id(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(64).strip()
    except (OSError, ValueError):
        return ""


def _identity() -> Tuple[str, str, str]:
    """(host name, kernel boot id, machine id). Processes sharing a boot id share the kernel that keeps the
    locks; a machine id with another boot id is this machine before a reboot, whose processes are all gone.
    The host name is for messages only: two machines may well share one."""
    boot = _read_id("/proc/sys/kernel/random/boot_id")
    machine = _read_id("/etc/machine-id") or _read_id("/var/lib/dbus/machine-id")
    return socket.gethostname(), boot, machine


def _same_machine(boot: str, machine: str, me: Tuple[str, str, str]) -> bool:
    """Whether a lock stamped with (`boot`, `machine`) was taken on this machine: under this kernel (its
    flock tells whether the owner lives) or under an earlier boot of it (the owner is gone)."""
    return bool(boot and boot == me[1]) or bool(machine and machine == me[2])


def _stamp() -> bytes:
    host, boot, machine = _identity()
    return f"{_STAMP_MAGIC}\npid {os.getpid()}\nhost {host}\nboot {boot}\nmachine {machine}\n".encode()


def _parse_stamp(data: bytes) -> Optional[Tuple[int, str, str, str]]:
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError:
        return None
    if not lines or lines[0] != _STAMP_MAGIC:
        return None
    fields = dict(line.partition(" ")[::2] for line in lines[1:])
    try:
        pid = int(fields.get("pid", ""))
    except ValueError:
        return None
    return pid, fields.get("host", ""), fields.get("boot", ""), fields.get("machine", "")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _disk_bytes(path: str) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _unlink_quietly(path: str, dir_fd: Optional[int] = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def _preallocate(fd: int, nbytes: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            try:
                free = f" ({_human_bytes(shutil.disk_usage(os.path.dirname(path)).free)} free)"
            except OSError:
                free = ""
            raise SwapSpaceError(
                e.errno, f"cannot allocate {nbytes} bytes for swap file: {e.strerror}{free}", path
            ) from e
    # Filesystems without fallocate: extend by writing the last byte, so the size is at least right.
    try:
        os.pwrite(fd, b"\0", nbytes - 1)
    except OSError as e:
        raise SwapSpaceError(e.errno, f"cannot extend swap file to {nbytes} bytes: {e.strerror}", path) from e
