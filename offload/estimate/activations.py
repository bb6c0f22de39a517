"""Activation memory of a decoder-style transformer, per GPU.

Counts follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022): one layer saves about s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations, i.e. 16 elements of
s*b*h in the compute dtype plus two 1-byte dropout masks (34 = 16 * 2 + 2), and with eager attention
a*s*s*b*(2 + 2 + 1) bytes for the score matrix, its softmax and its dropout mask. Flash / SDPA
memory-efficient attention never materialises the score matrix, so that term is dropped for it.

With checkpointing, where the checkpoints (each layer's input, s*b*h elements) wait for the backward is
`checkpoint_device`, as zero.checkpointing places them: "none" keeps all of them on the compute device; "cpu"
and "nvme" keep two there (the last layer's, which never leaves, and the one being restored ahead of its
recompute) and the other L-1 in pinned host memory, or on NVMe behind two pinned staging buffers, written
once and read once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from .errors import EstimateInputError

# Per-layer saved tensors measured in units of s*b*h elements (Korthikanti et al., Table 2).
SAVED_SBH_ELEMENTS_PER_LAYER = 16
DROPOUT_MASK_BYTES_PER_SBH = 2  # attention-output and MLP dropout masks, 1 byte per element each
# Eager attention: QK^T and softmax output in the compute dtype, plus a 1-byte dropout mask, per a*s*s*b.
EAGER_SCORE_TENSORS = 2
EAGER_SCORE_MASK_BYTES = 1
LOSS_FP32_BYTES = 4  # the loss upcasts logits to fp32 before the softmax
CHECKPOINT_DEVICES = ("none", "cpu", "nvme")
RESIDENT_CHECKPOINTS = 2  # checkpoints on the compute device when the others are offloaded


@dataclass(frozen=True)
class ActivationSettings:
    """Inputs for activation memory; batch_size is the micro-batch per GPU."""

    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    checkpointing: bool = False
    attention: str = "flash"  # "flash" (SDPA / flash: no s*s matrix) or "eager"
    num_heads: Optional[int] = None  # needed for eager attention
    vocab_size: Optional[int] = None  # adds the logits; omitted -> not counted
    checkpoint_device: str = "none"  # with checkpointing: where the checkpoints wait ("none", "cpu", "nvme")

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EstimateInputError(f"activations: {name} must be a positive integer, got {value!r}")
        if self.attention not in ("flash", "eager"):
            raise EstimateInputError(
                f"activations: attention must be 'flash' or 'eager', got {self.attention!r}"
            )
        if self.checkpoint_device not in CHECKPOINT_DEVICES:
            raise EstimateInputError(
                f"activations: checkpoint_device must be one of {CHECKPOINT_DEVICES},"
                f" got {self.checkpoint_device!r}"
            )
        if self.checkpoint_device != "none" and not self.checkpointing:
            raise EstimateInputError("activations: checkpoint_device needs checkpointing")
        if self.attention == "eager" and not self.num_heads:
            raise EstimateInputError("activations: eager attention needs num_heads (--num-heads)")
        for name in ("num_heads", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise EstimateInputError(f"activations: {name} must be a positive integer, got {value!r}")


def layer_activation_bytes(act: ActivationSettings, element_bytes: int) -> int:
    """Bytes one transformer layer keeps for backward when nothing is recomputed."""
    sbh = act.seq_len * act.batch_size * act.hidden_size
    total = sbh * (SAVED_SBH_ELEMENTS_PER_LAYER * element_bytes + DROPOUT_MASK_BYTES_PER_SBH)
    if act.attention == "eager":
        assert act.num_heads is not None
        scores = act.num_heads * act.seq_len * act.seq_len * act.batch_size
        total += scores * (EAGER_SCORE_TENSORS * element_bytes + EAGER_SCORE_MASK_BYTES)
    return total


def activation_placement(act: ActivationSettings, element_bytes: int) -> Dict[str, int]:
    """Peak activation bytes for one micro-batch by where they live: "gpu" (the compute device),
    "cpu_pinned", "nvme", plus "nvme_read" / "nvme_write" bytes per micro-batch.

    Without checkpointing every layer keeps its saved tensors. With full activation checkpointing each
    layer keeps only its input (s*b*h elements), and during backward one layer at a time is recomputed,
    so one layer's full activations are added once; offloaded checkpoints leave two on the device.
    """
    sbh = act.seq_len * act.batch_size * act.hidden_size
    per_layer = layer_activation_bytes(act, element_bytes)
    ckpt = sbh * element_bytes
    out = {"gpu": 0, "cpu_pinned": 0, "nvme": 0, "nvme_read": 0, "nvme_write": 0}
    if not act.checkpointing:
        out["gpu"] = act.num_layers * per_layer
    elif act.checkpoint_device == "none" or act.num_layers <= RESIDENT_CHECKPOINTS:
        out["gpu"] = act.num_layers * ckpt + per_layer
    else:
        away = (act.num_layers - 1) * ckpt
        out["gpu"] = RESIDENT_CHECKPOINTS * ckpt + per_layer
        if act.checkpoint_device == "cpu":
            out["cpu_pinned"] = away
        else:
            out["cpu_pinned"] = 2 * ckpt  # the write and read staging buffers
            out["nvme"] = out["nvme_read"] = out["nvme_write"] = away
    if act.vocab_size:
        out["gpu"] += act.batch_size * act.seq_len * act.vocab_size * (element_bytes + LOSS_FP32_BYTES)
    return out


def activation_bytes(act: ActivationSettings, element_bytes: int) -> int:
    """Peak activation bytes on the compute device for one micro-batch (see `activation_placement`)."""
    return activation_placement(act, element_bytes)["gpu"]
