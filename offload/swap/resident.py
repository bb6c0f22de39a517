"""Which stage-3 parameter partitions stay in host memory when parameters are offloaded to NVMe.

`offload_param.max_in_cpu` is a budget of parameter elements kept in host memory; every other partition is
read from its swap file each time its module runs. Which partitions the budget holds matters for streaming:
a forward computes the resident ones without reading anything, and the disk keeps busy during that compute
only as far as the `buffer_count` staging buffers reach ahead. Resident partitions packed at the start of
the model (first fit in module order) make one long stretch of compute with nothing left to read once
those buffers are full, and then the disk alone for the rest. `resident_plan` spreads them instead:

* the first partition stays resident when it fits (nothing precedes it in a forward to hide its read);
* the others are kept so that, along the module order, the resident elements follow the budget's share of
  the elements seen so far (error diffusion: a partition is kept when the resident elements would stay
  within half of it of that share), never above the budget;
* what rounding leaves of the budget is then filled first fit, in module order, so no streamed partition
  fits the budget that is left (as with plain first fit).

Pure arithmetic, no torch: the stage-3 store (zero/stage3/store.py) places partitions with it and the
memory estimator (offload/estimate/inference.py) predicts the same placement.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["RESIDENT_PLAN_VERSION", "auto_resident_numel", "resident_plan"]

# Part of a swap cache's fingerprint (zero.from_pretrained): a cache whose files were chosen by another
# placement is never taken for a match.
RESIDENT_PLAN_VERSION = "spread-1"


def resident_plan(numels: Sequence[int], budget: int) -> List[bool]:
    """Per partition (`numels`: their elements, in module order), whether it stays in host memory under a
    budget of `budget` elements (module doc). Everything stays when everything fits; nothing when the
    budget is 0; the resident elements never exceed the budget."""
    out = [False] * len(numels)
    total = sum(numels)
    if total <= budget:
        return [True] * len(numels)
    if not numels or budget <= 0:
        return out
    kept = 0
    if numels[0] <= budget:
        out[0], kept = True, numels[0]
    rest = total - numels[0]
    share = (budget - kept) / rest if rest > 0 else 0.0
    spread = seen = 0
    for i in range(1, len(numels)):
        n = numels[i]
        seen += n
        if kept + n <= budget and spread + n / 2 <= share * seen:
            out[i] = True
            kept += n
            spread += n
    for i, n in enumerate(numels):
        if not out[i] and kept + n <= budget:
            out[i] = True
            kept += n
    return out


def auto_resident_numel(
    numels: Sequence[int], itemsize: int, free_bytes: int, buffer_count: int, buffer_size: int
) -> int:
    """`offload_param.max_in_cpu: "auto"`: the elements of the partitions `numels` (`itemsize` bytes each, the
    largest of their dtypes) that stay in host memory when `free_bytes` of the pinned budget are left. All
    of them when they fit; otherwise what fits after the `buffer_count` staging slots that stream the rest
    (each `min(buffer_size, largest partition)` elements)."""
    total = sum(numels)
    itemsize = max(1, int(itemsize))
    if total * itemsize <= free_bytes:
        return total
    slot = min(int(buffer_size), max(numels, default=0)) * itemsize
    room = max(0, int(free_bytes) - int(buffer_count) * slot)
    return room // itemsize
