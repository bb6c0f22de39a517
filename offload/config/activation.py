"""The ``"activation_checkpointing"`` section: DeepSpeed's keys plus where checkpoints are kept.

DeepSpeed's keys and defaults: ``partition_activations``, ``cpu_checkpointing``,
``contiguous_memory_optimization``, ``number_checkpoints``, ``synchronize_checkpoint_boundary``, ``profile``.
Ours: ``offload_device`` ("none", "cpu" or "nvme": where each checkpointed block's inputs wait for the
backward) and ``nvme_path`` (the directory for "nvme"). ``cpu_checkpointing: true`` is DeepSpeed's way of
saying ``offload_device: "cpu"``; giving both is fine while they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ._reader import Context, Section
from .usage import warn_ignored

ACTIVATION_KEYS = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
    "offload_device",
    "nvme_path",
)

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """Where checkpointed blocks' inputs are kept between forward and backward, and how.

    ``offload_device`` is resolved: "cpu" when only ``cpu_checkpointing`` asked for it.
    """

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    offload_device: str = "none"
    nvme_path: Optional[str] = None


def parse_activation_checkpointing(raw: Any, ctx: Context) -> ActivationCheckpointingConfig:
    """Validate the `activation_checkpointing` section into an ActivationCheckpointingConfig."""
    s = Section(raw, "activation_checkpointing", ctx, ACTIVATION_KEYS)
    d = ActivationCheckpointingConfig
    cpu = s.bool("cpu_checkpointing", d.cpu_checkpointing)
    given = s.choice("offload_device", None, OFFLOAD_DEVICES) if s.has("offload_device") else None
    if cpu and given == "none":
        raise s.fail(
            "offload_device",
            "is 'none' but cpu_checkpointing is true (which means offload_device 'cpu'); set one of them",
        )
    device = given or ("cpu" if cpu else d.offload_device)
    nvme_path = s.str("nvme_path", None, allow_none=True)
    if device == "nvme" and not nvme_path:
        raise s.fail("nvme_path", "must name a directory when offload_device is 'nvme'")
    if device != "nvme" and nvme_path:
        raise s.fail("nvme_path", f"is only used with offload_device 'nvme' (offload_device is {device!r})")
    contiguous = s.bool("contiguous_memory_optimization", d.contiguous_memory_optimization)
    number = s.int("number_checkpoints", None, min=1, allow_none=True)
    if contiguous and number is None:
        raise s.fail(
            "number_checkpoints",
            "must be set when contiguous_memory_optimization is true: it is how many checkpoint buffers to"
            " preallocate (one per checkpointed block of a forward pass)",
        )
    out = ActivationCheckpointingConfig(
        partition_activations=s.bool("partition_activations", d.partition_activations),
        cpu_checkpointing=cpu,
        contiguous_memory_optimization=contiguous,
        number_checkpoints=number,
        synchronize_checkpoint_boundary=s.bool(
            "synchronize_checkpoint_boundary", d.synchronize_checkpoint_boundary
        ),
        profile=s.bool("profile", d.profile),
        offload_device=device,
        nvme_path=nvme_path,
    )
    warn_ignored(s, "activation_checkpointing.", out)
    return out
