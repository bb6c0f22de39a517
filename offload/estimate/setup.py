"""What one estimate is made for: the model's size, the machine's ranks, the precision and optimizer
(TrainingSetup) and the buffer settings of a DeepSpeed-style config (SwapBufferSettings), checked as they
are built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from offload.config.aio import AioConfig
from offload.config.zero import OffloadParamConfig
from offload.swap.resident import auto_resident_numel
from offload.swap.slots import QUANT_BLOCK, state_chunk  # the engine's slot sizing

from .activations import ActivationSettings
from .errors import EstimateInputError
from .placement import (
    ENGINE_PLACEMENT,
    FP32_BYTES,
    NVME_COPIES,
    OPTIMIZER_STATES_PER_PARAM,
    PRECISIONS,
    STATE_DTYPE_BYTES,
)

__all__ = ["SwapBufferSettings", "TrainingSetup", "layers"]

# DeepSpeed's defaults for the swap-buffer settings (our config schema is DeepSpeed-compatible).
DEFAULT_OPTIMIZER_BUFFER_COUNT = 4
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
DEFAULT_PARAM_BUFFER_COUNT = 5
DEFAULT_PARAM_BUFFER_SIZE = 100_000_000
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000


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
    # in host memory; "auto" (the engine's default): what fits in the pinned budget (`param_in_cpu`)
    param_max_in_cpu: Union[int, str] = OffloadParamConfig.max_in_cpu
    # offload_optimizer.nvme_copies: "auto" (two when nvme_path has room, else one), 1 or 2
    optimizer_nvme_copies: Union[str, int] = "auto"
    # zero_optimization.reduce_bucket_size / overlap_comm: stage 2's gradient buckets on the GPU.
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE
    overlap_comm: bool = False
    # aio.queue_depth: with NVMe parameters, how many updated units' writes the optimizer pass leaves in
    # flight, each holding its assembled pageable buffer until it ended (zero.stage3.write_back)
    aio_queue_depth: int = AioConfig.queue_depth

    def __post_init__(self) -> None:
        if self.optimizer_nvme_copies not in NVME_COPIES or isinstance(self.optimizer_nvme_copies, bool):
            raise EstimateInputError(
                f'optimizer_nvme_copies must be "auto", 1 or 2, got {self.optimizer_nvme_copies!r}'
            )
        for name in (
            "optimizer_buffer_count",
            "sub_group_size",
            "param_buffer_count",
            "param_buffer_size",
            "aio_queue_depth",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateInputError(f"buffer setting {name} must be a positive integer, got {value!r}")
        for name in ("param_max_in_cpu", "reduce_bucket_size"):
            value = getattr(self, name)
            if name == "param_max_in_cpu" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                allowed = '"auto" or ' if name == "param_max_in_cpu" else ""
                raise EstimateInputError(
                    f"buffer setting {name} must be {allowed}an integer >= 0, got {value!r}"
                )

    def param_in_cpu(self, numels: Sequence[int], itemsize: int, pinned_budget: Optional[int] = None) -> int:
        """`param_max_in_cpu` as elements of the partitions `numels` (`itemsize` bytes each) kept in host
        memory: a count as given (at most all of them); "auto" as the engine resolves it
        (offload.swap.resident.auto_resident_numel) against `pinned_budget` bytes (None: this process's
        budget, offload.pinned.default_pinned_budget)."""
        total = sum(numels)
        if self.param_max_in_cpu != "auto":
            return min(int(self.param_max_in_cpu), total)
        if pinned_budget is None:
            from offload.pinned import default_pinned_budget

            pinned_budget = default_pinned_budget()
        return auto_resident_numel(
            numels, itemsize, pinned_budget, self.param_buffer_count, self.param_buffer_size
        )


def layers(numel: int, largest: int) -> List[int]:
    """`numel` elements as partitions of the largest layer's size (the last one what is left): the unit
    sizes `max_in_cpu: "auto"` is resolved over when the model's modules are not known one by one."""
    whole, rest = divmod(numel, max(1, largest))
    return [largest] * whole + ([rest] if rest else [])


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
        """Data-parallel ranks: GPUs per node times nodes."""
        return self.gpus_per_node * self.nodes

    @property
    def mixed_precision(self) -> bool:
        """Whether the model computes in 16 bits (bf16 or fp16)."""
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
