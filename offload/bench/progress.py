"""A plain-text progress bar on stderr: redrawn in place on a terminal, a line per 10 % otherwise (logs)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per tenth of the work otherwise."""

    def __init__(self, total: int, title: str, stream: Optional[TextIO] = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._last_len = 0

    def step(self, text: str = "") -> None:
        """Count one more step and redraw the bar with `text` and the remaining time."""
        self.done = min(self.total, self.done + 1)
        fraction = self.done / self.total
        filled = int(round(fraction * self.width))
        elapsed = time.monotonic() - self.start
        eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
        line = (
            f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{elapsed:4.0f}s eta {eta:3.0f}s  {text}"
        )
        if self._tty:
            pad = max(0, self._last_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
            if self.done == self.total:
                self.stream.write("\n")
        else:
            decile = int(fraction * 10)
            if decile == self._last_decile and self.done != self.total:
                return
            self._last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()
