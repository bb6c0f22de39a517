"""The safetensors files of a Hugging Face checkpoint directory: which they are, their headers, their fds.

`weight_files` finds them (model.safetensors, or the shards model.safetensors.index.json names). `open_files`
opens each once, relative to a descriptor of the checkpoint directory (O_NOFOLLOW; a Hub snapshot's
one-level symlink into its blobs is followed by reading the link and opening its target, again with
O_NOFOLLOW), and keeps the descriptors (`CheckpointFds`): every later read of the load - the headers, the
tensors copied, the partitions served straight from the files (zero.inference.serving) - goes through them,
so the file checked is the file read. `scan_headers` reads each header from its descriptor (the format
safetensors documents: an 8-byte little-endian length, then a JSON object of name -> dtype, shape and
data_offsets relative to the end of the header) and checks every tensor's byte range against its dtype
and shape and against the file's size before any tensor data is read; safetensors itself then validates
the file. Errors name the file, the tensor and the sizes.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from zero.stage3.served import CheckpointFds

__all__ = [
    "INDEX_FILE",
    "ITEMSIZE",
    "MAX_HEADER_BYTES",
    "SINGLE_FILE",
    "CheckpointTensor",
    "PretrainedCheckpointError",
    "listed",
    "open_files",
    "proc_path",
    "scan_headers",
    "weight_files",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHOWN = 10  # names listed in an error or warning before "and N more"
# bytes per element of safetensors' dtype names
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# The largest safetensors header read (the JSON between the 8-byte length and the tensor data). safetensors
# itself accepts up to 100 MB, and parsing one that size takes some 1.8 GB; real checkpoints' headers are
# about 150 bytes a tensor, so this allows some 100,000 tensors in one file.
MAX_HEADER_BYTES = 16 << 20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class PretrainedCheckpointError(ValueError):
    """The checkpoint's files or tensors do not fit the model: a shard that is not complete safetensors, a
    tensor whose shape or dtype differs from its parameter's, parameters without a tensor, an index that
    disagrees with its shards. The message names the file, the tensor and the sizes."""


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a checkpoint file, from its header: its data is bytes [offset, offset + nbytes) of
    `file` (offsets from the start of the file)."""

    file: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I64, ...
    offset: int
    nbytes: int


def listed(names: List[str]) -> str:
    """The first SHOWN names, quoted, and how many more there are."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(repr(n) for n in names[:SHOWN]) + more


def weight_files(root: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files of the checkpoint and, when sharded, the index's tensor -> file map."""
    index = os.path.join(root, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise PretrainedCheckpointError(f"{index}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not weight_map:
            raise PretrainedCheckpointError(f"{index}: no 'weight_map' of tensor names to shard files")
        files: List[str] = []
        for key, name in weight_map.items():
            path = os.path.join(root, str(name))
            if os.path.basename(str(name)) != name:
                raise PretrainedCheckpointError(f"{index}: shard {name!r} (of {key!r}) is not a file name")
            if path not in files:
                if not os.path.isfile(path):
                    raise FileNotFoundError(
                        errno.ENOENT,
                        f"{index} names the shard {name!r} (holding {key!r}), which is missing from {root}",
                        path,
                    )
                files.append(path)
        return files, {k: os.path.join(root, str(v)) for k, v in weight_map.items()}
    single = os.path.join(root, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], None
    others = sorted(f for f in os.listdir(root) if f.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
    hint = (
        f"; found {listed(others)}: only safetensors checkpoints are read (save them with "
        "save_pretrained(..., safe_serialization=True))"
        if others
        else ""
    )
    raise FileNotFoundError(errno.ENOENT, f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}", root)


def proc_path(held: CheckpointFds, file: str) -> str:
    """A path naming the file held open as `file` itself (/proc/self/fd/N: the open file, not whatever its
    path names now), for libraries that take a path (safetensors' safe_open)."""
    return f"/proc/self/fd/{held.fd(file)}"


def _open_in(root_fd: int, root: str, name: str) -> int:
    """A read-only descriptor of the regular file `name` of the directory open as `root_fd`. Opened
    non-blocking, so that a FIFO put in the file's place is refused rather than waited on."""
    path = os.path.join(root, name)
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=root_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise OSError(e.errno, f"cannot open the checkpoint file: {e.strerror}", path) from e
        # a Hub snapshot: the file is a symlink into the repository's blobs; open its target, not the link
        target = os.readlink(name, dir_fd=root_fd)
        try:
            fd = os.open(target, flags, dir_fd=root_fd)
        except OSError as e2:
            raise OSError(
                e2.errno, f"cannot open the checkpoint file (a link to {target!r}): {e2.strerror}", path
            ) from e2
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PretrainedCheckpointError(f"{path}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_files(root: str, files: List[str], held: CheckpointFds) -> None:
    """Open every file of `files` (paths in `root`) once, relative to a descriptor of `root`, into `held`."""
    root_fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for file in files:
            if file not in held:
                held.add(file, _open_in(root_fd, root, os.path.basename(file)))
    finally:
        os.close(root_fd)


def _size_note(fd: int) -> str:
    """What the file's own header says its size should be, against its size on disk."""
    size = os.fstat(fd).st_size
    try:
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if n > min(size, MAX_HEADER_BYTES):
            return f"its header claims {n} bytes of metadata, the file has {size} bytes"
        header = json.loads(os.pread(fd, n, 8))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return f"its header describes {8 + n + end} bytes, the file has {size} bytes"
    except Exception:
        return f"{size} bytes on disk"


def _header(file: str, fd: int) -> Tuple[int, Dict[str, Any]]:
    """(bytes before the tensor data, the header's JSON object), from the descriptor; refuses a header
    longer than MAX_HEADER_BYTES or than the file, having read only its first 8 bytes."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or n > size - 8:
        raise PretrainedCheckpointError(f"{file}: not a complete safetensors file ({_size_note(fd)})")
    if n > MAX_HEADER_BYTES:
        raise PretrainedCheckpointError(
            f"{file}: its safetensors header is {n} bytes; zero.from_pretrained reads headers of at most "
            f"{MAX_HEADER_BYTES} bytes (some 100,000 tensors: parsing a header takes about 20 times its "
            "size in memory). Save the checkpoint in shards (save_pretrained's max_shard_size)"
        )
    try:
        header = json.loads(os.pread(fd, n, 8))
    except ValueError as e:
        raise PretrainedCheckpointError(f"{file}: its safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise PretrainedCheckpointError(f"{file}: its safetensors header is not a JSON object")
    return 8 + n, header


def _tensor(file: str, key: str, entry: Any, base: int, size: int, fd: int) -> CheckpointTensor:
    """The header's entry for `key`, checked: dtype, shape, and a byte range that fits them and the file."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        ok = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
        ok = ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise PretrainedCheckpointError(f"{file}: tensor {key!r} has a malformed header entry {entry!r}")
    item = ITEMSIZE.get(dtype)
    if item is not None and end - begin != math.prod(shape) * item:
        raise PretrainedCheckpointError(
            f"{file}: tensor {key!r} is {dtype} {list(shape)} ({math.prod(shape) * item} bytes) but its "
            f"data_offsets [{begin}, {end}) hold {end - begin} bytes: corrupt header"
        )
    if base + end > size:
        raise PretrainedCheckpointError(
            f"{file}: not a complete safetensors file ({_size_note(fd)}; tensor {key!r} ends at byte "
            f"{base + end}; truncated or corrupt?)"
        )
    return CheckpointTensor(file, shape, dtype, base + begin, end - begin)


def scan_headers(
    files: List[str], index_map: Optional[Dict[str, str]], held: CheckpointFds
) -> Dict[str, CheckpointTensor]:
    """Name -> file, shape, dtype and byte range of every tensor, from the headers only (no tensor data is
    read), each checked against the file's size; safetensors then validates each file."""
    from safetensors import safe_open

    tensors: Dict[str, CheckpointTensor] = {}
    for file in files:
        fd = held.fd(file)
        base, header = _header(file, fd)
        size = os.fstat(fd).st_size
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if key in tensors:
                raise PretrainedCheckpointError(f"tensor {key!r} is in both {tensors[key].file} and {file}")
            tensors[key] = _tensor(file, key, entry, base, size, fd)
        try:
            with safe_open(proc_path(held, file), framework="pt") as f:
                keys = set(f.keys())
        except Exception as e:
            raise PretrainedCheckpointError(
                f"{file}: not a complete safetensors file ({_size_note(fd)}; truncated or corrupt?): {e}"
            ) from e
        if keys != {k for k, t in tensors.items() if t.file == file}:
            raise PretrainedCheckpointError(f"{file}: safetensors reads other tensors than its header lists")
    for key, file in (index_map or {}).items():
        if key not in tensors or tensors[key].file != file:
            raise PretrainedCheckpointError(
                f"{os.path.join(os.path.dirname(file), INDEX_FILE)} maps {key!r} to {file}, which does not "
                "hold it: the index and its shards do not belong together"
            )
    return tensors
