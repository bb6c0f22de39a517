"""DeepSpeed's `deepspeed.checkpointing` under its own name: activation checkpointing, which lives in
`zero.activations` (`configure`, `checkpoint`, `is_configured`, `reset`, ...)."""

from zero.activations import (
    ActivationCheckpointingConfig,
    CheckpointBufferError,
    Checkpointer,
    CheckpointingReport,
    apply,
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
