"""Model-state, buffer and activation bytes per GPU, per node's CPU memory and per node's NVMe.

ZeRO's accounting (Rajbhandari et al. 2020): mixed-precision training keeps 2 bytes of 16-bit
parameters, 2 bytes of 16-bit gradients and K bytes of optimizer state per parameter (K = 12 for Adam:
fp32 master 4 + momentum 4 + variance 4); stage 1 partitions the optimizer state over the N data-parallel
ranks, stage 2 also the gradients, stage 3 also the parameters. On top of that we count what our engine
really keeps: an fp32 gradient partition for the optimizer, pinned staging buffers for NVMe swapping,
the gathered layers of stage 3, and activations. Where each piece lives is ENGINE_PLACEMENT
(offload.estimate.placement); what an estimate is made for is a TrainingSetup (offload.estimate.setup) and
what it gives a MemoryEstimate (offload.estimate.result).

Every formula of the estimate stays here in one place, per stage and tier, so a change of the engine's
placement is made (and reviewed) against all of them at once.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Tuple

from .activations import activation_placement
from .placement import (
    COMPONENTS,
    ENGINE_PLACEMENT,
    FP32_BYTES,
    check_combination,
    valid_combinations,
)
from .result import MemoryEstimate
from .setup import SwapBufferSettings, TrainingSetup, layers

_TIERS = ("gpu", "cpu_pinned", "cpu_pageable", "nvme")


def _nvme_copies(
    setup: TrainingSetup, one_copy: int, nvme_free_bytes: Optional[int], notes: List[str]
) -> int:
    """Copies of the NVMe optimizer state the engine keeps (offload_optimizer.nvme_copies) for a rank whose
    one copy is `one_copy` bytes; `nvme_free_bytes`: per node, or None (unknown: room for two)."""
    choice = setup.buffers.optimizer_nvme_copies
    if choice == 1:
        return 1
    need_two = (
        ENGINE_PLACEMENT.optimizer_nvme_copies
        * one_copy
        * ENGINE_PLACEMENT.stage3_nvme_copies_headroom
        * setup.gpus_per_node
    )
    if nvme_free_bytes is None or need_two <= nvme_free_bytes:
        return 2
    if choice == 2:
        notes.append(
            f"nvme_copies 2 needs {int(need_two)} bytes at nvme_path ({nvme_free_bytes} free): the engine "
            "refuses to start"
        )
        return 2
    notes.append(
        "nvme_path cannot hold two copies of the optimizer state: the engine updates one copy in "
        "place (a step that fails half way cannot be rolled back)"
    )
    return 1


class _Ledger:
    """Per-rank bytes by tier and component."""

    def __init__(self) -> None:
        self.bytes = {tier: dict.fromkeys(COMPONENTS, 0) for tier in _TIERS}

    def add(self, tier: str, component: str, nbytes: int) -> None:
        """Count nbytes of component in tier."""
        self.bytes[tier][component] += int(nbytes)


def _host_tier(pinned: bool) -> str:
    return "cpu_pinned" if pinned else "cpu_pageable"


def _stage3(
    setup: TrainingSetup,
    offload_optimizer: str,
    offload_param: str,
    nvme_free_bytes: Optional[int],
    ledger: _Ledger,
    notes: List[str],
) -> Tuple[int, int, int]:
    """Stage 3 as the engine allocates it (zero/layout/units.py), per rank. Returns (NVMe read bytes per
    step, NVMe write bytes per step, NVMe bytes the optimizer state would shrink by with one copy instead of
    two)."""
    plan = ENGINE_PLACEMENT
    n, bufs, cb = setup.world_size, setup.buffers, setup.compute_bytes
    mixed, state_bytes = setup.mixed_precision, setup.optimizer_state_bytes
    part = math.ceil(setup.params / n)
    layer_part = math.ceil(setup.largest_layer_params / n)
    param_component = "params_16bit" if mixed else "master_params_fp32"
    grad_component = "grads_16bit" if mixed else "grads_fp32"
    opt_home = plan.optimizer_homes[offload_optimizer]["master_params_fp32"]
    host_opt = _host_tier(bufs.optimizer_pin_memory)
    nvme_read = nvme_write = 0

    # Parameter partitions in their tier (NVMe: up to max_in_cpu elements stay in host memory), and
    # the gathered layers on the GPU.
    on_nvme = 0
    if offload_param == "nvme":
        in_cpu = bufs.param_in_cpu(layers(part, max(1, layer_part)), cb)
        on_nvme = part - in_cpu
        ledger.add(_host_tier(bufs.param_pin_memory), param_component, in_cpu * cb)
        ledger.add("nvme", param_component, on_nvme * cb)
    else:
        home = plan.param_homes[offload_param]
        ledger.add(_host_tier(bufs.param_pin_memory) if home == "cpu" else home, param_component, part * cb)
    if not (offload_param == "none" and n == 1):  # one rank, partitions on the GPU: they are the layers
        ledger.add("gpu", param_component, plan.stage3_live_layers * setup.largest_layer_params * cb)

    # Gradients: one unit's full gradient on the GPU until its reduce-scatter, then the rank's partition
    # accumulated in the compute dtype where the optimizer reads it (pinned host memory when offloaded).
    ledger.add("gpu", grad_component, plan.grad_bucket_layers * setup.largest_layer_params * cb)
    grad_bytes = cb if plan.stage3_grad_partition_in_compute_dtype else FP32_BYTES
    grad_tier = "gpu" if offload_optimizer == "none" else "cpu_pinned"
    ledger.add(grad_tier, grad_component if grad_bytes == cb else "grads_fp32", part * grad_bytes)

    # Optimizer: fp32 master (its own copy at stage 3) and states.
    chunk = min(bufs.sub_group_size, part)
    if offload_optimizer == "nvme":
        chunk = setup.nvme_chunk(part)
    n_chunks = math.ceil(part / chunk)
    spare_copies = 0
    scales = setup.optimizer_scale_bytes(part)
    if offload_optimizer == "nvme":
        # swap files hold whole chunk regions [master | states] (the engine pads each to 4 KiB: not counted)
        region = chunk * (FP32_BYTES + state_bytes) + setup.optimizer_scale_bytes(chunk)
        copies = _nvme_copies(setup, part * (FP32_BYTES + state_bytes) + scales, nvme_free_bytes, notes)
        ledger.add("nvme", "master_params_fp32", copies * n_chunks * chunk * FP32_BYTES)
        ledger.add("nvme", "optimizer_states", copies * n_chunks * (region - chunk * FP32_BYTES))
        spare_copies = (copies - 1) * n_chunks * region
        slots = min(bufs.optimizer_buffer_count, n_chunks)
        ledger.add("cpu_pinned", "swap_buffers", slots * region)
        if 2 * slots * region > part * (FP32_BYTES + state_bytes):
            notes.append(
                f"optimizer swap buffers ({slots} x {chunk} elements) are over "
                "half the state they stage, so NVMe saves little host memory: lower sub_group_size (e.g. 1e8)"
            )
        nvme_read += part * (FP32_BYTES + state_bytes) + scales
        nvme_write += part * (FP32_BYTES + state_bytes) + scales
    else:
        tier = host_opt if opt_home == "cpu" else opt_home
        ledger.add(tier, "master_params_fp32", part * FP32_BYTES)
        ledger.add(tier, "optimizer_states", part * state_bytes + scales)

    # Staging: updated 16-bit weights pass through one pageable chunk; NVMe units are assembled in a
    # pageable buffer of one partition, each held until its write ended (up to aio.queue_depth writes in
    # flight, one more being assembled; never more than the NVMe partitions themselves), and read through
    # pinned slots of the largest layer's partition.
    if mixed:
        ledger.add("cpu_pageable", "swap_buffers", plan.stage3_writer_chunks * chunk * cb)
    if on_nvme:
        held = min((bufs.aio_queue_depth + 1) * layer_part, on_nvme + layer_part)
        ledger.add("cpu_pageable", "swap_buffers", held * cb)
        slot = min(bufs.param_buffer_size, layer_part)
        ledger.add("cpu_pinned", "swap_buffers", bufs.param_buffer_count * slot * cb)
        nvme_read += 2 * on_nvme * cb
        nvme_write += on_nvme * cb
    return nvme_read, nvme_write, spare_copies


def grad_bucket_numel(bufs: SwapBufferSettings, params: int, largest_layer: int) -> int:
    """Elements of stage 2's gradient buckets on the GPU (zero/layout/grad_buckets.py): one bucket, two
    with overlap_comm, of reduce_bucket_size elements but never more than the model (size 0: one bucket
    per parameter, the largest one's size)."""
    size = bufs.reduce_bucket_size
    capacity = min(size, params) if size > 0 else largest_layer
    return (2 if bufs.overlap_comm else 1) * capacity


def estimate(
    setup: TrainingSetup,
    stage: int,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    nvme_free_bytes: Optional[int] = None,
) -> MemoryEstimate:
    """Bytes per GPU, per node's host memory (pinned and pageable) and per node's NVMe for one setting.

    `nvme_free_bytes` (free space at nvme_path, per node): with `nvme_copies` "auto" the engine keeps one
    copy of the NVMe optimizer state instead of two when the disk cannot hold two; given, the estimate does
    the same. `nvme_min_bytes` is the NVMe needed with one copy either way."""
    check_combination(stage, offload_optimizer, offload_param)
    if stage == 3:
        return _estimate_stage3(setup, offload_optimizer, offload_param, nvme_free_bytes)
    plan = ENGINE_PLACEMENT
    partitioned_from = plan.partitioned_from_stage
    opt_home = plan.optimizer_homes[offload_optimizer]
    param_home = plan.param_homes[offload_param]

    n = setup.world_size
    P = setup.params
    L = setup.largest_layer_params
    bufs = setup.buffers
    mixed = setup.mixed_precision
    cb = setup.compute_bytes
    state_bytes = setup.optimizer_state_bytes

    def partition(count: int, kind: str) -> int:
        return math.ceil(count / n) if stage >= partitioned_from[kind] else count

    def tier_of(home: str, pinned: bool) -> str:
        return _host_tier(pinned) if home == "cpu" else home

    ledger = _Ledger()
    notes: List[str] = []
    param_component = "params_16bit" if mixed else "master_params_fp32"
    grad_component = "grads_16bit" if mixed else "grads_fp32"

    # Parameters as the model computes with them: 16-bit copies, or the fp32 params themselves.
    param_part = partition(P, "params")
    param_tier = tier_of(param_home, bufs.param_pin_memory)
    ledger.add(param_tier, param_component, param_part * cb)
    if stage == 3:
        ledger.add("gpu", param_component, plan.stage3_live_layers * L * cb)

    # Gradients as backward produces them, on the GPU. From stage 2 only the buckets they pass through
    # and the rank's partition are kept, and with an offloaded optimizer not even the partition: each
    # reduced bucket goes straight to the host.
    if stage < partitioned_from["grads"] or (plan.full_grad_buffer_on_gpu and stage < 3):
        ledger.add("gpu", grad_component, P * cb)
    else:
        ledger.add("gpu", grad_component, grad_bucket_numel(bufs, P, L) * cb)
        if offload_optimizer == "none":
            ledger.add("gpu", grad_component, partition(P, "grads") * cb)

    # Optimizer: fp32 master, states and fp32 gradients of the rank's partition.
    opt_part = partition(P, "optimizer")
    master_tier = tier_of(opt_home["master_params_fp32"], bufs.optimizer_pin_memory)
    states_tier = tier_of(opt_home["optimizer_states"], bufs.optimizer_pin_memory)
    grads32_tier = tier_of(opt_home["grads_fp32"], bufs.optimizer_pin_memory)
    # In fp32 training the compute params are the master: a second copy exists only when the optimizer
    # keeps its partition in another tier than the parameters. Likewise for fp32 gradients.
    sub_group = bufs.sub_group_size
    if plan.cap_swap_buffers_to_partition:
        sub_group = min(sub_group, opt_part)
    if offload_optimizer == "nvme":  # the swapper's chunk: what files are padded to and slots hold
        sub_group = setup.nvme_chunk(opt_part)
    n_sub_groups = math.ceil(opt_part / sub_group)
    spare_copy = None
    scales = setup.optimizer_scale_bytes(sub_group)
    if offload_optimizer == "nvme":
        # Swap files hold whole sub-group regions (the last one padded), in nvme_copies copies.
        one = opt_part * (FP32_BYTES + state_bytes) + setup.optimizer_scale_bytes(opt_part)
        copies = _nvme_copies(setup, one, nvme_free_bytes, notes)
        stored = copies * n_sub_groups * sub_group
        spare_copy = (copies - 1) * n_sub_groups * (sub_group * (FP32_BYTES + state_bytes) + scales)
        scales *= copies * n_sub_groups
    else:
        stored = opt_part
        scales = setup.optimizer_scale_bytes(opt_part)
    if mixed or master_tier != param_tier:
        ledger.add(master_tier, "master_params_fp32", stored * FP32_BYTES)
    ledger.add(states_tier, "optimizer_states", stored * state_bytes + scales)
    if mixed or grads32_tier != "gpu":
        ledger.add(grads32_tier, "grads_fp32", opt_part * FP32_BYTES)

    # Pinned staging buffers (always pinned: DMA and O_DIRECT I/O go through them).
    if offload_optimizer != "none":
        ledger.add("cpu_pinned", "swap_buffers", plan.param_copy_back_slots * sub_group * cb)
        if stage >= partitioned_from["grads"] and not plan.full_grad_buffer_on_gpu:
            # stage 2: each gradient bucket has a pinned staging twin it reaches the host through
            ledger.add("cpu_pinned", "swap_buffers", grad_bucket_numel(bufs, P, L) * cb)
    nvme_read = nvme_write = 0
    if offload_optimizer == "nvme":
        slots = bufs.optimizer_buffer_count
        if plan.cap_swap_buffers_to_partition:
            slots = min(slots, n_sub_groups)
        staged_bytes = FP32_BYTES + state_bytes
        buffer_bytes = slots * (sub_group * staged_bytes + setup.optimizer_scale_bytes(sub_group))
        ledger.add("cpu_pinned", "swap_buffers", buffer_bytes)
        if 2 * buffer_bytes > opt_part * staged_bytes:
            notes.append(
                f"optimizer swap buffers ({slots} x {sub_group} elements) are over "
                "half the state they stage, so NVMe saves little host memory: lower sub_group_size (e.g. 1e8)"
            )
        # Each step reads and writes back master + states of the whole partition.
        nvme_read += opt_part * (FP32_BYTES + state_bytes) + setup.optimizer_scale_bytes(opt_part)
        nvme_write += opt_part * (FP32_BYTES + state_bytes) + setup.optimizer_scale_bytes(opt_part)
    if offload_param == "nvme":
        buffer_elems = bufs.param_buffer_size
        if plan.cap_swap_buffers_to_partition:
            buffer_elems = min(buffer_elems, param_part)
        ledger.add("cpu_pinned", "swap_buffers", bufs.param_buffer_count * buffer_elems * cb)
        # Forward and backward each read the partition; the update writes it once.
        nvme_read += 2 * param_part * cb
        nvme_write += param_part * cb
        largest_param_partition = math.ceil(L / n)
        if bufs.param_buffer_size < largest_param_partition:
            notes.append(
                f"offload_param.buffer_size {bufs.param_buffer_size} is smaller than the largest layer's "
                f"partition ({largest_param_partition} elements); raise it"
            )

    read, write = _add_activations(ledger, setup, cb)
    nvme_read, nvme_write = nvme_read + read, nvme_write + write

    return _estimate_from(
        setup, ledger, stage, offload_optimizer, offload_param, nvme_read, nvme_write, notes, spare_copy
    )


def _estimate_from(
    setup: TrainingSetup,
    ledger: _Ledger,
    stage: int,
    offload_optimizer: str,
    offload_param: str,
    nvme_read: int,
    nvme_write: int,
    notes: List[str],
    spare_copy: Optional[int] = None,
) -> MemoryEstimate:
    """The per-rank ledger as a MemoryEstimate: GPU per rank, host memory and NVMe per node (shared by the
    node's ranks). `spare_copy`: NVMe bytes per rank a one-copy optimizer state would not need."""
    per_node = setup.gpus_per_node
    scaled = {
        tier: {name: value * (1 if tier == "gpu" else per_node) for name, value in ledger.bytes[tier].items()}
        for tier in _TIERS
    }
    nvme_min = None if spare_copy is None else sum(scaled["nvme"].values()) - spare_copy * per_node
    return MemoryEstimate(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        gpu=scaled["gpu"],
        cpu_pinned=scaled["cpu_pinned"],
        cpu_pageable=scaled["cpu_pageable"],
        nvme=scaled["nvme"],
        nvme_read_bytes_per_step=nvme_read * per_node,
        nvme_write_bytes_per_step=nvme_write * per_node,
        notes=tuple(notes),
        nvme_min_bytes_value=nvme_min,
    )


def _estimate_stage3(
    setup: TrainingSetup, offload_optimizer: str, offload_param: str, nvme_free_bytes: Optional[int]
) -> MemoryEstimate:
    ledger = _Ledger()
    notes: List[str] = []
    read, write, spare_copy = _stage3(setup, offload_optimizer, offload_param, nvme_free_bytes, ledger, notes)
    bufs = setup.buffers
    layer_part = math.ceil(setup.largest_layer_params / setup.world_size)
    if offload_param == "nvme" and bufs.param_buffer_size < layer_part:
        notes.append(
            f"offload_param.buffer_size {bufs.param_buffer_size} is smaller than the largest layer's "
            f"partition ({layer_part} elements): such partitions are prefetched in pieces over several "
            "buffers and copied out of them"
        )
    act_read, act_write = _add_activations(ledger, setup, setup.compute_bytes)
    return _estimate_from(
        setup,
        ledger,
        3,
        offload_optimizer,
        offload_param,
        read + act_read,
        write + act_write,
        notes,
        spare_copy,
    )


def _add_activations(ledger: _Ledger, setup: TrainingSetup, element_bytes: int) -> Tuple[int, int]:
    """Activations into the ledger, each tier its share; returns the NVMe bytes one micro-batch's
    checkpoints read and write (with gradient accumulation, every micro-batch moves its own)."""
    if setup.activations is None:
        return 0, 0
    place = activation_placement(setup.activations, element_bytes)
    for tier in ("gpu", "cpu_pinned", "nvme"):
        ledger.add(tier, "activations", place[tier])
    return place["nvme_read"], place["nvme_write"]


def estimate_all(
    setup: TrainingSetup,
    stages: Optional[Iterable[int]] = None,
    offload_optimizers: Optional[Iterable[str]] = None,
    offload_params: Optional[Iterable[str]] = None,
) -> List[MemoryEstimate]:
    """Estimates for every valid combination among the given choices (None = all choices)."""
    return [
        estimate(setup, stage, opt, par)
        for stage, opt, par in valid_combinations(stages, offload_optimizers, offload_params)
    ]


def largest_layer_heuristic(params: int) -> int:
    """A conservative guess of the largest single module when only the total is known.

    Assumes a GPT-style decoder with P = 12 * layers * hidden^2 and hidden = 128 * layers (the aspect
    ratio of GPT-3 175B and LLaMA-7B), and takes the larger of a 4h x h MLP projection and a
    32000-token embedding. Real embeddings are often smaller (T5-3B: 33M against 100M here), so the
    guess errs high; it only feeds working buffers. Capped at P.
    """
    layers = (params / (12 * 128 * 128)) ** (1.0 / 3.0)
    hidden = 128.0 * layers
    guess = int(max(4.0 * hidden * hidden, 32000.0 * hidden))
    return max(1, min(params, guess))
