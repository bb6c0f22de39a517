"""Where the stage-3 parameter partitions went, and `offload_param.max_in_cpu: "auto"`'s share.

With parameters on NVMe, `max_in_cpu: "auto"` (the default) keeps in host memory as many partition elements
as the pinned budget (`zero_offload.pinned_budget_bytes`, else $ZERO_OFFLOAD_PINNED_BUDGET, else half of
min(RAM, cgroup limit) over the node's ranks: offload.pinned.default_pinned_budget) has left when the
model is placed: all of them when they fit, so a forward reads nothing from disk after the load; otherwise
what fits after the staging slots that stream the rest (offload.swap.resident.auto_resident_numel). The
half of memory the budget leaves out is the room for activations, the KV cache and the rest of the process.
Partitions kept in pageable memory (`pin_memory: false`, the default) are charged to the budget all the
same, so an optimizer state placed after them (`offload_optimizer.max_in_cpu: "auto"`) sees what is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Sequence, Union

from offload.pinned import PinnedPool
from offload.swap.resident import auto_resident_numel

__all__ = ["ParamPlacement", "auto_keeps_unit", "auto_max_in_cpu", "describe_param_placement"]


def auto_max_in_cpu(sizes: Sequence[Any], pool: PinnedPool, buffer_count: int, buffer_size: int) -> int:
    """Elements of the partitions `sizes` (each with `part_numel` and `part_nbytes`) that `max_in_cpu:
    "auto"` keeps in host memory, given what `pool`'s budget has left now."""
    numels = [int(s.part_numel) for s in sizes]
    itemsize = max((int(s.part_nbytes) // max(1, int(s.part_numel)) for s in sizes), default=1)
    free = max(0, pool.cap_bytes - pool.bytes_in_use)
    return auto_resident_numel(numels, itemsize, free, buffer_count, buffer_size)


def auto_keeps_unit(size: Any, pool: PinnedPool, buffer_count: int, buffer_size: int) -> bool:
    """For a unit placed without a plan (zero.Init builds them one at a time, so what follows is unknown):
    whether "auto" keeps it in host memory - when it fits in what the budget has left after room for the
    staging slots of units still to come (`buffer_count` slots of `min(buffer_size, its size)`)."""
    numel, nbytes = int(size.part_numel), int(size.part_nbytes)
    itemsize = max(1, nbytes // max(1, numel))
    slots = buffer_count * min(int(buffer_size), numel) * itemsize
    return nbytes + slots <= pool.cap_bytes - pool.bytes_in_use


@dataclass(frozen=True)
class ParamPlacement:
    """Where one rank's parameter partitions live (`engine.placement()["parameters"]`): bytes per tier and
    why."""

    tier: str  # offload_param.device: "none" (the compute device), "cpu" or "nvme"
    device_bytes: int  # partitions in the compute device's memory
    host_bytes: int  # partitions in host memory (the cpu tier, or kept by max_in_cpu with nvme)
    host_pinned: bool
    nvme_bytes: int  # swap files, and partitions served from a checkpoint's files
    max_in_cpu: Union[int, str]  # the config's value ("auto" or a count)
    resident_numel: int  # elements in memory (device or host)
    budget_bytes: int  # the pinned budget the placement was sized against
    why: str

    def as_dict(self) -> Dict[str, Any]:
        """The fields by name."""
        return asdict(self)


def describe_param_placement(store: Any, max_in_cpu: Union[int, str]) -> ParamPlacement:
    """The placement of a stage-3 PartitionStore's partitions (`max_in_cpu`: the config's value)."""
    from offload.estimate.units import format_bytes

    tier = store.tier
    mem = int(store.in_memory_bytes)
    served = int(store.files.served_bytes)  # read from a checkpoint's files (zero.stage3.served)
    disk = int(store.bytes_on_disk) + served
    budget = int(store.pool.cap_bytes)
    if tier == "none":
        why = "offload_param.device=none: the partitions live on the compute device"
    elif tier == "cpu":
        why = "offload_param.device=cpu"
    elif max_in_cpu != "auto":
        why = f"offload_param.max_in_cpu={max_in_cpu}"
    elif disk == 0:
        why = f"max_in_cpu=auto: the model fits in the pinned budget of {format_bytes(budget)}"
    else:
        why = f"max_in_cpu=auto: what fits in the pinned budget of {format_bytes(budget)} stays in RAM"
    if served:
        why += f"; {format_bytes(served)} on NVMe served from the checkpoint's files, not copied"
    return ParamPlacement(
        tier=tier,
        device_bytes=mem if tier == "none" else 0,
        host_bytes=0 if tier == "none" else mem,
        host_pinned=bool(store.pin_memory),
        nvme_bytes=disk,
        max_in_cpu=max_in_cpu,
        resident_numel=int(store.in_cpu_numel) if tier == "nvme" else -1,
        budget_bytes=budget,
        why=why,
    )
