"""A command's output piped into a reader that stops early (`ds-estimate-memory ... | head`): no traceback.

`quiet_broken_pipe(main)` wraps a console entry point: when stdout's reader has gone, the rest of the output
is discarded (stdout is pointed at /dev/null, so the interpreter's final flush cannot fail again) and the
command exits with status 1, as Python's documentation recommends for SIGPIPE; cleanup in `finally` blocks
runs as usual on the way out.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Optional, Sequence

__all__ = ["EXIT_BROKEN_PIPE", "quiet_broken_pipe"]

EXIT_BROKEN_PIPE = 1
Main = Callable[[Optional[Sequence[str]]], int]


def quiet_broken_pipe(main: Main) -> Main:
    """`main` returning EXIT_BROKEN_PIPE, silently, when stdout's reader closes the pipe."""

    @functools.wraps(main)
    def wrapped(argv: Optional[Sequence[str]] = None) -> int:
        try:
            code = main(argv)
            sys.stdout.flush()  # inside the try: a closed pipe shows up here for buffered output
            return code
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_BROKEN_PIPE

    return wrapped
