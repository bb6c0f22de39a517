"""The files ds-nvme-bench writes (--json, --write-config, --plot): checked first, written atomically.

Checks, all before the first measurement (a long run must not end in "cannot write the report"):

- an existing file is replaced only with --force; a directory, a device or a dangling symlink never is;
- the directory the file goes into must exist and take a new file (a probe file is created and removed:
  permission bits alone say nothing for root, or on a read-only mount);
- two options must not name the same file.

Writing: the content goes to a temporary file in the target's own directory, is fsynced, and is renamed
over the target (or, without --force, linked to it, so a file that appeared meanwhile is not replaced
either); then the directory is fsynced. A kill at any point leaves either the old file or the complete new
one, never half a report; the temporary file is removed on errors and on SIGTERM/SIGHUP through
`offload.cleanup`.
"""

from __future__ import annotations

import errno as errno_mod
import os
import stat
import uuid
from typing import IO, Callable, Dict, Optional, Sequence, Tuple

from offload.cleanup import register

from .errors import BenchError

# errno values with which a filesystem refuses hard links: the no-clobber link falls back to a checked rename.
_NO_LINKS = {
    errno_mod.EPERM,
    errno_mod.EXDEV,
    errno_mod.EMLINK,
    errno_mod.ENOSYS,
    errno_mod.EOPNOTSUPP,
    getattr(errno_mod, "ENOTSUP", errno_mod.EOPNOTSUPP),
}


def _describe(e: OSError) -> str:
    name = errno_mod.errorcode.get(e.errno or 0, "?")
    return f"{e.strerror or e} (errno {e.errno} {name})"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _temp_name(target: str) -> str:
    directory, base = os.path.split(target)
    return os.path.join(directory, f".{base}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def resolve_target(path: str) -> str:
    """Where writing `path` lands: the file a symlink points at (the link itself is kept), else `path`."""
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def check_target(option: str, path: str, force: bool) -> str:
    """Raise BenchError naming `option` and `path` unless the run may write `path`; returns the target."""
    if not path:
        raise BenchError(f"{option}: the file name is empty")
    if path.endswith(os.sep):
        raise BenchError(f"{option} {path}: names a directory (name a file to write)")
    if os.path.isdir(path):
        raise BenchError(f"{option} {path}: is a directory (name a file to write)")
    if os.path.lexists(path):
        if os.path.islink(path) and not os.path.exists(path):
            raise BenchError(f"{option} {path}: is a symlink to a missing file; it is never overwritten")
        try:
            mode = os.stat(path).st_mode
        except OSError as e:  # a dangling symlink, or a component that cannot be searched
            raise BenchError(f"{option} {path}: cannot be replaced: {_describe(e)}") from None
        if not stat.S_ISREG(mode):
            raise BenchError(f"{option} {path}: is not a regular file; it is never overwritten")
        if not force:
            raise BenchError(f"{option} {path}: already exists (pass --force to overwrite it)")
    target = resolve_target(path)
    parent = os.path.dirname(target)
    if not os.path.exists(parent):
        raise BenchError(f"{option} {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise BenchError(f"{option} {path}: {parent} is not a directory")
    probe = _temp_name(target)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise BenchError(f"{option} {path}: directory {parent} is not writable: {_describe(e)}") from None
    try:
        os.close(fd)
    finally:
        _unlink_quietly(probe)
    return target


def check_targets(targets: Sequence[Tuple[str, Optional[str]]], force: bool) -> Dict[str, str]:
    """Check every (option, path) given; returns option -> target. Two options naming one file: an error."""
    resolved: Dict[str, str] = {}
    for option, path in targets:
        if path is None:
            continue
        target = check_target(option, path, force)
        for other, other_target in resolved.items():
            if other_target == target:
                raise BenchError(f"{other} and {option} both name {path}: give each its own file")
        resolved[option] = target
    return resolved


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not sync directories; the file itself is on disk
        pass
    finally:
        os.close(fd)


def _publish_without_overwriting(tmp: str, target: str, shown: str) -> None:
    exists = BenchError(
        f"{shown}: was created by something else during the run; not overwritten (use --force)"
    )
    try:
        os.link(tmp, target)  # atomic, and fails if the name is taken
    except FileExistsError:
        raise exists from None
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        if os.path.lexists(target):
            raise exists from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)


def write_atomically(path: str, write: Callable[[IO[bytes]], None], overwrite: bool = True) -> None:
    """Write `path` through `write(binary_file)`: a complete new file or the old one, whatever happens.

    With `overwrite` false an existing `path` is kept and BenchError is raised.
    """
    target = resolve_target(path)
    directory = os.path.dirname(target)
    tmp = _temp_name(target)
    cleanup = register(lambda: _unlink_quietly(tmp))  # a SIGTERM while writing leaves no temporary file
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # mode as umask allows
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, target)
        else:
            _publish_without_overwriting(tmp, target, path)
        _fsync_directory(directory)
    finally:
        cleanup()  # removes the temporary file if it is still there (an error), then forgets it
