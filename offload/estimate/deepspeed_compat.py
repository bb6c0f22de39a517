"""DeepSpeed's own model-state estimates, reproduced number for number.

DeepSpeed prints these from `estimate_zero2_model_states_mem_needs_all_cold` (stage_1_and_2.py, which
serves ZeRO-1 and ZeRO-2) and `estimate_zero3_model_states_mem_needs_all_cold` (stage3.py). They count
model states only (no activations, no NVMe, no swap buffers), multiply host memory by a fudge factor
(additional_buffer_factor, 1.5 by default) and report host memory per node. The arithmetic below follows
theirs step by step, including where it truncates to int, so the bytes match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from .errors import EstimateInputError

DEFAULT_ADDITIONAL_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class DeepSpeedRow:
    """One row of DeepSpeed's estimate_zero*_model_states_mem_needs tables, computed with its formulas."""

    stage: int
    offload_optimizer: str
    offload_param: str
    zero_init: Optional[bool]  # only the ZeRO-3 estimate distinguishes zero.Init
    per_cpu_bytes: int
    per_gpu_bytes: int

    @property
    def options(self) -> str:
        """The row's options as DeepSpeed's estimator prints them."""
        text = (
            f"stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
            f"offload_param={self.offload_param}"
        )
        if self.zero_init is not None:
            text += f", zero_init={int(self.zero_init)}"
        return text

    def to_dict(self) -> Dict[str, object]:
        """The row as JSON-ready values."""
        return {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "zero_init": self.zero_init,
            "per_gpu_bytes": self.per_gpu_bytes,
            "per_cpu_bytes": self.per_cpu_bytes,
            "nvme_bytes": 0,
            # DeepSpeed gives totals only: no per-component split to report.
            "breakdown": {"gpu": {}, "cpu": {}, "nvme": {}},
        }


def zero2_model_states(
    total_params: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = DEFAULT_ADDITIONAL_BUFFER_FACTOR,
) -> Tuple[int, int]:
    """(per-CPU bytes, per-GPU bytes) as DeepSpeed's ZeRO-1/2 estimate computes them."""
    total_gpus = nodes * gpus_per_node
    if cpu_offload:
        # GPU: the full 16-bit params; host: 16 B/param of states, or 4 B/param per GPU if more.
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # GPU: 16-bit params plus 18 B/param (16-bit grads, fp32 grads, master, two states) partitioned.
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def zero3_model_states(
    total_params: int,
    largest_layer_params: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = DEFAULT_ADDITIONAL_BUFFER_FACTOR,
) -> Tuple[int, int]:
    """(per-CPU bytes, per-GPU bytes) as DeepSpeed's ZeRO-3 estimate computes them."""
    total_gpus = nodes * gpus_per_node
    node_share = 1 / nodes
    largest_layer_bytes = 4 * largest_layer_params
    if cpu_offload:
        per_param = 18 if cpu_offload_params else 16
        gpu = (
            largest_layer_bytes
            if cpu_offload_params
            else largest_layer_bytes + int(2 * total_params / total_gpus)
        )
        if zero_init:
            cpu = total_params * per_param * node_share * additional_buffer_factor
        else:
            # Without zero.Init every rank first builds the full fp32 model on the host.
            cpu = total_params * max(4 * gpus_per_node, per_param * node_share) * additional_buffer_factor
    else:
        gpu = largest_layer_bytes + int(18 * total_params / total_gpus)
        if zero_init:
            cpu = largest_layer_params * 4 * gpus_per_node * additional_buffer_factor
        else:
            cpu = total_params * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def deepspeed_rows(
    total_params: int,
    largest_layer_params: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    additional_buffer_factor: float = DEFAULT_ADDITIONAL_BUFFER_FACTOR,
    stages: Optional[Iterable[int]] = None,
    offload_optimizers: Optional[Iterable[str]] = None,
    offload_params: Optional[Iterable[str]] = None,
) -> List[DeepSpeedRow]:
    """The rows DeepSpeed prints, in its order, filtered by the given choices.

    Stages 1 and 2 both come from the ZeRO-2 function (DeepSpeed uses it for both); with no stage given
    its rows are labelled stage 2. DeepSpeed has no NVMe rows and no stage-0 estimate.
    """
    if additional_buffer_factor <= 0:
        raise EstimateInputError(f"additional_buffer_factor must be positive, got {additional_buffer_factor}")
    wanted_stages = [2, 3] if stages is None else list(stages)
    opts = None if offload_optimizers is None else set(offload_optimizers)
    pars = None if offload_params is None else set(offload_params)

    def keep(opt: str, par: str) -> bool:
        return (opts is None or opt in opts) and (pars is None or par in pars)

    rows: List[DeepSpeedRow] = []
    for stage in wanted_stages:
        if stage in (1, 2):
            for cpu_offload in (True, False):
                opt = "cpu" if cpu_offload else "none"
                if not keep(opt, "none"):
                    continue
                cpu, gpu = zero2_model_states(
                    total_params, gpus_per_node, nodes, cpu_offload, additional_buffer_factor
                )
                rows.append(DeepSpeedRow(stage, opt, "none", None, cpu, gpu))
        elif stage == 3:
            for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
                opt = "cpu" if cpu_offload else "none"
                par = "cpu" if cpu_offload_params else "none"
                if not keep(opt, par):
                    continue
                for zero_init in (True, False):
                    cpu, gpu = zero3_model_states(
                        total_params,
                        largest_layer_params,
                        gpus_per_node,
                        nodes,
                        cpu_offload,
                        cpu_offload_params,
                        zero_init,
                        additional_buffer_factor,
                    )
                    rows.append(DeepSpeedRow(3, opt, par, zero_init, cpu, gpu))
    return rows
