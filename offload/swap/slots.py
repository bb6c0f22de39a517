"""Sizing the pinned staging slots through which the optimizer state streams to and from NVMe.

Torch-free, so the memory estimator (offload/estimate) sizes slots with the same functions the engine
uses. A slot holds master + optimizer states of one chunk of the partition, padded to the swap alignment.
"""

from __future__ import annotations

from offload.swap.space import align_up

__all__ = ["FP32_BYTES", "MIN_SLOT_NUMEL", "plan_slot_numel", "slot_bytes", "swap_chunk"]

FP32_BYTES = 4
# Below this many elements a staging slot is mostly per-request overhead: the smallest piece a sub-group is
# cut into when the pinned budget is tight.
MIN_SLOT_NUMEL = 4096


def slot_bytes(chunk_numel: int, n_states: int, alignment: int) -> int:
    """Pinned bytes one staging slot needs for a chunk of `chunk_numel` elements (master + n_states)."""
    return align_up((1 + n_states) * chunk_numel * FP32_BYTES, alignment)


def swap_chunk(sub_group: int, part: int, state_bytes: int) -> int:
    """Elements per staging slot for DeepSpeed's staging memory: buffer_count x sub_group x 4 bytes, split
    into buffer_count slots that each hold master + states (`state_bytes` per element) of one chunk of
    sub_group / (1 + states) elements, so that buffer_count chunks can be in flight at once."""
    sub = min(sub_group, part)
    arrays = 1 + state_bytes // FP32_BYTES
    return min(sub, max(MIN_SLOT_NUMEL, sub // arrays // 1024 * 1024))


def plan_slot_numel(
    sub_group: int,
    part_numel: int,
    n_states: int,
    buffer_count: int,
    *,
    cap_bytes: int,
    in_use_bytes: int,
    reserved_bytes: int = 0,
    alignment: int = 4096,
    budget_source: str = "zero_offload.pinned_budget_bytes",
) -> int:
    """Elements per slot: `swap_chunk`'s if `buffer_count` slots fit in the pinned budget (`cap_bytes` minus
    `in_use_bytes` already allocated and `reserved_bytes` still to come), else the largest multiple of
    1024 that fits (a smaller piece of a sub-group, down to MIN_SLOT_NUMEL); ValueError naming the budget,
    buffer_count and sub_group_size when not even that fits."""
    free = cap_bytes - in_use_bytes - reserved_bytes
    want = swap_chunk(sub_group, part_numel, n_states * FP32_BYTES)
    if buffer_count * slot_bytes(want, n_states, alignment) <= free:
        return want
    numel = (max(0, free) // buffer_count // ((1 + n_states) * FP32_BYTES)) // 1024 * 1024
    floor = min(MIN_SLOT_NUMEL, want)
    if numel < floor:
        need = buffer_count * slot_bytes(floor, n_states, alignment) + in_use_bytes + reserved_bytes
        raise ValueError(
            f"pinned memory budget too small for NVMe staging: {cap_bytes} bytes ({budget_source}) with "
            f"{in_use_bytes} bytes already used for gradients; offload_optimizer.buffer_count={buffer_count} "
            f"slots of {want} elements (sub_group_size={sub_group}, {1 + n_states} fp32 tensors each) need "
            f"{buffer_count * slot_bytes(want, n_states, alignment)} bytes, and at least {need} bytes in "
            "total are needed to split sub-groups into smaller pieces"
        )
    return numel
