"""A known data pattern for the benchmark file, and sampled checks that reads really returned it.

Every 4 KiB page carries a header (seed, page index) followed by seeded random bytes, so a page read
from the wrong place, a read that never landed, or stale buffer contents all fail the check. Pages of
the buffer are checked, not of the file: when the file is larger than the buffer, every chunk of the
file holds the same buffer image, so concurrent chunk reads into one buffer still leave a known result.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .errors import VerificationError

PAGE = 4096
_BASE_PAGES = 256  # 1 MiB of random bytes, repeated; the header makes each page unique
_POISON = 0xA5


class Pattern:
    """A reproducible pseudo-random data pattern, page by page, so reads can be verified without keeping
    the written data."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = np.random.default_rng(seed)
        self._base = rng.integers(0, 256, size=(_BASE_PAGES, PAGE), dtype=np.uint8)
        self._rng = np.random.default_rng(seed + 1)

    def expected_page(self, index: int) -> np.ndarray:
        """The bytes page `index` must hold."""
        page = self._base[index % _BASE_PAGES].copy()
        page[:16].view(np.uint64)[:] = (self.seed, index)
        return page

    def fill(self, buf: np.ndarray) -> None:
        """Fill `buf` (whole pages) with the pattern, each page stamped with the seed and its index."""
        pages = _pages(buf)
        for start in range(0, len(pages), _BASE_PAGES):
            chunk = pages[start : start + _BASE_PAGES]
            chunk[:] = self._base[: len(chunk)]
        headers = pages.view(np.uint64)
        headers[:, 0] = self.seed
        headers[:, 1] = np.arange(len(pages), dtype=np.uint64)

    def sample(self, npages: int, count: int = 64) -> np.ndarray:
        """Random page indices, always with the first and the last page (where off-by-one errors live)."""
        picks = self._rng.integers(0, npages, size=min(count, npages))
        return np.unique(np.concatenate([picks, [0, npages - 1]]))

    def poison(self, buf: np.ndarray, indices: Sequence[int]) -> None:
        """Overwrite the pages at `indices` with a poison value (a read must replace them)."""
        _pages(buf)[np.asarray(indices)] = _POISON

    def verify(self, buf: np.ndarray, indices: Sequence[int], what: str) -> None:
        """VerificationError naming `what` unless the pages at `indices` hold the pattern."""
        pages = _pages(buf)
        for i in indices:
            self.verify_page(pages[int(i)], int(i), what)

    def verify_page(self, data: np.ndarray, index: int, what: str, file_offset: Optional[int] = None) -> None:
        """VerificationError (naming `what`, the page, its first wrong byte) unless `data` is page `index`."""
        expected = self.expected_page(index)
        if data.shape == expected.shape and np.array_equal(data, expected):
            return
        where = f"file offset {file_offset}" if file_offset is not None else f"buffer offset {index * PAGE}"
        if data.shape != expected.shape:
            detail = f"got {data.size} bytes instead of {PAGE}"
        else:
            first = int(np.flatnonzero(data != expected)[0])
            detail = f"first wrong byte at +{first}: {int(data[first]):#04x} != {int(expected[first]):#04x}"
        raise VerificationError(f"{what}: data mismatch in page {index} ({where}): {detail}")


def _pages(buf: np.ndarray) -> np.ndarray:
    if buf.size % PAGE:
        raise ValueError(f"pattern buffer of {buf.size} bytes is not a whole number of {PAGE}-byte pages")
    return buf.reshape(-1, PAGE)
