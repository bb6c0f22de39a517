"""The inference half of the planner (offload.estimate.plan): where the weights go for forwards - the device,
RAM (`offload_param: cpu`), or NVMe with `max_in_cpu: "auto"`'s share kept in RAM - and how long a forward
takes: max(compute, disk) on a CPU (partitions in RAM are used where they lie), max(compute, PCIe, disk) with
a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from offload.swap.resident import auto_resident_numel

from .formulas import SwapBufferSettings
from .machine import MachineProfile
from .plan import DTYPE_BYTES, Candidate, ModelShape, Plan, choose, disk_seconds, layers, pinned_budget_of
from .probe import ComputeProfile
from .units import format_bytes

__all__ = ["plan_inference", "predict_inference"]


def predict_inference(
    shape: ModelShape,
    machine: MachineProfile,
    compute: ComputeProfile,
    *,
    offload_param: str,
    precision: str = "bf16",
    batch_size: int = 1,
    pinned_budget: Optional[int] = None,
) -> Candidate:
    """The prediction for forwards with the weights on `offload_param` (what `plan_inference` weighs)."""
    plan = plan_inference(
        shape,
        machine,
        compute,
        precision=precision,
        batch_size=batch_size,
        pinned_budget=pinned_budget,
        offload_param=offload_param,
        require_fit=False,
    )
    return plan.chosen


def plan_inference(
    shape: ModelShape,
    machine: MachineProfile,
    compute: ComputeProfile,
    *,
    precision: str = "bf16",
    batch_size: int = 1,
    nvme_path: str = "/local_nvme",
    pinned_budget: Optional[int] = None,
    offload_param: Optional[str] = None,
    require_fit: bool = True,
) -> Plan:
    """The fastest way to run forwards of `batch_size` x `shape.seq_len` tokens: the weights on the device,
    in RAM (`offload_param: cpu`) or streamed from NVMe with `max_in_cpu: "auto"`'s share kept in RAM."""
    budget = pinned_budget_of(machine, 1, pinned_budget)
    cb = DTYPE_BYTES[precision]
    total = shape.params * cb
    tokens = batch_size * shape.seq_len
    flops = shape.forward_flops_per_token() * tokens
    # activations / KV cache of one forward: a few hidden-size rows per token and layer (the device's share)
    act_bytes = 16 * tokens * shape.hidden_size * cb + tokens * max(shape.vocab_size, 1) * 4
    cands = []
    tiers = ("none", "cpu", "nvme") if offload_param is None else (offload_param,)
    for par in tiers:
        in_ram = shape.params
        if par == "nvme":
            in_ram = auto_resident_numel(
                layers(shape.params, shape.largest_layer_params),
                cb,
                budget,
                SwapBufferSettings().param_buffer_count,
                SwapBufferSettings().param_buffer_size,
            )
        streamed = max(0, shape.params - in_ram) if par == "nvme" else 0
        host = in_ram * cb if par != "none" else 0
        device = total if par == "none" else 2 * shape.largest_layer_params * cb
        if machine.cpu_only:
            need_ram, fits_label = host + device + act_bytes, ""
            fits = machine.ram_bytes is None or need_ram <= machine.ram_bytes
            if par == "cpu" and host > budget:
                fits = False
            if not fits:
                fits_label = f"no (cpu: needs {format_bytes(need_ram)})"
        else:
            gpu_need = device + act_bytes
            fits = machine.gpu_bytes is None or gpu_need <= machine.gpu_bytes
            fits = fits and (machine.ram_bytes is None or host <= machine.ram_bytes)
            fits_label = "" if fits else f"no (gpu needs {format_bytes(gpu_need)}, ram {format_bytes(host)})"
        if par == "nvme" and machine.nvme_free_bytes is not None and streamed * cb > machine.nvme_free_bytes:
            fits, fits_label = False, "no (nvme)"
        read = streamed * cb
        times = {
            "compute": flops / compute.matmul_flops,
            # partitions in RAM are used where they lie on a CPU (a GPU's copies of them are PCIe time)
            "copies": 0.0,
            "cpu optimizer": 0.0,
            "disk": disk_seconds(read, 0, machine) if read else 0.0,
            "pcie": 0.0,
        }
        if not machine.cpu_only and par != "none" and compute.h2d_gbps:
            times["pcie"] = total / (compute.h2d_gbps * 1e9)
        if machine.cpu_only:
            seconds = max(times["compute"] + times["copies"], times["disk"])
        else:
            seconds = max(times["compute"], times["pcie"], times["disk"])
        bound = max(times, key=lambda k: times[k])
        cands.append(
            Candidate(
                stage=3 if par != "none" else 0,
                offload_optimizer="none",
                offload_param=par,
                micro_batch=batch_size,
                checkpointing=False,
                param_max_in_cpu=in_ram if par != "none" else 0,
                optimizer_max_in_cpu=0,
                estimate=None,
                fits=fits,
                fit_label=fits_label or "yes",
                times=times,
                seconds=seconds,
                tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
                bound=bound,
                nvme_read_bytes=read,
                nvme_write_bytes=0,
            )
        )
    if not require_fit:
        cands = [dataclasses.replace(c, fits=True) for c in cands]
    return choose("inference", cands, machine, compute, budget, precision, nvme_path, 100_000_000)
