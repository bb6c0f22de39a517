"""The estimator's table and JSON output."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .deepspeed_compat import DeepSpeedRow
from .machine import FitCheck, MachineProfile
from .result import MemoryEstimate
from .setup import TrainingSetup
from .units import format_bytes, format_count, format_gib


def _render(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> List[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return " | ".join(parts).rstrip()

    out = [line(header), "-+-".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return out


def describe_setup(setup: TrainingSetup, largest_layer_source: str) -> List[str]:
    """Lines describing the training setup an estimate is for."""
    gpus = f"{setup.nodes} node(s) x {setup.gpus_per_node} GPU(s) = {setup.world_size} data-parallel ranks"
    model = (
        f"{format_count(setup.params)} params ({setup.params}), largest layer "
        f"{format_count(setup.largest_layer_params)} ({largest_layer_source})"
    )
    training = (
        f"precision {setup.precision}, optimizer {setup.optimizer} "
        f"({setup.optimizer_state_bytes} B/param of states, {setup.optimizer_state_dtype})"
    )
    lines = [f"Model: {model}", f"Hardware: {gpus}", f"Training: {training}"]
    if setup.activations is not None:
        act = setup.activations
        lines.append(
            f"Activations: micro-batch {act.batch_size} x seq {act.seq_len}, hidden {act.hidden_size}, "
            f"{act.num_layers} layers, {act.attention} attention, "
            f"checkpointing {'on' if act.checkpointing else 'off'}"
            + (f" (checkpoints on {act.checkpoint_device})" if act.checkpoint_device != "none" else "")
        )
    else:
        lines.append("Activations: not counted (give --batch-size and --seq-len to add them)")
    return lines


def render_estimates(
    setup: TrainingSetup,
    estimates: Sequence[MemoryEstimate],
    largest_layer_source: str,
    checks: Optional[Sequence[FitCheck]] = None,
    machine: Optional[MachineProfile] = None,
    recommended: Optional[MemoryEstimate] = None,
) -> str:
    """The estimates as a text report (a table per configuration)."""
    lines = describe_setup(setup, largest_layer_source)
    lines.append("Per GPU: each GPU; per CPU and NVMe: each node (all its ranks together).")
    lines.append("")
    header = ["per GPU", "per CPU", "(pinned)", "NVMe", "options"]
    right = [True, True, True, True, False]
    if checks is not None:
        header += ["fits", "NVMe I/O per step"]
        right += [False, True]
    rows = []
    for i, est in enumerate(estimates):
        row = [
            format_bytes(est.per_gpu_bytes),
            format_bytes(est.per_cpu_bytes),
            format_bytes(est.per_cpu_pinned_bytes),
            format_bytes(est.nvme_bytes),
            est.options,
        ]
        if checks is not None:
            check = checks[i]
            io = check.nvme_io_seconds
            row += [check.label, "-" if io is None else ("0" if io == 0 else f"{io:.2f} s")]
        rows.append(row)
    lines += _render(header, rows, right)
    notes = sorted({note for est in estimates for note in est.notes})
    if notes:
        lines.append("")
        lines += ["Note: " + note for note in notes]
    if machine is not None:
        lines.append("")
        lines.append("Machine:")
        for name, value in (
            ("GPU memory", machine.gpu_bytes),
            ("host memory", machine.ram_bytes),
            ("NVMe free", machine.nvme_free_bytes),
        ):
            key = {"GPU memory": "gpu_bytes", "host memory": "ram_bytes", "NVMe free": "nvme_free_bytes"}[
                name
            ]
            shown = "unknown" if value is None else format_bytes(value)
            if name == "GPU memory" and machine.cpu_only:
                shown = "none (the CPU is the device)"
            source = machine.sources.get(key, "")
            lines.append(f"  {name}: {shown}" + (f"  [{source}]" if source else ""))
        if machine.nvme_read_gbps and machine.nvme_write_gbps:
            lines.append(
                f"  NVMe bandwidth: read {machine.nvme_read_gbps:g} GB/s, "
                f"write {machine.nvme_write_gbps:g} GB/s"
            )
        if machine.cpu_only:
            lines.append(
                "  No GPU: the device is this host's memory, so each rank's per-GPU bytes were checked in "
                "host memory together with the per-CPU bytes."
            )
        elif machine.gpu_bytes is None:
            lines.append(
                "  GPU memory unknown: the GPU column was not checked "
                "(a --machine-profile can give gpu_bytes)."
            )
    if checks is not None:
        lines.append("")
        if recommended is None:
            lines.append("Nothing fits on this machine: add nodes or GPUs, or free host memory / NVMe space.")
        else:
            lines.append(f"Recommended (fits, least offload, so fastest): {recommended.options}")
    return "\n".join(lines)


def estimates_json(
    setup: TrainingSetup,
    estimates: Sequence[MemoryEstimate],
    largest_layer_source: str,
    checks: Optional[Sequence[FitCheck]] = None,
    machine: Optional[MachineProfile] = None,
    recommended: Optional[MemoryEstimate] = None,
) -> Dict[str, object]:
    """The estimates as a JSON-ready dict."""
    rows = []
    for i, est in enumerate(estimates):
        row = est.to_dict()
        if checks is not None:
            row["fit"] = checks[i].to_dict()
        rows.append(row)
    out: Dict[str, object] = {
        "params": setup.params,
        "largest_layer_params": setup.largest_layer_params,
        "largest_layer_source": largest_layer_source,
        "gpus_per_node": setup.gpus_per_node,
        "nodes": setup.nodes,
        "precision": setup.precision,
        "optimizer": setup.optimizer,
        "optimizer_state_dtype": setup.optimizer_state_dtype,
        "rows": rows,
    }
    if machine is not None:
        out["machine"] = {
            "gpu_bytes": machine.gpu_bytes,
            "ram_bytes": machine.ram_bytes,
            "nvme_free_bytes": machine.nvme_free_bytes,
            "nvme_read_gbps": machine.nvme_read_gbps,
            "nvme_write_gbps": machine.nvme_write_gbps,
            "cpu_only": machine.cpu_only,
            "sources": dict(machine.sources),
        }
    if checks is not None:
        out["recommended"] = None if recommended is None else recommended.to_dict()
    return out


def render_deepspeed(
    rows: Sequence[DeepSpeedRow], params: int, largest: int, gpus_per_node: int, nodes: int, factor: float
) -> str:
    """DeepSpeed's own estimate tables, as text."""
    lines = [
        "DeepSpeed's estimate (estimate_zero2/zero3_model_states_mem_needs_all_cold): model states only,",
        f"host memory x additional_buffer_factor {factor:g}; GiB = 2**30 bytes (DeepSpeed prints 'GB').",
        f"Model: {int(params / 1e6)}M total params, {int(largest / 1e6)}M largest layer params; "
        f"{nodes} node(s) x {gpus_per_node} GPU(s).",
        "",
    ]
    table = [[format_gib(r.per_gpu_bytes), format_gib(r.per_cpu_bytes), "0 B", r.options] for r in rows]
    lines += _render(["per GPU", "per CPU", "NVMe", "options"], table, [True, True, True, False])
    return "\n".join(lines)


def deepspeed_json(
    rows: Sequence[DeepSpeedRow], params: int, largest: int, factor: float
) -> Dict[str, object]:
    """DeepSpeed's own estimate tables, as a JSON-ready dict."""
    return {
        "params": params,
        "largest_layer_params": largest,
        "deepspeed_compat": True,
        "additional_buffer_factor": factor,
        "rows": [r.to_dict() for r in rows],
    }
