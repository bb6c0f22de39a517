"""MemoryEstimate: one configuration's estimated bytes by tier and component (offload.estimate.formulas
makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .placement import COMPONENTS

__all__ = ["MemoryEstimate"]


@dataclass(frozen=True)
class MemoryEstimate:
    """One configuration's bytes. GPU figures are per GPU; CPU and NVMe figures are per node."""

    stage: int
    offload_optimizer: str
    offload_param: str
    gpu: Dict[str, int]
    cpu_pinned: Dict[str, int]
    cpu_pageable: Dict[str, int]
    nvme: Dict[str, int]
    nvme_read_bytes_per_step: int = 0  # per node, one optimizer step (forward + backward + update)
    nvme_write_bytes_per_step: int = 0
    notes: Tuple[str, ...] = ()
    # Stage 3 with NVMe optimizer state on a disk too small for two copies: the engine updates one copy in
    # place. The least NVMe it can run with (equals nvme_bytes elsewhere); None: same as nvme_bytes.
    nvme_min_bytes_value: Optional[int] = None

    @property
    def cpu(self) -> Dict[str, int]:
        """Host memory per node by component, pinned and pageable together."""
        return {name: self.cpu_pinned[name] + self.cpu_pageable[name] for name in COMPONENTS}

    @property
    def per_gpu_bytes(self) -> int:
        """Bytes on each GPU."""
        return sum(self.gpu.values())

    @property
    def per_cpu_pinned_bytes(self) -> int:
        """Pinned host memory per node."""
        return sum(self.cpu_pinned.values())

    @property
    def per_cpu_pageable_bytes(self) -> int:
        """Pageable host memory per node."""
        return sum(self.cpu_pageable.values())

    @property
    def per_cpu_bytes(self) -> int:
        """Host memory per node, pinned and pageable."""
        return self.per_cpu_pinned_bytes + self.per_cpu_pageable_bytes

    @property
    def nvme_bytes(self) -> int:
        """NVMe bytes per node."""
        return sum(self.nvme.values())

    @property
    def nvme_min_bytes(self) -> int:
        """The least NVMe per node the engine can run with (one copy of the optimizer state)."""
        return self.nvme_bytes if self.nvme_min_bytes_value is None else self.nvme_min_bytes_value

    @property
    def options(self) -> str:
        """The configuration as the engine's keys: stage and offload devices."""
        return (
            f"stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
            f"offload_param={self.offload_param}"
        )

    def to_dict(self) -> Dict[str, object]:
        """The estimate as JSON-ready values: totals, breakdown by tier, NVMe traffic, notes."""
        return {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "per_gpu_bytes": self.per_gpu_bytes,
            "per_cpu_bytes": self.per_cpu_bytes,
            "per_cpu_pinned_bytes": self.per_cpu_pinned_bytes,
            "per_cpu_pageable_bytes": self.per_cpu_pageable_bytes,
            "nvme_bytes": self.nvme_bytes,
            "nvme_min_bytes": self.nvme_min_bytes,
            "breakdown": {
                "gpu": dict(self.gpu),
                "cpu": self.cpu,
                "nvme": dict(self.nvme),
                "cpu_pinned": dict(self.cpu_pinned),
                "cpu_pageable": dict(self.cpu_pageable),
            },
            "nvme_read_bytes_per_step": self.nvme_read_bytes_per_step,
            "nvme_write_bytes_per_step": self.nvme_write_bytes_per_step,
            "notes": list(self.notes),
        }
