"""Gradient reduction: a unit's parameter gradients become this rank's reduced partition, once per backward.

A post-accumulate-grad hook per trainable parameter takes its full gradient as soon as autograd has it.
When the unit's gradient sink offers an accumulator (one rank, matching dtype), the gradient is summed
straight into it (on a GPU, each parameter's gradient is copied to the host partition on its own, counted in
`device_to_host_bytes`, so a unit's gradient never exists twice in device memory). Otherwise it is copied
into the unit's flat gradient buffer (no copy when the unit is that one parameter on one rank). When the
unit's last gradient is in, the buffer is reduce-scattered over the ranks (summed, not averaged), this
rank's partition goes to the sink (`partition_ready`), the unit's weights held for backward are released,
and the sink hears `unit_final`. Units no gradient reached are reduced with zeros when backward ends, so
every rank runs the same collectives.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn

from zero.stage3.comm import reduce_scatter_unit
from zero.stage3.grads import GradSink, SummingSink
from zero.stage3.unit import Unit

__all__ = ["GradReduction"]


class GradReduction:
    """The backward side of the partitioner: gradient hooks, reduction, and the gradient sink (module doc).

    `release(unit)` is called once a unit's gradient is reduced, before the sink's `unit_final`: backward
    will not read the unit's weights again, so the partitioner may free them."""

    def __init__(
        self,
        sink: Optional[GradSink],
        *,
        world_size: int,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        release: Callable[[Unit], None],
    ) -> None:
        """`sink`: where gradients go; None: a `SummingSink`, whose sums are `default_sums`."""
        default = SummingSink()
        self.sink: GradSink = sink if sink is not None else default
        self.default_sums: Dict[int, torch.Tensor] = default.partitions
        self.world_size = world_size
        self.group = group
        self.device = device
        self.device_to_host_bytes = 0
        self.in_backward = False
        self._release = release
        self._hooks: List[Any] = []
        self._reduced: Set[int] = set()  # units whose gradient is final in this backward
        self._summed: Set[int] = set()  # units whose gradients went to the sink's accumulator

    def install(self, units: Iterable[Unit]) -> None:
        """A post-accumulate-grad hook on every trainable parameter of `units`."""
        for u in units:
            for i in u.trainable:
                self._hooks.append(u.params[i].register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        """Take the hooks away."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def is_final(self, unit: Unit) -> bool:
        """Whether `unit`'s gradient was reduced in the current backward."""
        return unit.index in self._reduced

    def _on_grad(self, p: nn.Parameter) -> None:
        unit: Unit = p.ds_unit
        grad = p.grad
        if grad is None:
            return
        target = self.sink.accumulator(unit)
        if target is not None:
            a, z = unit.param_range(p.ds_index)
            if grad.device != target.device:  # GPU gradient, host partition: blocking, the add reads it now
                grad = grad.to(target.device)
                self.device_to_host_bytes += grad.numel() * grad.element_size()
            target[a:z].add_(grad.reshape(-1))  # one pass: the gradient lands in its final place
            self._summed.add(unit.index)
        elif unit.grad_flat is None and unit.padded_numel == unit.numel and len(unit.params) == 1:
            unit.grad_flat = grad.reshape(-1)  # the gradient already is the unit's flat gradient: no copy
        else:
            if unit.grad_flat is None:
                unit.grad_flat = torch.zeros(unit.padded_numel, dtype=grad.dtype, device=grad.device)
            a, z = unit.param_range(p.ds_index)
            unit.grad_flat[a:z].copy_(grad.reshape(-1))
        p.grad = None  # the full gradient is not kept: only the partition survives
        unit.grads_seen += 1
        if unit.grads_seen == len(unit.trainable):
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        if unit.index in self._summed:  # already summed into the sink's accumulator by _on_grad
            self._summed.discard(unit.index)
        else:
            flat = unit.grad_flat
            if flat is None:  # no gradient reached this unit (unused in this step): its gradient is zero
                flat = torch.zeros(unit.padded_numel, dtype=unit.dtype, device=self.device)
            if self.world_size == 1:
                part = flat
            else:
                part = torch.empty(unit.part_numel, dtype=flat.dtype, device=flat.device)
                reduce_scatter_unit(unit, part, flat, self.group)
            self.sink.partition_ready(unit, part)
        unit.grad_flat = None
        unit.grads_seen = 0
        self._reduced.add(unit.index)
        self._release(unit)
        self.sink.unit_final(unit)

    def finish(self, units: Iterable[Unit]) -> None:
        """Backward ended: reduce the trainable units no hook reduced (unused parameters: zeros)."""
        for u in units:
            if u.trainable and u.index not in self._reduced:
                self._reduce(u)
        self._reduced.clear()
        self.in_backward = False

    def abort(self, units: Iterable[Unit]) -> None:
        """Forget a backward that raised before it ended (its partial gradients are dropped)."""
        for u in units:
            u.grad_flat = None
            u.grads_seen = 0
        self._reduced.clear()
        self._summed.clear()
        self.in_backward = False
