"""The per-step report: where one optimizer step's time went and how many bytes moved between tiers.

The engine always counts (perf_counter and integer adds cost nothing next to a training step); it prints a
report when the config asks (`zero_offload.report` or DeepSpeed's `wall_clock_breakdown`). Times cover a
whole accumulation window: all micro-batches' forward and backward, then the optimizer step.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional

__all__ = ["PhaseClock", "StepReport", "format_bytes"]


def format_bytes(n: float) -> str:
    """`n` bytes with a binary unit (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class StepReport:
    """One optimizer step (one accumulation window)."""

    step: int = 0
    micro_batches: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0  # waiting for gradient reduction / parameter all-gather
    optimizer_s: float = 0.0  # the whole optimizer phase, I/O included
    optimizer_compute_s: float = 0.0  # inside the fused kernels (and parameter copy-out)
    io_wait_s: float = 0.0  # blocked on NVMe reads/writes during the optimizer phase
    # optimizer steps overlapped with backward (offload_optimizer.pipeline_*): how long that pass waited
    # for gradients; its compute and I/O wait above then ran during backward_s, not after it
    gradient_wait_s: float = 0.0
    optimizer_chunks: int = 0  # chunks (sub-groups) the optimizer pass updated
    optimizer_chunks_in_backward: int = 0  # of those, updated while backward still ran (overlap)
    nvme_read_bytes: int = 0
    nvme_write_bytes: int = 0
    device_to_host_bytes: int = 0  # gradients to the host tier
    host_to_device_bytes: int = 0  # updated parameters back to the device
    comm_bytes: int = 0
    pinned_bytes_in_use: int = 0
    nvme_bytes_in_use: int = 0
    loss_scale: float = 1.0
    skipped: bool = False
    # activation checkpointing in this window (zero.checkpointing.CheckpointingReport fields); empty if none
    activations: Dict[str, Any] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.comm_s + self.optimizer_s

    @property
    def nvme_gbps(self) -> float:
        """NVMe bytes moved per second of optimizer phase (read + write)."""
        moved = self.nvme_read_bytes + self.nvme_write_bytes
        return moved / self.optimizer_s / 1e9 if self.optimizer_s > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["step_s"] = self.step_s
        d["nvme_gbps"] = self.nvme_gbps
        return d

    def format(self) -> str:
        parts = [
            f"step {self.step}",
            f"fwd {self.forward_s * 1e3:.1f} ms",
            f"bwd {self.backward_s * 1e3:.1f} ms",
            f"opt {self.optimizer_s * 1e3:.1f} ms (kernel {self.optimizer_compute_s * 1e3:.1f}, "
            f"io-wait {self.io_wait_s * 1e3:.1f})",
        ]
        if self.comm_s:
            parts.append(f"comm {self.comm_s * 1e3:.1f} ms")
        if self.nvme_read_bytes or self.nvme_write_bytes:
            parts.append(
                f"nvme r {format_bytes(self.nvme_read_bytes)} w {format_bytes(self.nvme_write_bytes)} "
                f"{self.nvme_gbps:.2f} GB/s"
            )
        parts.append(f"pinned {format_bytes(self.pinned_bytes_in_use)}")
        if self.nvme_bytes_in_use:
            parts.append(f"nvme files {format_bytes(self.nvme_bytes_in_use)}")
        if self.activations:
            a = self.activations
            text = (
                f"ckpt {a['checkpoints']} (off {format_bytes(a['offloaded_bytes'])}, "
                f"back {format_bytes(a['restored_bytes'])}"
            )
            if a["offload_s"] or a["restore_wait_s"]:  # activation_checkpointing.profile
                text += f", offload {a['offload_s'] * 1e3:.1f} ms, wait {a['restore_wait_s'] * 1e3:.1f} ms"
            parts.append(text + ")")
        if self.skipped:
            parts.append(f"SKIPPED (overflow, loss scale now {self.loss_scale:g})")
        return " | ".join(parts)


class PhaseClock:
    """Adds wall time into a StepReport field; synchronizes the device first when asked (exact GPU times)."""

    def __init__(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.current = StepReport()
        self._sync = sync

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            setattr(self.current, name, getattr(self.current, name) + time.perf_counter() - t0)

    def finish(self) -> StepReport:
        done, self.current = self.current, StepReport()
        return done
