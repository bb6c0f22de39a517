"""The optimizer state split between tiers in an estimate: `offload_optimizer.ratio` (Twin-Flow: the share
not offloaded stays on the GPU) and `offload_optimizer.max_in_cpu` (RAM-first: with NVMe, that many elements
stay in pinned host memory and only the rest is swapped).

`apply_split` takes an estimate made for the whole state on the offload tier (offload/estimate/formulas.py)
and moves the fp32 master and optimizer states of the device and host shares out of it, with the split the
engine makes (offload/swap/split.py: whole sub-groups, in index order device | host | NVMe): the GPU grows
by the device share, host memory by the RAM-first share, and NVMe bytes on disk and per step shrink to the
swapped share. On a CPU-only machine (`cpu_only`) the device share's gradients leave pinned memory for
pageable host memory: only the host share's gradient partition is pinned. `max_in_cpu: "auto"` (the
engine's default, and the estimator's) depends on the pinned budget of the machine the engine runs on:
`resolve_max_in_cpu` turns it into a count as the engine does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Union

from offload.estimate.placement import FP32_BYTES, OPTIMIZER_STATES_PER_PARAM
from offload.estimate.result import MemoryEstimate
from offload.estimate.setup import TrainingSetup
from offload.swap.slots import swap_chunk
from offload.swap.split import auto_max_in_cpu, split_numel

__all__ = ["apply_split", "resolve_max_in_cpu"]

_MASTER, _STATES, _SLOTS = "master_params_fp32", "optimizer_states", "swap_buffers"
_GRADS = ("grads_fp32", "grads_16bit")  # the optimizer's gradient partition (stage 3: in the compute dtype)


def _take(row: Dict[str, int], name: str, nbytes: int) -> int:
    """Remove up to `nbytes` from row[name]; returns what was removed."""
    taken = min(row.get(name, 0), max(0, nbytes))
    row[name] = row.get(name, 0) - taken
    return taken


def resolve_max_in_cpu(
    est: MemoryEstimate, setup: TrainingSetup, ratio: float, max_in_cpu: Union[int, str], pinned_budget: int
) -> int:
    """`offload_optimizer.max_in_cpu` as an element count for `est`: a count as given; "auto" as the engine
    resolves it (`auto_max_in_cpu`): the whole NVMe share when master + states fit in what one rank's
    `pinned_budget` has left after the estimate's other pinned bytes, else what fits after the slots."""
    if max_in_cpu != "auto":
        return int(max_in_cpu)
    if est.offload_optimizer != "nvme":
        return 0
    part = math.ceil(setup.params / setup.world_size) if est.stage >= 1 else setup.params
    rest = split_numel(part, setup.buffers.sub_group_size, tier="nvme", ratio=ratio).offload
    other = sum(v for k, v in est.cpu_pinned.items() if k not in (_MASTER, _STATES, _SLOTS))
    return auto_max_in_cpu(
        rest,
        OPTIMIZER_STATES_PER_PARAM[setup.optimizer],
        setup.buffers.sub_group_size,
        setup.buffers.optimizer_buffer_count,
        free_bytes=pinned_budget - other // setup.gpus_per_node,
        state_dtype=setup.optimizer_state_dtype,
    )


def apply_split(
    est: MemoryEstimate,
    setup: TrainingSetup,
    ratio: float = 1.0,
    max_in_cpu: int = 0,
    *,
    cpu_only: bool = False,
) -> MemoryEstimate:
    """`est` with the optimizer state split by `ratio` and `max_in_cpu` (unchanged without offload, at
    ratio 1.0 with cpu, or at ratio 1.0 and max_in_cpu 0 with nvme). `cpu_only`: the training device is the
    CPU (no GPU), so the device share's gradients need no pinned memory."""
    tier = est.offload_optimizer
    if tier == "none" or (ratio >= 1.0 and (tier != "nvme" or max_in_cpu <= 0)):
        return est
    part = math.ceil(setup.params / setup.world_size) if est.stage >= 1 else setup.params
    s = split_numel(part, setup.buffers.sub_group_size, tier=tier, ratio=ratio, max_in_cpu=max_in_cpu)
    node = setup.gpus_per_node
    sb = setup.optimizer_state_bytes
    gpu, nvme = dict(est.gpu), dict(est.nvme)
    pinned, pageable = dict(est.cpu_pinned), dict(est.cpu_pageable)
    read, write = est.nvme_read_bytes_per_step, est.nvme_write_bytes_per_step
    if tier == "nvme":
        # The swap files hold whole chunks of the swapped share only, in as many copies as before; the
        # staging slots are as many as its chunks, up to buffer_count.
        sub, count = setup.buffers.sub_group_size, setup.buffers.optimizer_buffer_count
        chunk = swap_chunk(sub, part, sb)
        n_chunks = -(-part // chunk)
        copies = round(nvme.get(_MASTER, 0) / (node * n_chunks * chunk * FP32_BYTES))
        swapped_elems = swapped_slots = 0
        if s.offload:
            chunk_s = swap_chunk(sub, s.offload, sb)
            swapped_elems = -(-s.offload // chunk_s) * chunk_s
            swapped_slots = min(count, -(-s.offload // chunk_s)) * chunk_s
        nvme[_MASTER] = copies * node * swapped_elems * FP32_BYTES
        nvme[_STATES] = copies * node * swapped_elems * sb
        old_slots = min(count, n_chunks) * chunk
        pinned[_SLOTS] = pinned.get(_SLOTS, 0) - (old_slots - swapped_slots) * (FP32_BYTES + sb) * node
        moved = (part - s.offload) * (FP32_BYTES + sb) * node
        read, write = read - moved, write - moved
        pinned[_MASTER] = pinned.get(_MASTER, 0) + s.host * FP32_BYTES * node
        pinned[_STATES] = pinned.get(_STATES, 0) + s.host * sb * node
    else:  # cpu: the device share leaves host memory
        host = pinned if setup.buffers.optimizer_pin_memory else pageable
        _take(host, _MASTER, s.device * FP32_BYTES * node)
        _take(host, _STATES, s.device * sb * node)
    # On a CPU-only machine the device share's gradients need no pinned memory: only the host share's are
    # pinned. With a GPU the whole gradient partition stays pinned, so its copies stay asynchronous.
    for name in _GRADS if cpu_only else ():
        moved = pinned.get(name, 0) * s.device // part
        if moved:
            _take(pinned, name, moved)
            pageable[name] = pageable.get(name, 0) + moved
    gpu[_MASTER] = gpu.get(_MASTER, 0) + s.device * FP32_BYTES
    gpu[_STATES] = gpu.get(_STATES, 0) + s.device * sb
    note = (
        f"optimizer state split: {s.device} elements per rank on the GPU (ratio {ratio}), {s.host} in pinned "
        f"host memory (max_in_cpu), {s.offload} on {tier}"
    )
    return dataclasses.replace(
        est,
        gpu=gpu,
        cpu_pinned=pinned,
        cpu_pageable=pageable,
        nvme=nvme,
        nvme_read_bytes_per_step=read,
        nvme_write_bytes_per_step=write,
        notes=(*est.notes, note),
        nvme_min_bytes_value=None,
    )
