"""Files of a checkpoint: private creation, durable writes, checksums and the manifest.

Checksums are xxh3_64 (the `xxhash` package): 25.7 GiB/s on one core of the CI machine (1 GiB buffer,
median of 3), so hashing stays far below the disk's time both while saving (computed on the bytes as they
are written) and while verifying on load (zlib.crc32 managed 3.9 GiB/s there, slower than a fast NVMe drive
reads). A file's digest is a list, one per
segment of `segment_bytes` bytes: the optimizer file is written region by region (master, then each
state), and hashing each region as it streams out needs no second pass over the file.
"""

from __future__ import annotations

import json
import os
import signal
from typing import IO, Any, Callable, Dict, List, Optional

import torch
import xxhash

from zero.errors import CheckpointIntegrityError

# Test hook: SIGKILL this process when the save reaches the named point (see crash_point calls).
CRASH_ENV = "ZERO_OFFLOAD_TEST_CRASH_AT"
FORMAT_VERSION = 2
HASH = "xxh3_64"
MANIFEST = "manifest.json"
PICKLED = "pickled_states.pt"  # only objects that need pickle (see save.py); loaded only with allow_pickle
_READ_BYTES = 16 << 20

Entry = Dict[str, Any]  # one file in the manifest: {"size", "segment_bytes", "digests"}


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_private(path: str) -> None:
    """Create directory `path` with mode 0700 (exactly: the umask cannot widen it, nor make it unusable)."""
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)


def create_private(path: str) -> int:
    """Create `path` (it must not exist) with mode 0600; returns a descriptor open for writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


class StreamDigest:
    """Digests of a byte stream, one per `segment` bytes (0: the whole stream is one segment)."""

    def __init__(self, segment: int = 0) -> None:
        self.segment = segment
        self.size = 0
        self.digests: List[str] = []
        self._h = xxhash.xxh3_64()
        self._in_segment = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = len(view) if not self.segment else min(len(view), self.segment - self._in_segment)
            self._h.update(view[:take])
            self._in_segment += take
            self.size += take
            view = view[take:]
            if self.segment and self._in_segment == self.segment:
                self.digests.append(self._h.hexdigest())
                self._h, self._in_segment = xxhash.xxh3_64(), 0

    def entry(self) -> Entry:
        digests = list(self.digests)
        if self._in_segment or not digests:
            digests.append(self._h.hexdigest())
        return {"size": self.size, "segment_bytes": self.segment or self.size, "digests": digests}


class _HashingWriter:
    """A write-only file object for torch.save that digests the bytes on their way to the file."""

    def __init__(self, f: IO[bytes], digest: StreamDigest) -> None:
        self._f, self._digest = f, digest

    def write(self, data: Any) -> int:
        self._digest.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def save_object(obj: Any, path: str) -> Entry:
    """torch.save `obj` into a new private file, fsynced; returns its manifest entry."""
    digest = StreamDigest()
    with os.fdopen(create_private(path), "wb") as f:
        torch.save(obj, _HashingWriter(f, digest))
        f.flush()
        os.fsync(f.fileno())
    return digest.entry()


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the file that becomes `path` (directory created if needed): written to a
    temporary file, fsynced and renamed, so `path` is either the old file or the whole new one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)


def save_atomic(obj: Any, path: str) -> None:
    """torch.save `obj` as `path` atomically (`write_atomic`)."""
    write_atomic(path, lambda tmp: torch.save(obj, tmp))


def write_bytes(path: str, data: bytes) -> Entry:
    digest = StreamDigest()
    digest.update(data)
    with os.fdopen(create_private(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.entry()


def digest_file(
    path: str, segment: int, size: Optional[int] = None, on_read: Optional[Callable[[int], None]] = None
) -> Entry:
    """Read `path` sequentially and digest it in segments of `segment` bytes; `on_read(n)` after each read
    (a progress bar)."""
    digest = StreamDigest(segment)
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            digest.update(view[:n])
            if on_read is not None:
                on_read(n)
    entry = digest.entry()
    if size is not None and entry["size"] != size:
        raise CheckpointIntegrityError(f"{path}: {entry['size']} bytes read, expected {size}")
    return entry


def verify_size(path: str, want: Entry) -> None:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointIntegrityError(f"{path}: missing, but listed in the checkpoint's manifest") from None
    if size != want["size"]:
        raise CheckpointIntegrityError(
            f"{path}: {size} bytes, the manifest records {want['size']}: the file was truncated or replaced"
        )


def verify_file(path: str, want: Entry, on_read: Optional[Callable[[int], None]] = None) -> None:
    """Raise CheckpointIntegrityError naming `path` unless its size and digests are those of `want`."""
    verify_size(path, want)
    got = digest_file(path, int(want["segment_bytes"]), size=int(want["size"]), on_read=on_read)
    for i, (a, b) in enumerate(zip(got["digests"], want["digests"])):
        if a != b:
            seg = int(want["segment_bytes"])
            lo, hi = i * seg, min((i + 1) * seg, int(want["size"]))
            raise CheckpointIntegrityError(
                f"{path}: bytes {lo}..{hi} do not match their {HASH} checksum in the manifest ({a} != {b}): "
                "the file is corrupted"
            )
    if len(got["digests"]) != len(want["digests"]):
        raise CheckpointIntegrityError(f"{path}: the manifest's checksum list does not fit the file's size")


def _manifest_digest(body: Dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_64(canonical).hexdigest()


def manifest_bytes(body: Dict[str, Any]) -> bytes:
    sealed = dict(body, manifest_digest=_manifest_digest(body))
    return (json.dumps(sealed, sort_keys=True, indent=1) + "\n").encode()


def read_manifest(path: str) -> Optional[Dict[str, Any]]:
    """The checkpoint's manifest, its own checksum verified; None when the checkpoint has none."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        sealed = json.loads(raw)
        body = {k: v for k, v in sealed.items() if k != "manifest_digest"}
        ok = isinstance(sealed, dict) and sealed.get("manifest_digest") == _manifest_digest(body)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointIntegrityError(f"{file}: corrupted (not the JSON its own checksum describes)")
    if body.get("hash") != HASH or not isinstance(body.get("files"), dict):
        raise CheckpointIntegrityError(f"{file}: unknown checksum {body.get('hash')!r} or no file list")
    return body
