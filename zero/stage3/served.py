"""Partitions on NVMe read straight from the files that hold them: a swap file, or a checkpoint's own files.

The store reads a partition on NVMe through a `PartitionSource`: `read_into(handle, buf, offset,
asynchronous)` puts bytes [offset, offset + len(buf)) of the partition into `buf` with the aio handle.
`SwapSource` is one swap file (the partition's bytes from offset 0). `ServedPartition` is a partition whose
values lie, unconverted, in the tensors of a safetensors checkpoint (zero.from_pretrained serves them
directly): a list of `Extent`s, each a byte range of a checkpoint file held open by descriptor
(`CheckpointFds`), and zeros everywhere else (the padding after a parameter's share on the last ranks, a
parameter the checkpoint does not hold). On several ranks each parameter's share is its own extent. A
served partition is read-only: nothing is ever written into a checkpoint file.

Alignment: a checkpoint's tensors lie at offsets that are not multiples of the 4 KiB O_DIRECT needs (the
data starts after the JSON header), and the I/O core copies every piece of a request whose file offset and
memory address are not both aligned through a bounce buffer. `lead(offset)` says where in a 4 KiB-aligned
buffer a read from partition offset `offset` should start so that file and memory agree modulo 4 KiB (for
the extents holding most of the bytes; tensors whose sizes are multiples of 4 KiB, as a transformer's
matrices are, all agree); the store lands served reads there. Each extent a range touches is then read as
its unaligned head and tail (under 4 KiB each, bounced) and its aligned middle (straight into `buf`); an
extent that does not agree is one request, bounced throughout. Either way what lands in `buf` is the
file's bytes, bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Protocol, Sequence

import torch

from offload.swap.space import SwapFile

__all__ = ["ALIGN", "CheckpointFds", "Extent", "PartitionSource", "ServedPartition", "SwapSource"]

ALIGN = 4096  # O_DIRECT's alignment on every common device (a multiple of any smaller one)


class PartitionSource(Protocol):
    """Where the store reads a partition on NVMe from."""

    @property
    def path(self) -> str:
        """The file's name for error messages."""
        ...

    def read_into(self, handle: Any, buf: torch.Tensor, offset: int, asynchronous: bool = False) -> None:
        """Read bytes [offset, offset + buf.numel()) of the partition into the uint8 tensor `buf`; an
        asynchronous read is complete once `handle.wait()` returns."""
        ...

    def lead(self, offset: int) -> int:
        """Where (modulo ALIGN, 0 <= lead < ALIGN) a buffer should start in ALIGN-aligned memory for a read
        from `offset` to go straight to the device; a multiple of 8 (any dtype's view fits)."""
        ...


class SwapSource:
    """A partition stored in its own swap file, from offset 0 (opened relative to its directory fd)."""

    __slots__ = ("file",)

    def __init__(self, file: SwapFile) -> None:
        self.file = file

    @property
    def path(self) -> str:
        """The swap file's path (for messages)."""
        return self.file.path

    def read_into(self, handle: Any, buf: torch.Tensor, offset: int, asynchronous: bool = False) -> None:
        """One request for the whole range (see PartitionSource)."""
        (handle.async_pread if asynchronous else handle.sync_pread)(buf, self.file, offset)

    def lead(self, offset: int) -> int:
        """0: a swap file holds the partition from offset 0 (see PartitionSource)."""
        return 0


class CheckpointFds:
    """The descriptors of a checkpoint's files, opened once by the loader (relative to the checkpoint
    directory's descriptor, O_NOFOLLOW) and kept until `close`: every served read uses them, so the file
    whose header was checked is the file read, whatever its path names later."""

    def __init__(self) -> None:
        self._fds: Dict[str, int] = {}

    def add(self, path: str, fd: int) -> None:
        """Keep `fd` (an open, read-only descriptor of `path`); closed by `close`."""
        if path in self._fds:
            raise ValueError(f"{path}: already held")
        self._fds[path] = fd

    def fd(self, path: str) -> int:
        """The held descriptor of `path`."""
        return self._fds[path]

    def __contains__(self, path: object) -> bool:
        return path in self._fds

    @property
    def paths(self) -> List[str]:
        """The files held, in the order they were added."""
        return list(self._fds)

    def for_direct_io(self) -> CheckpointFds:
        """New descriptors of the same files (reopened through /proc/self/fd, so the very files held, never a
        path), with O_DIRECT where the filesystem takes it (else buffered): the store's, closed with it."""
        out = CheckpointFds()
        try:
            for path, fd in self._fds.items():
                flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
                try:
                    new = os.open(f"/proc/self/fd/{fd}", flags | getattr(os, "O_DIRECT", 0))
                except OSError:  # EINVAL: no O_DIRECT here (tmpfs); no /proc: the same open file
                    new = os.dup(fd)
                out.add(path, new)
        except BaseException:
            out.close()
            raise
        return out

    def close(self) -> None:
        """Close every descriptor (idempotent)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


@dataclass(frozen=True)
class Extent:
    """Bytes [part_offset, part_offset + nbytes) of a partition are bytes [file_offset, file_offset + nbytes)
    of the checkpoint file open as `fd` (`path`), the tensor `tensor`'s data."""

    part_offset: int
    fd: int
    file_offset: int
    nbytes: int
    path: str
    tensor: str


class ServedPartition:
    """A unit's partition of `nbytes` bytes served from checkpoint files: `extents` (sorted, disjoint) hold
    its bytes, the rest of it reads as zeros."""

    def __init__(self, name: str, extents: Sequence[Extent], nbytes: int) -> None:
        """`name`: the unit's (for messages)."""
        ext = sorted(extents, key=lambda e: e.part_offset)
        end = 0
        for e in ext:
            if e.part_offset < end or e.nbytes <= 0 or e.part_offset + e.nbytes > nbytes:
                raise ValueError(f"partition of {name!r}: {e} overlaps another or passes {nbytes} bytes")
            end = e.part_offset + e.nbytes
        self.name = name
        self.extents = ext
        self.nbytes = int(nbytes)
        # file offset - partition offset (mod ALIGN) of the most bytes: reads land where that agrees
        shares: Dict[int, int] = {}
        for e in ext:
            k = (e.file_offset - e.part_offset) % ALIGN
            shares[k] = shares.get(k, 0) + e.nbytes
        shift = max(shares, key=lambda k: shares[k], default=0)
        self._shift = shift if shift % 8 == 0 else 0

    @property
    def path(self) -> str:
        """The first checkpoint file it is read from (for messages)."""
        return self.extents[0].path if self.extents else ""

    @property
    def served_bytes(self) -> int:
        """Bytes of the partition that come from checkpoint files (the rest are zeros)."""
        return sum(e.nbytes for e in self.extents)

    def lead(self, offset: int) -> int:
        """Where a buffer for bytes from `offset` on should start modulo ALIGN (see PartitionSource)."""
        return (offset + self._shift) % ALIGN

    def read_into(self, handle: Any, buf: torch.Tensor, offset: int, asynchronous: bool = False) -> None:
        """Per extent the range touches: its aligned middle in one request when file offset and address
        agree modulo ALIGN, with its unaligned head and tail as requests of their own, else one request;
        the gaps are zeroed now (see PartitionSource)."""
        end = offset + buf.numel()
        at = offset  # bytes of the range before `at` are placed (read or zeroed)
        read = handle.async_pread if asynchronous else handle.sync_pread
        base = buf.data_ptr() - offset  # the address partition byte 0 would have
        for e in self.extents:
            lo, hi = max(offset, e.part_offset), min(end, e.part_offset + e.nbytes)
            if lo >= hi:
                continue
            if lo > at:
                buf[at - offset : lo - offset].zero_()
            f = e.file_offset + (lo - e.part_offset)  # the file offset of partition byte lo
            cuts = [lo, hi]
            if (base + lo) % ALIGN == f % ALIGN:
                a = lo + (-f) % ALIGN  # first aligned byte, last aligned end
                z = hi - (f + hi - lo) % ALIGN
                if a < z:
                    cuts = sorted({lo, a, z, hi})
            for x, y in zip(cuts, cuts[1:]):
                read(buf[x - offset : y - offset], e.fd, f + (x - lo))
            at = hi
        if at < end:
            buf[at - offset :].zero_()

    def __repr__(self) -> str:
        files = len({e.path for e in self.extents})
        served = f"{self.served_bytes} of {self.nbytes} bytes"
        return f"ServedPartition({self.name!r}, {served} from {files} file(s))"
