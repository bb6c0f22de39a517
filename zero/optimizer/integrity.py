"""StateGuard: whether the engine's training state can still be trusted, and the error that says why not.

An I/O error while master or optimizer states were updated in place, a failed restore of the committed
weights, or a checkpoint load that stopped part way can leave master, states and parameters inconsistent.
The guard keeps the first such failure; `check()` then raises `StateCorruptedError` (chained to it) from
every step, backward and checkpoint save until a checkpoint is loaded completely (`clear()`).
"""

from __future__ import annotations

from typing import Optional

from zero.errors import StateCorruptedError

__all__ = ["StateGuard", "describe_error"]


def describe_error(err: BaseException) -> str:
    """An error as its type and text; for an OSError also errno and path when the text lacks them."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, OSError):
        if err.errno is not None and f"Errno {err.errno}" not in text:
            text += f" [errno {err.errno}]"
        if err.filename and str(err.filename) not in text:
            text += f" ({err.filename})"
    return text


class StateGuard:
    """The first failure that made the training state unusable (None while it is usable)."""

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None
        self.what = ""

    def check(self) -> None:
        """Raise `StateCorruptedError` naming the failure, if there was one."""
        err = self.error
        if err is None:
            return
        raise StateCorruptedError(
            f"the engine's training state is unusable: {self.what}: {describe_error(err)}. The fp32 "
            "master, optimizer states and parameters may be partly updated, so steps and checkpoint saves "
            "are refused: load a checkpoint to continue (engine.load_checkpoint, with its optimizer states)",
            err,
        ) from err

    def poison(self, err: BaseException, what: Optional[str] = None) -> None:
        """Mark the state unusable because of `err`; a `StateCorruptedError` keeps naming its original."""
        if isinstance(err, StateCorruptedError) and err.original is not None:
            if self.error is err.original:
                return
            err = err.original
        self.error = err
        self.what = what or "an operation that changes it failed part way"

    def clear(self) -> None:
        """The state was restored completely (a checkpoint with its optimizer states): usable again."""
        self.error = None
        self.what = ""
