"""Progress bars for long work: checkpoint loads and saves, swap files written at start-up, exports.

One policy for every bar (tqdm, as transformers shows its downloads): bytes with unit scaling and a rate in
GB/s (1e9 bytes per second), drawn on stderr, and only

* on rank 0 (`rank=` of `progress`), and
* when stderr is a terminal, unless `enable_progress_bars()` forces the bars on (for a log file or a
  notebook) or `disable_progress_bars()` / the environment variable `ZO_DISABLE_PROGRESS=1` turns them
  off. The environment variable wins over `enable_progress_bars()`: a job script can always silence them.

Bars never change what the work does: a disabled bar is tqdm's no-op (`disable=True`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from tqdm import tqdm

__all__ = [
    "DISABLE_ENV",
    "are_progress_bars_disabled",
    "disable_progress_bars",
    "enable_progress_bars",
    "progress",
]

DISABLE_ENV = "ZO_DISABLE_PROGRESS"
_FALSE = ("", "0", "false", "no", "off")
_forced: Optional[bool] = None  # None: decided by the terminal; True / False: set by the functions below


def enable_progress_bars() -> None:
    """Show progress bars even when stderr is not a terminal (unless `ZO_DISABLE_PROGRESS` is set)."""
    global _forced
    _forced = True


def disable_progress_bars() -> None:
    """Show no progress bars."""
    global _forced
    _forced = False


def are_progress_bars_disabled() -> bool:
    """Whether a bar started now would stay silent."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() not in _FALSE:
        return True
    if _forced is not None:
        return not _forced
    isatty = getattr(sys.stderr, "isatty", None)
    return not (isatty is not None and isatty())


def progress(desc: str, total: Optional[int], *, rank: int = 0, quiet: bool = False, unit: str = "B") -> Any:
    """A tqdm bar over `total` units (bytes by default: scaled, B/s rate in powers of 1000) named `desc`,
    on stderr; silent (tqdm's no-op) when `quiet`, off rank 0, or under the policy above. Use it as a
    context manager (or `close()` it) and call `update(n)` with the bytes just read or written."""
    quiet = quiet or rank != 0 or are_progress_bars_disabled()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1000,
        file=sys.stderr,
        disable=quiet,
        dynamic_ncols=True,
        leave=False,
    )
