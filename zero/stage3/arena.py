"""Arena: the memory-tier partitions of a store packed back to back into a few large segments."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

__all__ = ["SEGMENT_NUMEL", "Arena"]

SEGMENT_NUMEL = 1 << 22  # unpinned segments: untouched pages cost nothing, so over-reserving is free


class Arena:
    """Bump allocator over segments; one segment per call to `reserve`, or SEGMENT_NUMEL-sized ones."""

    def __init__(self, alloc: Callable[[int, torch.dtype], torch.Tensor], exact: bool, zeroed: bool) -> None:
        """`alloc(numel, dtype)` makes a segment; `exact`: never more than asked (pinned memory);
        `zeroed`: new segments read as zeros."""
        self._alloc = alloc
        self._exact = exact  # pinned memory is locked: never reserve more than asked
        # every segment is fresh anonymous memory (pinned): what nothing has written yet reads as zeros, and
        # memory is never handed out twice, so a unit placed without values needs no zeroing pass (for a
        # model of gigabytes that pass costs seconds of page faults before the values are copied in)
        self.zeroed = zeroed
        self.segments: List[torch.Tensor] = []
        self._open: Dict[torch.dtype, Tuple[int, int]] = {}  # dtype -> (segment index, used)

    def reserve(self, numel: int, dtype: torch.dtype) -> None:
        """Start a segment of exactly `numel` elements (call before taking a known total)."""
        self.segments.append(self._alloc(max(1, numel), dtype))
        self._open[dtype] = (len(self.segments) - 1, 0)

    def take(self, numel: int, dtype: torch.dtype) -> Tuple[int, int, torch.Tensor]:
        """(segment index, element offset, the view) of `numel` new elements of `dtype`."""
        seg, used = self._open.get(dtype, (-1, 0))
        if seg < 0 or used + numel > self.segments[seg].numel():
            self.reserve(numel if self._exact else max(numel, SEGMENT_NUMEL), dtype)
            seg, used = self._open[dtype]
        self._open[dtype] = (seg, used + numel)
        return seg, used, self.segments[seg][used : used + numel]
