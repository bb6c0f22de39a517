"""Exceptions of the engine that are part of its public face (exported from `zero`)."""

from __future__ import annotations

from typing import Optional

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointPickleError",
    "CheckpointTagError",
    "NoOptimizerError",
    "StateCorruptedError",
]


class StateCorruptedError(RuntimeError):
    """The engine's training state (fp32 master, optimizer states, parameters) may be inconsistent.

    Raised by the step that found out (an I/O error while state was being updated in place, a failed read
    while putting the committed weights back) and then by every later `step()`, `backward()` and checkpoint
    save, until a checkpoint is loaded completely. `original` is the error that made the state unusable;
    `errno` and `filename` are its own when it is an `OSError` (else None).
    """

    def __init__(self, message: str, original: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.original = original
        self.errno: Optional[int] = getattr(original, "errno", None)
        self.filename: Optional[str] = getattr(original, "filename", None)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; also raised on the ranks whose peer failed."""


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint file is missing, truncated or does not match its checksum in `manifest.json`."""


class CheckpointPickleError(CheckpointError):
    """Loading would need to unpickle arbitrary Python objects, and `allow_pickle=True` was not given."""


class CheckpointTagError(CheckpointError, AssertionError):
    """Ranks gave `save_checkpoint` different tags under `checkpoint.tag_validation: Fail` (nothing was
    written). An AssertionError as well: DeepSpeed asserts there."""


class NoOptimizerError(RuntimeError):
    """The engine was built without an optimizer (an inference engine) and was asked for something only
    training has: `backward`, `step`, optimizer state, a training checkpoint. The message says how to
    configure one (an `optimizer` block in the config, or `optimizer=` to `zero.initialize`)."""
