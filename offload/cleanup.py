"""Cleanup at process exit, including the SIGTERM a scheduler sends on preemption.

`atexit` (and `weakref.finalize`, which registers with it) runs on a normal exit and on an uncaught
exception, but not when the process dies of a signal whose action is the default: a batch scheduler's
SIGTERM would leave every swap directory behind, full size. `register(fn)` adds `fn` to a process-wide list
that runs, last registered first, at normal exit and when SIGTERM (or SIGHUP) arrives while its action is
the default; the signal is then re-delivered with the default action, so the exit status still says
"killed by SIGTERM". Where the default action would not end the process (PID 1 of a container ignores
it), the process exits with status 128 + signal number instead of going on without its files.

Earlier handlers are respected, never replaced in their meaning:

* a signal that is ignored (SIG_IGN) stays ignored and nothing is removed;
* a Python handler installed before ours is called as it was; if it exits (SystemExit), atexit runs the
  cleanups; if it returns, the process goes on and nothing is removed (a "save a checkpoint on SIGTERM"
  handler still finds its swap space);
* a handler installed outside Python (by C code; `signal.getsignal` returns None) is left in place;
* a handler installed after ours replaces it; if it calls ours (chaining to "the previous handler"), ours
  does what the default action would: clean up and end the process;
* SIGINT keeps Python's KeyboardInterrupt, which reaches atexit like any exception.

Python runs signal handlers in the main thread, between bytecodes: a SIGTERM that lands while the main
thread is inside a long C call is handled when that call returns. Handlers can only be installed from the
main thread; elsewhere `register` still covers normal exit. A process killed before its handler ran
(SIGKILL, a crash) leaves its files to be reclaimed by a later run (see `offload.swap.space`).

A forked child inherits the list but runs only the callbacks its own process registered.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Any, Callable, Dict, Optional

__all__ = ["Registration", "register", "run_all"]

_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_lock = threading.RLock()  # reentrant: a signal handler may run while the main thread holds it
_callbacks: Dict[int, Registration] = {}
_next_id = 0
_previous: Dict[int, Any] = {}
_atexit_registered = False


class Registration:
    """One registered cleanup; `cancel()` removes it without running it, calling it runs it once."""

    def __init__(self, key: int, fn: Callable[[], None]) -> None:
        self._key = key
        self._fn: Optional[Callable[[], None]] = fn
        self.pid = os.getpid()

    @property
    def pending(self) -> bool:
        """True until the callback has run or been cancelled."""
        return self._fn is not None

    def cancel(self) -> None:
        """Unregister the callback: it will not run at exit; a second call does nothing."""
        with _lock:
            _callbacks.pop(self._key, None)
            self._fn = None

    def __call__(self) -> None:
        with _lock:
            fn, self._fn = self._fn, None
            _callbacks.pop(self._key, None)
        if fn is not None and self.pid == os.getpid():
            fn()


def register(fn: Callable[[], None]) -> Registration:
    """Run `fn` once at normal exit or on SIGTERM/SIGHUP with the default action; returns its handle."""
    global _next_id, _atexit_registered
    with _lock:
        _next_id += 1
        reg = Registration(_next_id, fn)
        _callbacks[_next_id] = reg
        if not _atexit_registered:
            atexit.register(run_all)
            _atexit_registered = True
        _install_handlers()
    return reg


def run_all() -> None:
    """Run every callback this process registered, newest first; errors are reported, not raised."""
    with _lock:
        regs = sorted(_callbacks.values(), key=lambda r: r._key, reverse=True)
    for reg in regs:
        try:
            reg()
        except Exception as e:  # a cleanup must not stop the others
            try:
                os.write(2, f"zero-offload: cleanup failed: {e!r}\n".encode(errors="replace"))
            except OSError:
                pass


def _install_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        current = signal.getsignal(sig)
        if current is _on_signal or current is None or current == signal.SIG_IGN:
            continue  # ours already, installed by C code (unknown meaning), or ignored on purpose
        _previous[sig] = current  # first: our handler may run as soon as it is installed
        try:
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main interpreter: normal exit is still covered
            return


def _on_signal(signum: int, frame: Any) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    if previous == signal.SIG_IGN:
        return
    if callable(previous) and previous != signal.SIG_DFL:
        previous(signum, frame)  # its decision stands: exit (atexit cleans up) or go on (keep everything)
        return
    run_all()
    signal.signal(signum, signal.SIG_DFL)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    except (AttributeError, OSError, ValueError):
        pass
    os.kill(os.getpid(), signum)  # ends the process here: the status says "killed by" the signal
    os._exit(128 + signum)  # the default action did not end it (PID 1 in a PID namespace)


def _after_fork_in_child() -> None:
    global _lock, _callbacks
    _lock = threading.RLock()  # another thread may have held it at the fork
    _callbacks = {k: r for k, r in _callbacks.items() if r.pid == os.getpid()}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
