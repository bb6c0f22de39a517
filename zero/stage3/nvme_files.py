"""NvmeFiles: the files a store's NVMe partitions live in, and where each partition is read from.

A partition on NVMe is either a swap file of its own - in the store's private SwapSpace under
`offload_param.nvme_path`, created on first use, or in a space given with `use_swap_space` (a swap cache)
- named after the module that owns it, or, once `serve_from` is set, checkpoint files it is served from
unconverted (zero.stage3.served). `source(unit)` is what reads go through either way; `writable(unit)` is
the swap file a write goes to, refused for a served partition and for a read-only space.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, Dict, Optional

from offload.swap.space import SwapFile, SwapSpace, SwapSpaceError
from zero.stage3.served import CheckpointFds, PartitionSource, ServedPartition, SwapSource
from zero.stage3.unit import Unit, safe_file_name

__all__ = ["NvmeFiles"]


class NvmeFiles:
    """The swap files and served partitions of one store's units on NVMe (by unit index)."""

    def __init__(self, nvme_path: Optional[str], rank: int) -> None:
        """`nvme_path`: the checked directory private swap spaces are made in (None: no NVMe tier)."""
        self._nvme_path = nvme_path
        self._rank = rank
        self._space: Optional[Any] = None  # SwapSpace, or anything with its interface (a SwapCache)
        self._files: Dict[int, SwapFile] = {}
        self._file_names: Dict[str, int] = {}
        self._sources: Dict[int, PartitionSource] = {}
        self._serve: Optional[Callable[[Unit], Optional[ServedPartition]]] = None
        self._checkpoint: Optional[CheckpointFds] = None
        self.served_bytes = 0  # bytes of the served partitions that come from checkpoint files

    def use_swap_space(self, space: Any) -> None:
        """Create the swap files from now on in `space` (SwapSpace's `create`, `close`, `dir`,
        `bytes_allocated`, `read_only`) instead of a private SwapSpace; closed with these files."""
        if self._space is not None:
            raise RuntimeError("the store already has a swap space: set it before placing any unit")
        self._space = space

    def serve_from(
        self, checkpoint: CheckpointFds, serve: Callable[[Unit], Optional[ServedPartition]]
    ) -> None:
        """Ask `serve(unit)` first for every unit added from now on with `may_serve`; `checkpoint`'s
        descriptors are closed with these files."""
        if self._checkpoint is not None:
            raise RuntimeError("the store already serves partitions from a checkpoint")
        self._checkpoint, self._serve = checkpoint, serve

    def add(self, unit: Unit, nbytes: int, may_serve: bool) -> None:
        """Give the unit its place on NVMe: served from the checkpoint when `may_serve` and `serve_from`'s
        callback gives its extents, else a new swap file of `nbytes` bytes."""
        served = self._serve(unit) if self._serve is not None and may_serve else None
        if served is not None:
            self._sources[unit.index] = served
            self.served_bytes += served.served_bytes
            return
        if self._space is None:
            assert self._nvme_path is not None
            self._space = SwapSpace(self._nvme_path, prefix=f"zero-stage3-r{self._rank}-")
        base = safe_file_name(unit.name)
        k = self._file_names.get(base, 0)
        self._file_names[base] = k + 1
        name = f"{base}.param.swp" if k == 0 else f"{base}.{k}.param.swp"
        f = self._space.create(name, nbytes)
        self._files[unit.index] = f
        self._sources[unit.index] = SwapSource(f)

    def source(self, unit: Unit) -> Optional[PartitionSource]:
        """Where the unit's partition is read from (None: not on NVMe)."""
        return self._sources.get(unit.index)

    def holds(self, unit: Unit) -> bool:
        """Whether the unit's partition is on NVMe (a swap file or served)."""
        return unit.index in self._sources

    def served(self, unit: Unit) -> bool:
        """Whether the unit's partition is served from checkpoint files."""
        return unit.index in self._sources and unit.index not in self._files

    def swap_file(self, unit: Unit) -> Optional[SwapFile]:
        """The unit's swap file (None: in memory, or served)."""
        return self._files.get(unit.index)

    def writable(self, unit: Unit) -> SwapFile:
        """The swap file a write of the unit's partition goes to; OSError EROFS naming the file for a
        served partition or a read-only space, KeyError when the unit is not on NVMe."""
        src = self._sources.get(unit.index)
        if src is not None and self.served(unit):
            raise SwapSpaceError(
                errno.EROFS,
                f"the partition of {unit.name!r} is served read-only from the checkpoint: not written "
                "(load with serve_checkpoint=False to have writable copies)",
                src.path,
            )
        f = self._files.get(unit.index)
        if f is None:
            raise KeyError(f"unit {unit.name!r} has no partition in this store")
        if self._space is not None and self._space.read_only:
            raise SwapSpaceError(
                errno.EROFS,
                f"the partition of {unit.name!r} is in a read-only swap cache: not written",
                f.path,
            )
        return f

    @property
    def dir(self) -> Optional[str]:
        """The directory of the swap files (None until the first one exists)."""
        return self._space.dir if self._space is not None else None

    @property
    def bytes_allocated(self) -> int:
        """Bytes allocated to the swap files."""
        return self._space.bytes_allocated if self._space is not None else 0

    def close(self) -> None:
        """Close the swap space (removing private swap files) and the checkpoint's descriptors."""
        if self._space is not None:
            self._space.close()
            self._space = None
        if self._checkpoint is not None:
            self._checkpoint.close()
            self._checkpoint = self._serve = None
