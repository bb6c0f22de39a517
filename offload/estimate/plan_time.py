"""The planner's time model (offload.estimate.plan searches with it): the predicted time of one candidate
configuration, sized by the memory estimator, and the records a plan is made of.

The time model, one optimizer step of one rank (training) or one forward (inference), `T` tokens:

* compute: FLOPs (2 per parameter outside the input embedding per token forward, x3 with backward, x4
  with activation checkpointing; plus attention's 4 x seq x hidden per layer and token); in training the
  transformer blocks' share over the probed block rate (`ComputeProfile.train_flops`: norms, activations
  and autograd included) and the rest over the matmul rate, else all over the matmul rate;
* copies (no GPU): stage 3 gathers every partition into a layer buffer (forward, backward), copies the
  gradient back and the updated master into the partitions: 4 x the parameter bytes over the measured host
  copy rate (inference: none, a partition in RAM is used where it lies);
* CPU optimizer: the host share of the rank's partition over the measured CPU AdamW rate (offloaded
  optimizer, or a CPU-only machine); device optimizer: the share `offload_optimizer.ratio` leaves on the
  GPU over the device's AdamW rate;
* disk: NVMe bytes read over the read bandwidth plus bytes written over the write bandwidth, in two parts
  by what streams under what: "disk" the parameters' swapped share read in forward and backward (prefetched
  under compute), "disk (optimizer pass)" the optimizer state's swapped share read and written once and the
  parameters' swapped share written back, all during the optimizer pass (the engine leaves the parameter
  writes in flight, `aio.queue_depth` at a time, so they stream under the update as the state's do);
  "disk (not overlapped)" is the part nothing runs under: a tier's traffic when its buffer_count is 1;
* PCIe (GPU): bytes between host and device over the probed copy bandwidths.

On a CPU-only machine forward and backward (compute and the gathers' copies) run while the parameter reads
stream, then the optimizer pass (the CPU update and the copy of the updated master into the partitions)
while its disk traffic streams, then the not-overlapped disk: step = max(compute + 3/4 copies, disk) +
max(cpu optimizer + 1/4 copies, disk (optimizer pass)) + disk (not overlapped). With a GPU the device, the
link and the CPU optimizer overlap one another: step = max(compute, PCIe) + max(optimizer + not-overlapped
disk, disk not hidden under compute, device optimizer). The largest term is what bounds the plan.
`plan_training` then weighs the chosen configuration's `offload_optimizer.ratio` and NVMe buffer counts
(`_refine`), each count's staging slots charged to the pinned budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from offload.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from offload.swap.split import split_numel

from .activations import ActivationSettings
from .errors import EstimateInputError
from .formulas import (
    MemoryEstimate,
    SwapBufferSettings,
    TrainingSetup,
    estimate,
)
from .machine import MachineProfile, check_fit
from .probe import ComputeProfile, block_flops_per_token
from .setup import layers
from .split import apply_split, resolve_max_in_cpu
from .units import format_bytes, format_count

__all__ = [
    "DTYPE_BYTES",
    "Candidate",
    "ModelShape",
    "Plan",
    "compute_seconds",
    "disk_seconds",
    "layers",
    "pinned_budget_of",
    "predict_training",
    "training_candidate",
    "training_setup",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
HOST_COPY_GBPS_DEFAULT = 5.0  # host memcpy when the profile has none (ComputeProfile.host_copy_gbps)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a model: parameters, largest layer, and the transformer shape the
    compute and activations follow (`vocab_size`: the input embedding, which costs no matmul)."""

    params: int
    largest_layer_params: int
    hidden_size: int
    num_layers: int
    seq_len: int
    vocab_size: int = 0
    num_heads: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("params", "largest_layer_params", "hidden_size", "num_layers", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateInputError(f"model shape: {name} must be a positive integer, got {value!r}")

    def forward_flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward: 2 per weight outside the embedding, plus attention's."""
        weights = max(self.params - self.vocab_size * self.hidden_size, 1)
        return 2.0 * weights + 4.0 * self.seq_len * self.hidden_size * self.num_layers

    def block_flops_per_token(self) -> float:
        """Of `forward_flops_per_token`, the transformer blocks' (12 hidden^2 weights and attention per
        layer, offload.estimate.probe.block_flops_per_token); the rest (the output head) is plain matmul."""
        per_layer = block_flops_per_token(self.hidden_size, self.seq_len)
        return min(self.num_layers * per_layer, self.forward_flops_per_token())


def compute_seconds(shape: ModelShape, tokens: int, passes: float, compute: ComputeProfile) -> float:
    """Seconds of `passes` forward-equivalents (3: forward + backward, 4 with activation checkpointing)
    over `tokens`: the transformer blocks at the probed training-block rate (`train_flops`: norms,
    activations, attention and autograd included) when the profile has one, the rest at the matmul rate."""
    total = passes * shape.forward_flops_per_token() * tokens
    if not compute.train_flops:
        return total / compute.matmul_flops
    blocks = passes * shape.block_flops_per_token() * tokens
    return blocks / compute.train_flops + (total - blocks) / compute.matmul_flops


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighed: its settings, memory, predicted times and verdict."""

    stage: int
    offload_optimizer: str
    offload_param: str
    micro_batch: int
    checkpointing: bool
    param_max_in_cpu: int  # elements of parameter partitions kept in RAM ("auto" resolved)
    optimizer_max_in_cpu: int  # elements of optimizer state kept in RAM ("auto" resolved)
    estimate: Optional[MemoryEstimate]
    fits: bool
    fit_label: str
    times: Dict[str, float]  # seconds per step (or forward) of each resource
    seconds: float  # predicted seconds per step (or forward)
    tokens_per_s: float
    bound: str  # the resource that bounds it
    nvme_read_bytes: int
    nvme_write_bytes: int
    ratio: float = OffloadOptimizerConfig.ratio  # offload_optimizer.ratio: the share stepped on the host
    optimizer_buffer_count: int = OffloadOptimizerConfig.buffer_count  # NVMe staging slots of the state
    param_buffer_count: int = OffloadParamConfig.buffer_count  # NVMe parameter prefetch slots
    staging_bytes: int = 0  # pinned staging slots of both (bounded by the pinned budget)

    @property
    def options(self) -> str:
        """The settings in one line (ratio and buffer counts where they differ from the engine's defaults)."""
        text = f"stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
        text += f"offload_param={self.offload_param}, micro_batch={self.micro_batch}"
        text += ", activation checkpointing" if self.checkpointing else ""
        if self.ratio != OffloadOptimizerConfig.ratio:
            text += f", ratio={self.ratio:g}"
        if (
            self.offload_optimizer == "nvme"
            and self.optimizer_buffer_count != OffloadOptimizerConfig.buffer_count
        ):
            text += f", optimizer buffer_count={self.optimizer_buffer_count}"
        if self.offload_param == "nvme" and self.param_buffer_count != OffloadParamConfig.buffer_count:
            text += f", param buffer_count={self.param_buffer_count}"
        return text

    def to_dict(self) -> Dict[str, Any]:
        """The candidate's fields (its memory estimate as `MemoryEstimate.to_dict`)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "estimate"}
        d["estimate"] = self.estimate.to_dict() if self.estimate is not None else None
        return d


@dataclass(frozen=True)
class Plan:
    """The chosen candidate, its loadable config, and the alternatives with why each was not chosen."""

    mode: str  # "train" or "inference"
    chosen: Candidate
    config: Dict[str, Any]
    rejected: List[Tuple[Candidate, str]]
    machine: MachineProfile
    compute: ComputeProfile
    pinned_budget_bytes: int
    notes: List[str] = field(default_factory=list)

    @property
    def predicted_seconds(self) -> float:
        """Predicted seconds per optimizer step (train) or per forward (inference)."""
        return self.chosen.seconds

    def to_dict(self) -> Dict[str, Any]:
        """Everything as JSON-ready values."""
        return {
            "mode": self.mode,
            "config": self.config,
            "predicted_seconds": self.chosen.seconds,
            "predicted_tokens_per_s": self.chosen.tokens_per_s,
            "bound": self.chosen.bound,
            "chosen": self.chosen.to_dict(),
            "rejected": [
                {"options": c.options, "why": why, "seconds": c.seconds} for c, why in self.rejected
            ],
            "pinned_budget_bytes": self.pinned_budget_bytes,
            "compute_profile": self.compute.to_dict(),
            "notes": list(self.notes),
        }

    def _placement_line(self, unit: str) -> str:
        c = self.chosen
        kept = []
        if c.offload_param != "none":
            kept.append(f"parameters {format_count(c.param_max_in_cpu)} elements in RAM")
        if c.offload_optimizer != "none":
            kept.append(f"optimizer state {format_count(c.optimizer_max_in_cpu)} elements in RAM")
        text = "Placement: " + (", ".join(kept) or "everything on the device")
        text += f" (pinned budget {format_bytes(self.pinned_budget_bytes)}); NVMe per {unit}: "
        return text + f"read {format_bytes(c.nvme_read_bytes)}, write {format_bytes(c.nvme_write_bytes)}"

    def format(self) -> str:
        """The plan for a terminal: the choice, its prediction and bound, the times, the rejected ones."""
        c = self.chosen
        unit = "step" if self.mode == "train" else "forward"
        device = "the CPU (no GPU: host memory is the device)" if self.machine.cpu_only else "the GPU"
        lines = [
            f"Plan ({'training' if self.mode == 'train' else 'inference'} on {device}): {c.options}",
            f"Predicted: {c.seconds:.3f} s per {unit}, {c.tokens_per_s:.1f} tokens/s; bound by {c.bound}",
            "Time per " + unit + ": " + ", ".join(f"{k} {v:.3f} s" for k, v in c.times.items() if v > 0),
            self._placement_line(unit),
        ]
        if self.rejected:
            lines.append("Rejected:")
            lines += [f"  {r.options}: {why}" for r, why in self.rejected]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def pinned_budget_of(
    machine: MachineProfile, ranks_per_node: int = 1, configured: Optional[int] = None
) -> int:
    """The engine's pinned budget on `machine`: `configured`, else half its RAM over the node's ranks
    (offload.pinned.automatic_pinned_budget's rule on the profile's RAM)."""
    if configured is not None:
        return int(configured)
    if machine.ram_bytes is None:
        from offload.pinned import default_pinned_budget

        return default_pinned_budget()
    return int(machine.ram_bytes) // 2 // max(1, ranks_per_node)


def _host_copy_gbps(compute: ComputeProfile) -> float:
    return float(compute.host_copy_gbps or HOST_COPY_GBPS_DEFAULT)


def disk_seconds(read: float, write: float, machine: MachineProfile) -> float:
    """Seconds to read and write these bytes at the machine's NVMe bandwidths (they share the device)."""
    if read == 0 and write == 0:
        return 0.0
    if not machine.nvme_read_gbps or not machine.nvme_write_gbps:
        raise EstimateInputError(
            "the plan needs the disk's bandwidths for a configuration that uses NVMe: give a machine profile "
            "from `ds-nvme-bench --json` (nvme_read_gbps, nvme_write_gbps)"
        )
    return read / (machine.nvme_read_gbps * 1e9) + write / (machine.nvme_write_gbps * 1e9)


def _combine(times: Dict[str, float], machine: MachineProfile) -> Tuple[float, str]:
    """Seconds of the step from the resources' times, and the resource that bounds it (module doc)."""
    serial = times.get("disk (not overlapped)", 0.0)  # on the CPU's path (training only)
    in_pass = times.get("disk (optimizer pass)", 0.0)
    if machine.cpu_only:
        # of the 4 copies, the updated master into the partitions is the optimizer pass's
        fwd_bwd = max(times["compute"] + 0.75 * times["copies"], times["disk"])
        total = fwd_bwd + max(times["cpu optimizer"] + 0.25 * times["copies"], in_pass) + serial
    else:
        front = max(times["compute"], times["pcie"])
        hidden = max(0.0, times["disk"] + in_pass - times["compute"])
        # the device share (ratio below 1) steps on the device while the host share steps on the CPU
        total = front + max(times["cpu optimizer"] + serial, hidden, times.get("device optimizer", 0.0))
    bound = max(times, key=lambda k: times[k])
    return total, bound


def training_candidate(
    shape: ModelShape,
    setup: TrainingSetup,
    stage: int,
    opt: str,
    par: str,
    machine: MachineProfile,
    compute: ComputeProfile,
    budget: int,
    param_max_in_cpu: Optional[int] = None,
    optimizer_max_in_cpu: Optional[int] = None,
    ratio: float = OffloadOptimizerConfig.ratio,
) -> Candidate:
    """One configuration sized by the estimator and timed by the model above: `budget` is the pinned
    budget "auto" placements resolve against, `ratio` the optimizer state's offloaded share."""
    act = setup.activations
    assert act is not None
    cb = setup.compute_bytes
    part = math.ceil(shape.params / setup.world_size) if stage >= 1 else shape.params
    # parameters: "auto" keeps what fits in the pinned budget, after the staging slots of the rest
    param_in_cpu = 0
    if par == "nvme":
        want = "auto" if param_max_in_cpu is None else param_max_in_cpu
        asked = dataclasses.replace(setup.buffers, param_max_in_cpu=want)
        param_in_cpu = asked.param_in_cpu(layers(part, shape.largest_layer_params), cb, budget)
    bufs = dataclasses.replace(setup.buffers, param_max_in_cpu=param_in_cpu)
    setup = dataclasses.replace(setup, buffers=bufs)
    est = estimate(setup, stage, opt, par, machine.nvme_free_bytes)
    budget_left = budget - (param_in_cpu * cb if par == "nvme" else 0)
    opt_want = "auto" if optimizer_max_in_cpu is None else optimizer_max_in_cpu
    ratio = ratio if opt != "none" else 1.0
    opt_in_cpu = resolve_max_in_cpu(est, setup, ratio, opt_want, budget_left)
    est = apply_split(est, setup, ratio, opt_in_cpu)
    fit = check_fit(est, machine, setup.gpus_per_node)
    fit_label = fit.label
    share = split_numel(part, setup.buffers.sub_group_size, tier=opt, ratio=ratio, max_in_cpu=opt_in_cpu)
    # stepped by the CPU: the host share; without a GPU all of it (the "device" is the same CPU)
    on_host = part if machine.cpu_only else part - share.device
    # pinned staging slots: the optimizer's NVMe chunks and the parameters' prefetch buffers
    b = setup.buffers
    staging = 0
    if opt == "nvme":
        chunk = setup.nvme_chunk(part)
        staging += (
            min(b.optimizer_buffer_count, -(-part // chunk)) * chunk * (4 + setup.optimizer_state_bytes)
        )
    if par == "nvme":
        staging += b.param_buffer_count * min(b.param_buffer_size, shape.largest_layer_params) * cb
    fits = fit.fits and staging <= budget
    if fit.fits and not fits:
        fit_label = f"no (pinned: staging {format_bytes(staging)} over the budget {format_bytes(budget)})"
    # NVMe bytes per step, one rank
    state_bytes = 4 + setup.optimizer_state_bytes
    opt_swapped = share.offload if opt == "nvme" else 0
    par_swapped = max(0, part - param_in_cpu) if par == "nvme" else 0
    # units stay gathered from forward to backward while the model fits stage3_max_live_parameters
    # (the engine's reuse): one read per step then, else one in forward and one in backward
    par_reads = 1 if shape.params <= ZeroConfig.stage3_max_live_parameters else 2
    read = opt_swapped * state_bytes + par_reads * par_swapped * cb
    write = opt_swapped * state_bytes + par_swapped * cb
    tokens = act.batch_size * act.seq_len
    passes = 4.0 if act.checkpointing else 3.0
    copy_rate = _host_copy_gbps(compute) * 1e9
    # Off the compute's path only with staging slots to run ahead in: with one optimizer slot each chunk's
    # read and write wait for its update, with one parameter slot each unit's read waits for compute. The
    # updated parameters' swap files are written during the optimizer pass, left in flight (the engine's
    # write-back, `aio.queue_depth` at a time): they stream under the update with the state's traffic.
    serial_read = par_reads * par_swapped * cb if b.param_buffer_count < 2 else 0
    serial_write = 0
    pass_read, pass_write = opt_swapped * state_bytes, opt_swapped * state_bytes + par_swapped * cb
    if b.optimizer_buffer_count < 2:
        serial_read += opt_swapped * state_bytes
        serial_write += opt_swapped * state_bytes
        pass_read, pass_write = 0, par_swapped * cb
    times = {
        "compute": compute_seconds(shape, tokens, passes, compute),
        # stage 3 without a GPU: the gathers of forward and backward, the gradient copied back, and the
        # updated master copied into the partitions after the step
        "copies": 4 * part * cb / copy_rate if stage == 3 and machine.cpu_only else 0.0,
        "cpu optimizer": on_host / compute.cpu_optimizer_elems_per_s
        if (opt != "none" or machine.cpu_only)
        else 0.0,
        "device optimizer": share.device / compute.device_optimizer_elems_per_s
        if share.device and compute.device_optimizer_elems_per_s and not machine.cpu_only
        else 0.0,
        "disk": disk_seconds(read - serial_read - pass_read, write - serial_write - pass_write, machine),
        "disk (optimizer pass)": disk_seconds(pass_read, pass_write, machine),
        "disk (not overlapped)": disk_seconds(serial_read, serial_write, machine),
        "pcie": 0.0,
    }
    if not machine.cpu_only:
        h2d, d2h = compute.h2d_gbps or 0.0, compute.d2h_gbps or 0.0
        # the host share's gradients go down and its updated parameters come back up
        moved_up = (on_host * cb if opt != "none" else 0) + (2 * part * cb if par != "none" else 0)
        moved_down = on_host * cb if opt != "none" else 0
        times["pcie"] = (moved_up / (h2d * 1e9) if h2d else 0.0) + (moved_down / (d2h * 1e9) if d2h else 0.0)
    seconds, bound = _combine(times, machine)
    return Candidate(
        stage=stage,
        offload_optimizer=opt,
        offload_param=par,
        micro_batch=act.batch_size,
        checkpointing=act.checkpointing,
        param_max_in_cpu=param_in_cpu if par == "nvme" else (part if par == "cpu" else 0),
        optimizer_max_in_cpu=opt_in_cpu if opt == "nvme" else (part if opt == "cpu" else 0),
        estimate=est,
        fits=fits,
        fit_label=fit_label,
        times=times,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        bound=bound,
        nvme_read_bytes=read,
        nvme_write_bytes=write,
        ratio=ratio,
        optimizer_buffer_count=b.optimizer_buffer_count,
        param_buffer_count=b.param_buffer_count,
        staging_bytes=staging,
    )


def training_setup(
    shape: ModelShape,
    micro_batch: int,
    checkpointing: bool,
    precision: str,
    optimizer: str,
    buffers: SwapBufferSettings,
    gpus_per_node: int = 1,
) -> TrainingSetup:
    """The estimator's description of training `shape` with these choices."""
    act = ActivationSettings(
        batch_size=micro_batch,
        seq_len=shape.seq_len,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        checkpointing=checkpointing,
        num_heads=shape.num_heads,
        vocab_size=shape.vocab_size or None,
    )
    return TrainingSetup(
        params=shape.params,
        largest_layer_params=shape.largest_layer_params,
        gpus_per_node=gpus_per_node,
        precision=precision,
        optimizer=optimizer,
        buffers=buffers,
        activations=act,
    )


def predict_training(
    shape: ModelShape,
    machine: MachineProfile,
    compute: ComputeProfile,
    *,
    stage: int,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    micro_batch: int = 1,
    checkpointing: bool = False,
    precision: str = "bf16",
    optimizer: str = "adam",
    sub_group_size: int = 100_000_000,
    pinned_budget: Optional[int] = None,
    param_max_in_cpu: Optional[int] = None,
    optimizer_max_in_cpu: Optional[int] = None,
) -> Candidate:
    """The prediction for one given training configuration (what `plan_training` weighs for each
    candidate); `*_max_in_cpu` None: "auto" as the engine resolves it."""
    budget = pinned_budget_of(machine, 1, pinned_budget)
    bufs = SwapBufferSettings(sub_group_size=sub_group_size)
    setup = training_setup(shape, micro_batch, checkpointing, precision, optimizer, bufs)
    return training_candidate(
        shape,
        setup,
        stage,
        offload_optimizer,
        offload_param,
        machine,
        compute,
        budget,
        param_max_in_cpu,
        optimizer_max_in_cpu,
    )
