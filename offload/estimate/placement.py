"""Where the engine keeps each piece of training state (ENGINE_PLACEMENT) and which stage / offload
combinations it accepts: the table the estimate's formulas (offload.estimate.formulas) follow, and the
vocabulary they share (components, stages, tiers, bytes per optimizer state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, Union

from .errors import EstimateInputError

__all__ = [
    "COMPONENTS",
    "ENGINE_PLACEMENT",
    "FP32_BYTES",
    "NVME_COPIES",
    "OFFLOAD_DEVICES",
    "OPTIMIZER_STATES_PER_PARAM",
    "PRECISIONS",
    "STAGES",
    "STATE_DTYPE_BYTES",
    "EnginePlacement",
    "check_combination",
    "valid_combinations",
]

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
    # pageable host memory (mixed precision only), and with NVMe parameters pageable buffers of the
    # largest layer's partition to assemble a unit before its swap file is written (formulas._stage3:
    # aio.queue_depth of them held by writes in flight, one more being assembled).
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
