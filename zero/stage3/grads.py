"""Where the stage-3 partitioner sends each unit's gradient: a `GradSink`, given at construction.

After backward produced every gradient of a unit, the partitioner reduce-scatters them over the ranks and
hands this rank's partition to the sink (`partition_ready`), then frees the full gradient. On one rank a sink
may instead offer the place where each parameter's gradient is summed directly (`accumulator`), so no flat
unit gradient is ever built. `unit_final` follows once the unit's gathered weights are released: backward
will neither read nor write the unit again, so an optimizer may update it.

The engine's sink is its stage-3 layout (zero/layout/units.py); `SummingSink`, the default, sums the
partitions per unit (for the partitioner used on its own, as in tests).
"""

from __future__ import annotations

from typing import Dict, Optional, Protocol

import torch

from zero.stage3.unit import Unit

__all__ = ["GradSink", "SummingSink"]


class GradSink(Protocol):
    """Receives the gradients of stage-3 units (see the module doc)."""

    def accumulator(self, unit: Unit) -> Optional[torch.Tensor]:
        """The unit's gradient partition to sum each parameter's gradient into directly, or None."""
        ...

    def partition_ready(self, unit: Unit, grad_partition: torch.Tensor) -> None:
        """This rank's reduced gradient partition of `unit` (summed over ranks, not averaged)."""
        ...

    def unit_final(self, unit: Unit) -> None:
        """`unit`'s gradient is in place and its gathered weights are released."""
        ...


class SummingSink:
    """Sums each unit's gradient partitions in `partitions` (unit index -> tensor)."""

    def __init__(self) -> None:
        self.partitions: Dict[int, torch.Tensor] = {}

    def accumulator(self, unit: Unit) -> Optional[torch.Tensor]:
        """None: every unit's gradient comes as a reduced partition."""
        return None

    def partition_ready(self, unit: Unit, grad_partition: torch.Tensor) -> None:
        """Add `grad_partition` to the unit's sum (a copy of it for the first one)."""
        acc = self.partitions.get(unit.index)
        if acc is None:
            self.partitions[unit.index] = grad_partition.clone()
        else:
            acc.add_(grad_partition)

    def unit_final(self, unit: Unit) -> None:
        """Nothing to do."""
