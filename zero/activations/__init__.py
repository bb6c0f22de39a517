"""Activation checkpointing on a memory tier, with DeepSpeed's API (`deepspeed.checkpointing`).

`zero.checkpointing` is this package under DeepSpeed's name. The parts:
* `checkpointer`: `configure`, `checkpoint`, `take_report`, `close`: the module-level API and its state;
* `stash` / `tiers` / `nvme`: where a checkpointed block's inputs wait for the backward (in place, pinned
  host memory, an NVMe scratch file);
* `apply`: checkpoint a model's repeated blocks (Hugging Face models too) without editing its code.
"""

from zero.activations.apply import apply
from zero.activations.checkpointer import (
    ActivationCheckpointingConfig,
    CheckpointBufferError,
    Checkpointer,
    CheckpointingReport,
    checkpoint,
    close,
    configure,
    current,
    is_configured,
    reset,
    take_report,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointBufferError",
    "Checkpointer",
    "CheckpointingReport",
    "apply",
    "checkpoint",
    "close",
    "configure",
    "current",
    "is_configured",
    "reset",
    "take_report",
]
