"""Files of a checkpoint: private creation, durable writes, checksums and the manifest.

Checksums are xxh3_64 (the `xxhash` package): 25.7 GiB/s on one core of the CI machine (1 GiB buffer,
median of 3), so hashing stays far below the disk's time both while saving (computed on the bytes as they
are written) and while verifying on load (zlib.crc32 managed 3.9 GiB/s there, slower than a fast NVMe drive
reads). A file's digest is a list, one per
segment of `segment_bytes` bytes: the optimizer file is written region by region (master, then each
state), and hashing each region as it streams out needs no second pass over the file.

The checksums catch corruption, not tampering: anyone who can edit the files can reseal the manifest. So
nothing read from a checkpoint is trusted either: every manifest field is checked (types, ranges, sizes
against the files), only regular files inside the checkpoint's directory are opened (relative to its
descriptor, without following symlinks, never blocking on a FIFO), and every read is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
from typing import IO, Any, Callable, Dict, List, Optional

import torch
import xxhash

from zero.checkpoint._dir import OpenDir
from zero.errors import CheckpointIntegrityError

# Test hook: SIGKILL this process when the save reaches the named point (see crash_point calls).
CRASH_ENV = "ZERO_OFFLOAD_TEST_CRASH_AT"
FORMAT_VERSION = 2
# How a stage-3 checkpoint's partition files (optim_rank<r>.bin, param_rank<r>.bin) split each unit over the
# ranks (zero.stage3.unit), the manifest's and model_states.pt's `stage3_layout`: 1 (checkpoints without
# the key), a unit's parameters back to back split evenly into one share per rank; 2, each parameter split
# on its own (DeepSpeed's per-parameter partitions), a rank's chunks back to back. One rank: the same bytes.
STAGE3_LAYOUT = 2
STAGE3_LAYOUTS = {1: "a unit's parameters split together", 2: "each parameter split on its own"}
HASH = "xxh3_64"
MANIFEST = "manifest.json"
PICKLED = "pickled_states.pt"  # only objects that need pickle (see save.py); loaded only with allow_pickle
MANIFEST_MAX_BYTES = 16 << 20  # a manifest lists a few files per rank: far below this for any world size
_READ_BYTES = 16 << 20
_MAX_SIZE = 1 << 62  # bytes: larger than any file, small enough for every offset computed from it
_MAX_WORLD = 1 << 20
_DIGEST = re.compile(r"[0-9a-f]{16}")

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


def create_private(path: str, dir_fd: Optional[int] = None, read: bool = False) -> int:
    """Create `path` (relative to `dir_fd` when given; it must not exist, and a symlink in its place is not
    followed) with mode 0600; returns a descriptor open for writing (and reading with `read`)."""
    flags = (os.O_RDWR if read else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


class StreamDigest:
    """Digests of a byte stream, one per `segment` bytes (0: the whole stream is one segment)."""

    def __init__(self, segment: int = 0) -> None:
        if isinstance(segment, bool) or not isinstance(segment, int) or segment < 0:
            raise ValueError(f"segment must be an int >= 0, got {segment!r}")
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


def save_object(obj: Any, name: str, dir_fd: int) -> Entry:
    """torch.save `obj` into a new private file `name` in directory `dir_fd`, fsynced; its manifest entry."""
    digest = StreamDigest()
    with os.fdopen(create_private(name, dir_fd), "wb") as f:
        torch.save(obj, _HashingWriter(f, digest))
        f.flush()
        os.fsync(f.fileno())
    return digest.entry()


def write_bytes(name: str, data: bytes, dir_fd: int) -> Entry:
    digest = StreamDigest()
    digest.update(data)
    with os.fdopen(create_private(name, dir_fd), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.entry()


def digest_fd(
    fd: int, segment: int, size: int, what: str, on_read: Optional[Callable[[int], None]] = None
) -> Entry:
    """Digest the first `size` bytes of `fd` (from offset 0) in segments of `segment` bytes, `on_read(n)`
    after each read (a progress bar); raises CheckpointIntegrityError naming `what` if the file ends
    before."""
    digest = StreamDigest(segment)
    buf = bytearray(min(_READ_BYTES, max(size, 1)))
    view = memoryview(buf)
    pos = 0
    while pos < size:
        n = os.preadv(fd, [view[: min(len(view), size - pos)]], pos)
        if not n:
            raise CheckpointIntegrityError(f"{what}: ended at byte {pos}, the manifest records {size}")
        digest.update(view[:n])
        pos += n
        if on_read is not None:
            on_read(n)
    return digest.entry()


def verify_size(d: OpenDir, name: str, want: Entry) -> int:
    """Open `name` in checkpoint directory `d` (a regular file, see OpenDir.open) and check its size against
    the manifest's; returns the descriptor (the caller closes it)."""
    try:
        fd = d.open(name)
    except FileNotFoundError:
        raise CheckpointIntegrityError(
            f"{d.name(name)}: missing, but listed in the checkpoint's manifest"
        ) from None
    size = os.fstat(fd).st_size
    if size != want["size"]:
        os.close(fd)
        raise CheckpointIntegrityError(
            f"{d.name(name)}: {size} bytes, the manifest records {want['size']}: the file was truncated or "
            "replaced"
        )
    return fd


def verify_file(d: OpenDir, name: str, want: Entry, on_read: Optional[Callable[[int], None]] = None) -> int:
    """Open `name` in `d` and raise CheckpointIntegrityError naming it unless its size and digests are those
    of `want` (a checked manifest entry); returns the verified file's descriptor (the caller closes it)."""
    fd = verify_size(d, name, want)
    try:
        seg, size = want["segment_bytes"], want["size"]
        got = digest_fd(fd, seg, size, d.name(name), on_read)
        for i, (a, b) in enumerate(zip(got["digests"], want["digests"])):
            if a != b:
                lo, hi = i * seg, min((i + 1) * seg, size)
                raise CheckpointIntegrityError(
                    f"{d.name(name)}: bytes {lo}..{hi} do not match their {HASH} checksum in the manifest "
                    f"({a} != {b}): the file is corrupted"
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _manifest_digest(body: Dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_64(canonical).hexdigest()


def manifest_bytes(body: Dict[str, Any]) -> bytes:
    sealed = dict(body, manifest_digest=_manifest_digest(body))
    return (json.dumps(sealed, sort_keys=True, indent=1) + "\n").encode()


def _int_in(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def plain_name(name: Any) -> bool:
    """A file name of one path component, not hidden, printable (what a checkpoint's files are called)."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode("utf-8", "surrogatepass")) <= 255
        and "/" not in name
        and not name.startswith(".")
        and name.isprintable()
    )


def _check_entry(entry: Any) -> Optional[str]:
    """What is wrong with a manifest's file entry, or None."""
    if not isinstance(entry, dict) or set(entry) != {"size", "segment_bytes", "digests"}:
        return "not a {size, segment_bytes, digests} entry"
    size, seg, digests = entry["size"], entry["segment_bytes"], entry["digests"]
    if not _int_in(size, 0, _MAX_SIZE):
        return "size is not an int in [0, 2^62]"
    if not _int_in(seg, 1 if size else 0, _MAX_SIZE):
        return "segment_bytes is not an int in [1, 2^62]"
    want = max(1, -(-size // seg)) if seg else 1
    if not isinstance(digests, list) or len(digests) != want:
        return f"{want} checksum(s) expected for its size and segment_bytes"
    if not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in digests):
        return f"a checksum is not 16 hex digits ({HASH})"
    return None


def check_manifest(sealed: Any, file: str) -> Dict[str, Any]:
    """The manifest's body, every field checked; raises CheckpointIntegrityError naming the field."""
    if not isinstance(sealed, dict):
        raise CheckpointIntegrityError(f"{file}: corrupted (not a JSON object)")
    body = {k: v for k, v in sealed.items() if k != "manifest_digest"}
    if sealed.get("manifest_digest") != _manifest_digest(body):
        raise CheckpointIntegrityError(f"{file}: corrupted (not the JSON its own checksum describes)")
    if body.get("hash") != HASH:
        raise CheckpointIntegrityError(f"{file}: 'hash' is not {HASH!r}")
    if not _int_in(body.get("format_version"), 0, 1 << 31):
        raise CheckpointIntegrityError(f"{file}: 'format_version' is not an int")
    if body["format_version"] != FORMAT_VERSION:
        return body  # another format: the caller says which; its other fields may mean something else
    if not _int_in(body.get("world_size"), 1, _MAX_WORLD):
        raise CheckpointIntegrityError(f"{file}: 'world_size' is not an int in [1, {_MAX_WORLD}]")
    if not _int_in(body.get("stage"), 0, 3):
        raise CheckpointIntegrityError(f"{file}: 'stage' is not 0, 1, 2 or 3")
    if body.get("stage3_layout", 1) not in STAGE3_LAYOUTS:
        raise CheckpointIntegrityError(f"{file}: 'stage3_layout' is not one of {sorted(STAGE3_LAYOUTS)}")
    files = body.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointIntegrityError(f"{file}: 'files' is not a list of files")
    for name, entry in files.items():
        if not plain_name(name):
            raise CheckpointIntegrityError(f"{file}: 'files' names a file that is not a plain name")
        problem = _check_entry(entry)
        if problem:
            raise CheckpointIntegrityError(f"{file}: 'files' entry {name}: {problem}")
    return body


def read_manifest(d: OpenDir) -> Optional[Dict[str, Any]]:
    """The manifest of checkpoint directory `d`, its own checksum and every field checked; None when the
    checkpoint has none."""
    raw = d.read_small(MANIFEST, MANIFEST_MAX_BYTES)
    if raw is None:
        return None
    try:
        sealed = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointIntegrityError(f"{d.name(MANIFEST)}: corrupted (not JSON)") from None
    return check_manifest(sealed, d.name(MANIFEST))
