"""How `offload_optimizer.ratio` and `max_in_cpu` split an optimizer partition between tiers.

Torch-free, so the engine (zero/optimizer/tiers/split.py) and the memory estimator (offload/estimate) split
with the same arithmetic. A partition of `part` elements is cut into sub-groups of `sub_group` elements; every
split falls on a sub-group boundary, in index order `[device | pinned host | offload tier]`:

* `ratio` (DeepSpeed's Twin-Flow): `ceil(ratio x sub-groups)` sub-groups live on the offload tier (cpu or
  nvme), the sub-groups before them on the training device;
* `max_in_cpu` (nvme only): of the offloaded elements, the first `max_in_cpu` rounded down to a multiple
  of `host_granule(sub_group)` = min(sub_group, 2048) elements (all of them when `max_in_cpu` covers them)
  stay in pinned host memory; the rest is swapped. Finer than a sub-group, so DeepSpeed's default
  `sub_group_size` (1e9, one sub-group for most partitions) does not turn RAM-first placement off; 2048 is
  the int8 states' quantization block, so the cut never splits one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload.swap.slots import FP32_BYTES, StateFormat, slot_bytes, state_chunk

__all__ = [
    "SplitNumel",
    "auto_max_in_cpu",
    "host_granule",
    "split_numel",
    "swap_file_bytes",
    "swap_pass_bytes",
]

HOST_GRANULE = 2048  # the finest cut of max_in_cpu (offload.ops.QUANT_BLOCK)


def host_granule(sub_group: int) -> int:
    """Elements to whose multiples `max_in_cpu` is rounded down: a sub-group, or 2048 if that is smaller."""
    return max(1, min(int(sub_group), HOST_GRANULE))


@dataclass(frozen=True)
class SplitNumel:
    """Elements per tier, in index order."""

    device: int  # on the training device (ratio below 1.0)
    host: int  # in pinned host memory (nvme with max_in_cpu)
    offload: int  # on the offload tier: swapped with nvme, pinned host memory with cpu


def split_numel(
    part: int, sub_group: int, *, tier: str, ratio: float = 1.0, max_in_cpu: int = 0
) -> SplitNumel:
    """The split of a `part`-element partition for offload tier `tier` ("none", "cpu" or "nvme"), with an
    explicit `max_in_cpu` (the engine resolves "auto" with `auto_max_in_cpu` first)."""
    sub_group = max(1, min(int(sub_group), part))
    on_device = 0
    if tier in ("cpu", "nvme") and ratio < 1.0:
        n_sub = -(-part // sub_group)
        n_off = math.ceil(ratio * n_sub - 1e-9)
        on_device = min(part, (n_sub - n_off) * sub_group)
    rest = part - on_device
    host = 0
    if tier == "nvme" and rest:
        g = host_granule(sub_group)
        host = rest if max_in_cpu >= rest else min(rest, max_in_cpu // g * g)
    return SplitNumel(device=on_device, host=host, offload=rest - host)


def auto_max_in_cpu(
    numel: int,
    n_states: int,
    sub_group: int,
    buffer_count: int,
    *,
    free_bytes: int,
    alignment: int = 4096,
    state_dtype: str = "fp32",
) -> int:
    """`max_in_cpu: "auto"` for `numel` elements bound for NVMe: all of them when master + states (in
    `state_dtype`, int8 with its block scales) fit in `free_bytes` (what the pinned budget has left);
    otherwise whole `host_granule`s in what remains after `buffer_count` staging slots for the swapped rest
    (the slots' size as `state_chunk` plans them)."""
    fmt = StateFormat(n_states, state_dtype)
    if fmt.whole_bytes(numel) <= free_bytes:
        return numel
    sub_group = max(1, min(int(sub_group), numel))
    chunk = state_chunk(sub_group, numel, n_states, state_dtype)
    room = max(0, free_bytes - buffer_count * slot_bytes(chunk, n_states, alignment, state_dtype))
    g = host_granule(sub_group)
    return min(numel // g * g, room // fmt.whole_bytes(g) * g)


def swap_pass_bytes(numel: int, chunk: int, n_states: int, alignment: int = 4096) -> int:
    """NVMe bytes one optimizer step reads (and writes) for `numel` swapped elements in chunks of `chunk`:
    each chunk's region `[master | states]` padded to `alignment`."""
    if numel <= 0:
        return 0
    full, last = divmod(numel, chunk)

    def region(n: int) -> int:
        return -(-(1 + n_states) * n * FP32_BYTES // alignment) * alignment

    return full * region(chunk) + (region(last) if last else 0)


def swap_file_bytes(numel: int, chunk: int, n_states: int, copies: int = 2, alignment: int = 4096) -> int:
    """Disk bytes of the swap files for `numel` swapped elements: `copies` copies of one full region
    (`slot_bytes`) per chunk, the last one included."""
    if numel <= 0:
        return 0
    return copies * -(-numel // chunk) * slot_bytes(chunk, n_states, alignment)
