"""Model-state, buffer and activation bytes per GPU, per node's CPU memory and per node's NVMe.

ZeRO's accounting (Rajbhandari et al. 2020): mixed-precision training keeps 2 bytes of 16-bit
parameters, 2 bytes of 16-bit gradients and K bytes of optimizer state per parameter (K = 12 for Adam:
fp32 master 4 + momentum 4 + variance 4); stage 1 partitions the optimizer state over the N data-parallel
ranks, stage 2 also the gradients, stage 3 also the parameters. On top of that we count what our engine
really keeps: an fp32 gradient partition for the optimizer, pinned staging buffers for NVMe swapping,
the gathered layers of stage 3, and activations. Where each piece lives is ENGINE_PLACEMENT below.

The module is long because it holds every formula of the estimate in one place, per stage and tier, so a
change of the engine's placement is made (and reviewed) against all of them at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, Union

# the engine's slot sizing
from offload.swap.slots import MIN_SLOT_NUMEL, QUANT_BLOCK, state_chunk, swap_chunk  # noqa: F401

from .activations import ActivationSettings, activation_placement
from .errors import EstimateInputError

COMPONENTS: Tuple[str, ...] = (
    "params_16bit",
    "grads_16bit",
    "master_params_fp32",
    "optimizer_states",
    "grads_fp32",
    "swap_buffers",
    "activations",
)
STAGES: Tuple[int, ...] = (0, 1, 2, 3)
OFFLOAD_DEVICES: Tuple[str, ...] = ("none", "cpu", "nvme")
PRECISIONS: Tuple[str, ...] = ("bf16", "fp16", "fp32")
# Elements of optimizer state per parameter. sgd counts its momentum buffer (torch's SGD with
# momentum=0 keeps none; the estimate is then 4 bytes/param high for the states).
OPTIMIZER_STATES_PER_PARAM: Dict[str, int] = {"adam": 2, "adamw": 2, "adagrad": 1, "lion": 1, "sgd": 1}
# Bytes per element of each optimizer-state dtype (optimizer.params.state_dtype); int8 states also keep one
# fp32 absmax per QUANT_BLOCK elements of each state (TrainingSetup.optimizer_scale_bytes).
STATE_DTYPE_BYTES: Dict[str, int] = {"fp32": 4, "bf16": 2, "int8": 1}
NVME_COPIES: Tuple[Union[str, int], ...] = ("auto", 1, 2)
FP32_BYTES = 4

# ---------------------------------------------------------------------------------------------------
# ENGINE_PLACEMENT: where the engine keeps each piece of state. THE table to adjust when the engine's
# design changes; docs/estimator.md describes the same table. Tiers: "gpu", "cpu" (host memory, pinned
# or pageable per the offload section's pin_memory), "nvme" (swap files).
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnginePlacement:
    # ZeRO stage from which each state is split over the data-parallel ranks (below it: a full copy).
    """Where the engine keeps each state, per stage and offload setting: what the estimate follows."""

    partitioned_from_stage: Mapping[str, int]
    # offload_optimizer -> home of the fp32 master, the optimizer states and the fp32 gradient partition.
    optimizer_homes: Mapping[str, Mapping[str, str]]
    # offload_param -> home of the rank's parameter partition (stage 3).
    param_homes: Mapping[str, str]
    # Stages at which each offload is accepted.
    offload_optimizer_stages: Tuple[int, ...]
    offload_param_stages: Tuple[int, ...]
    # Stage 3 working set on the GPU: gathered full layers (the current one plus prefetched ones).
    stage3_live_layers: int
    # Stage 3: this many layers' gradients wait on the GPU, for the copy to the host partition or the
    # reduce-scatter.
    grad_bucket_layers: int
    # True: one flat 16-bit gradient buffer for the whole model stays on the GPU at stages 0-2, so stage 2
    # saves no gradient memory on the GPU (the engine's first design). False (zero/layout/grad_buckets.py):
    # ZeRO's stage-2 accounting - gradients pass through buckets of reduce_bucket_size elements (two with
    # overlap_comm, one otherwise, never larger than the model; one parameter's worth with size 0), and the
    # rank's partition stays on the GPU (model dtype) only when the optimizer is not offloaded. Stages 0-1
    # keep the full buffer either way (DeepSpeed's stage 1). Measured on a GPU by tests/test_cuda_estimate.py.
    full_grad_buffer_on_gpu: bool
    # Host copies of offloaded state are pinned unless the config says pin_memory: false.
    pin_memory_default: bool
    # An NVMe staging buffer is never larger than the rank's partition it stages, and there are never
    # more optimizer staging slots than sub-groups to stage.
    cap_swap_buffers_to_partition: bool
    # Copies of master + states kept on NVMe with nvme_copies "auto" or 2: the swapper writes each step's
    # result to the other copy and switches only when the whole step succeeded, so a failed step leaves the
    # previous state intact (SwapBufferSettings.optimizer_nvme_copies chooses; _nvme_copies).
    optimizer_nvme_copies: int
    # With the optimizer off the GPU, updated parameters go back to the GPU through this many pinned
    # staging slots of one sub-group each (compute dtype). Stages 0-2 only: stage 3 writes updated weights
    # into the parameter partitions through one pageable chunk (below).
    param_copy_back_slots: int
    # Stage 3 (zero/layout/units.py): the gradient partition is accumulated in the compute dtype (16-bit
    # for mixed precision, no fp32 copy) in the optimizer's tier (pinned host memory when offloaded).
    stage3_grad_partition_in_compute_dtype: bool
    # Stage 3: the fp32 master is always its own copy (the parameter partitions live in their own tier,
    # 16-bit or fp32), so fp32 training keeps the parameters twice.
    stage3_master_separate: bool
    # NVMe optimizer state (every stage) with nvme_copies "auto": the engine keeps optimizer_nvme_copies
    # copies when nvme_path has room for them plus this headroom, else updates one copy in place.
    stage3_nvme_copies_headroom: float
    # Stage 3 updated-weights staging: one chunk of min(sub_group_size, partition) compute-dtype elements in
    # pageable host memory (mixed precision only), and with NVMe parameters one pageable buffer of the
    # largest layer's partition to assemble a unit before its swap file is written.
    stage3_writer_chunks: int


ENGINE_PLACEMENT = EnginePlacement(
    partitioned_from_stage={"optimizer": 1, "grads": 2, "params": 3},
    # With NVMe, master + states live in swap files and stream through pinned staging buffers of
    # buffer_count x swap_chunk() elements x (4 + state bytes), DeepSpeed's buffer_count x sub_group x 4
    # bytes; the fp32 gradient partition stays in host memory (accumulated during backward, read by the
    # step).
    optimizer_homes={
        "none": {"master_params_fp32": "gpu", "optimizer_states": "gpu", "grads_fp32": "gpu"},
        "cpu": {"master_params_fp32": "cpu", "optimizer_states": "cpu", "grads_fp32": "cpu"},
        "nvme": {"master_params_fp32": "nvme", "optimizer_states": "nvme", "grads_fp32": "cpu"},
    },
    # With NVMe the host holds pinned read buffers of buffer_count x buffer_size compute-dtype elements.
    param_homes={"none": "gpu", "cpu": "cpu", "nvme": "nvme"},
    offload_optimizer_stages=(1, 2, 3),
    offload_param_stages=(3,),
    stage3_live_layers=2,
    grad_bucket_layers=1,
    full_grad_buffer_on_gpu=False,
    pin_memory_default=True,
    cap_swap_buffers_to_partition=True,
    optimizer_nvme_copies=2,
    param_copy_back_slots=2,
    stage3_grad_partition_in_compute_dtype=True,
    stage3_master_separate=True,
    stage3_nvme_copies_headroom=1.05,
    stage3_writer_chunks=1,
)


# DeepSpeed's defaults for the swap-buffer settings (our config schema is DeepSpeed-compatible).
DEFAULT_OPTIMIZER_BUFFER_COUNT = 4
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
DEFAULT_PARAM_BUFFER_COUNT = 5
DEFAULT_PARAM_BUFFER_SIZE = 100_000_000
DEFAULT_PARAM_MAX_IN_CPU = 1_000_000_000
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000

_TIERS = ("gpu", "cpu_pinned", "cpu_pageable", "nvme")


@dataclass(frozen=True)
class SwapBufferSettings:
    """The buffer settings of a DeepSpeed-style config (zero_optimization.offload_* and sub_group_size)."""

    optimizer_buffer_count: int = DEFAULT_OPTIMIZER_BUFFER_COUNT
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    param_buffer_count: int = DEFAULT_PARAM_BUFFER_COUNT
    param_buffer_size: int = DEFAULT_PARAM_BUFFER_SIZE
    optimizer_pin_memory: bool = ENGINE_PLACEMENT.pin_memory_default
    param_pin_memory: bool = ENGINE_PLACEMENT.pin_memory_default
    # offload_param.max_in_cpu: with NVMe parameters, partitions of up to this many elements in all stay
    # in host memory (DeepSpeed's default 1e9 keeps a model under 1e9 parameters off the disk entirely).
    param_max_in_cpu: int = DEFAULT_PARAM_MAX_IN_CPU
    # offload_optimizer.nvme_copies: "auto" (two when nvme_path has room, else one), 1 or 2
    optimizer_nvme_copies: Union[str, int] = "auto"
    # zero_optimization.reduce_bucket_size / overlap_comm: stage 2's gradient buckets on the GPU.
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE
    overlap_comm: bool = False

    def __post_init__(self) -> None:
        if self.optimizer_nvme_copies not in NVME_COPIES or isinstance(self.optimizer_nvme_copies, bool):
            raise EstimateInputError(
                f'optimizer_nvme_copies must be "auto", 1 or 2, got {self.optimizer_nvme_copies!r}'
            )
        for name in ("optimizer_buffer_count", "sub_group_size", "param_buffer_count", "param_buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateInputError(f"buffer setting {name} must be a positive integer, got {value!r}")
        for name in ("param_max_in_cpu", "reduce_bucket_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise EstimateInputError(f"buffer setting {name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class TrainingSetup:
    """Everything that does not change between the rows of one estimate."""

    params: int
    largest_layer_params: int
    gpus_per_node: int = 1
    nodes: int = 1
    precision: str = "bf16"
    optimizer: str = "adam"
    optimizer_state_dtype: str = "fp32"
    buffers: SwapBufferSettings = field(default_factory=SwapBufferSettings)
    activations: Optional[ActivationSettings] = None

    def __post_init__(self) -> None:
        for name in ("params", "largest_layer_params", "gpus_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateInputError(f"{name} must be a positive integer, got {value!r}")
        if self.largest_layer_params > self.params:
            raise EstimateInputError(
                f"largest_layer_params ({self.largest_layer_params}) exceeds params ({self.params})"
            )
        if self.precision not in PRECISIONS:
            raise EstimateInputError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.optimizer not in OPTIMIZER_STATES_PER_PARAM:
            raise EstimateInputError(
                f"optimizer must be one of {', '.join(OPTIMIZER_STATES_PER_PARAM)}, got {self.optimizer!r}"
            )
        if self.optimizer_state_dtype not in STATE_DTYPE_BYTES:
            raise EstimateInputError(
                f"optimizer_state_dtype must be one of {', '.join(STATE_DTYPE_BYTES)}, "
                f"got {self.optimizer_state_dtype!r}"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def mixed_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def compute_bytes(self) -> int:
        """Bytes of a parameter or gradient element as the model computes with it."""
        return 2 if self.mixed_precision else FP32_BYTES

    @property
    def optimizer_state_bytes(self) -> int:
        """K without the master copy: optimizer state bytes per parameter."""
        return OPTIMIZER_STATES_PER_PARAM[self.optimizer] * STATE_DTYPE_BYTES[self.optimizer_state_dtype]

    def optimizer_scale_bytes(self, numel: int) -> int:
        """int8 states: the fp32 absmax scales of `numel` elements' states (0 for other dtypes)."""
        if self.optimizer_state_dtype != "int8":
            return 0
        return OPTIMIZER_STATES_PER_PARAM[self.optimizer] * FP32_BYTES * math.ceil(numel / QUANT_BLOCK)

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Master + states per parameter (int8: with the scales), as the tiers hold them: 12 for fp32 Adam,
        8 for bf16, 6 + 8/QUANT_BLOCK for int8."""
        scales = self.optimizer_scale_bytes(QUANT_BLOCK) / QUANT_BLOCK
        return FP32_BYTES + self.optimizer_state_bytes + scales

    def nvme_chunk(self, part: int) -> int:
        """Elements per chunk of NVMe optimizer state (the engine's `state_chunk`)."""
        n_states = OPTIMIZER_STATES_PER_PARAM[self.optimizer]
        return state_chunk(self.buffers.sub_group_size, part, n_states, self.optimizer_state_dtype)


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
        return {name: self.cpu_pinned[name] + self.cpu_pageable[name] for name in COMPONENTS}

    @property
    def per_gpu_bytes(self) -> int:
        return sum(self.gpu.values())

    @property
    def per_cpu_pinned_bytes(self) -> int:
        return sum(self.cpu_pinned.values())

    @property
    def per_cpu_pageable_bytes(self) -> int:
        return sum(self.cpu_pageable.values())

    @property
    def per_cpu_bytes(self) -> int:
        return self.per_cpu_pinned_bytes + self.per_cpu_pageable_bytes

    @property
    def nvme_bytes(self) -> int:
        return sum(self.nvme.values())

    @property
    def nvme_min_bytes(self) -> int:
        return self.nvme_bytes if self.nvme_min_bytes_value is None else self.nvme_min_bytes_value

    @property
    def options(self) -> str:
        return (
            f"stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
            f"offload_param={self.offload_param}"
        )

    def to_dict(self) -> Dict[str, object]:
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


def check_combination(stage: int, offload_optimizer: str, offload_param: str) -> None:
    """Raise EstimateInputError with the reason when this stage/offload combination is not valid."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise EstimateInputError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    for name, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device not in OFFLOAD_DEVICES:
            raise EstimateInputError(f"{name} must be none, cpu or nvme, got {device!r}")
    if offload_param != "none" and stage not in ENGINE_PLACEMENT.offload_param_stages:
        raise EstimateInputError(
            f"offload_param={offload_param} needs ZeRO stage 3 (stages 0-2 keep the full parameters on "
            f"every GPU, so there is no partition to offload), got stage {stage}"
        )
    if offload_optimizer != "none" and stage not in ENGINE_PLACEMENT.offload_optimizer_stages:
        raise EstimateInputError(
            f"offload_optimizer={offload_optimizer} needs ZeRO stage 1, 2 or 3 (stage 0 does not partition "
            f"the optimizer), got stage {stage}"
        )


def valid_combinations(
    stages: Optional[Iterable[int]] = None,
    offload_optimizers: Optional[Iterable[str]] = None,
    offload_params: Optional[Iterable[str]] = None,
) -> List[Tuple[int, str, str]]:
    """Every valid (stage, offload_optimizer, offload_param) among the given choices (None = all)."""
    combos = []
    for stage in STAGES if stages is None else stages:
        for opt in OFFLOAD_DEVICES if offload_optimizers is None else offload_optimizers:
            for par in OFFLOAD_DEVICES if offload_params is None else offload_params:
                try:
                    check_combination(stage, opt, par)
                except EstimateInputError:
                    continue
                combos.append((stage, opt, par))
    return combos


class _Ledger:
    """Per-rank bytes by tier and component."""

    def __init__(self) -> None:
        self.bytes = {tier: dict.fromkeys(COMPONENTS, 0) for tier in _TIERS}

    def add(self, tier: str, component: str, nbytes: int) -> None:
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
        in_cpu = min(bufs.param_max_in_cpu, part)
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
    # pageable buffer of one partition and read through pinned slots of the largest layer's partition.
    if mixed:
        ledger.add("cpu_pageable", "swap_buffers", plan.stage3_writer_chunks * chunk * cb)
    if on_nvme:
        ledger.add("cpu_pageable", "swap_buffers", layer_part * cb)
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
