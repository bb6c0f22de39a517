"""What a layout is: how one rank's parameters and gradients are laid out for the optimizer.

The engine (zero.engine.engine) drives the step; a layout supplies the parts that depend on how parameters are
partitioned:

* the rank's optimizer partition: a slice [lo, hi) of one flat buffer (flat) / the trainable units'
  partitions back to back (units);
* the gradient source `grad_host`: the flat gradient buffer, copied to an fp32 partition (stages 0-1) /
  the partition the gradient buckets add into during backward (stage 2) / the unit partitions the
  partitioner reduced into it;
* readiness of gradients for the overlapped pass: per parameter (post-accumulate-grad hooks) / per unit
  (the partitioner's gradient sink);
* the parameter writer: `FlatParamWriter` / `UnitParamWriter` (zero.layout.param_writer);
* the committed master back into the parameters: a copy into the flat buffer / a scatter into the units;
* after the update: all-gather the partitions (stages 1-2) / nothing (forward gathers units);
* the whole-model state dict: the module's own / gathered unit by unit (collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch
from torch import nn

from offload.pinned import PINNED_BUDGET_ENV, PinnedMemoryBudgetError, PinnedPool
from zero.layout.grad_fetch import DeviceGradFetch
from zero.layout.param_writer import ParamWriter
from zero.layout.partition import GradReadiness

__all__ = [
    "Fill",
    "GradMemory",
    "Layout",
    "Placement",
    "allocate_pinned",
    "cast_parameters",
    "index_names",
    "no_device_share",
    "trainable_params",
]

Fill = Callable[[int, int, torch.Tensor], None]  # fill(start, n, out): fp32 values of [start, start + n)


def no_device_share(part_numel: int) -> int:
    """No element of the optimizer partition is stepped on the training device (ratio 1.0)."""
    return 0


@dataclass(frozen=True)
class Placement:
    """The engine's settings a layout builds on. `device_share(part_numel)`: the first elements of a
    partition of `part_numel` whose optimizer state the training device steps (`offload_optimizer.ratio`
    below 1.0, zero.optimizer.tiers.split): their gradients and master weights need no pinned memory."""

    device: torch.device  # compute device
    dtype: torch.dtype  # model dtype (fp32, fp16 or bf16)
    rank: int
    world_size: int
    stage: int
    optimizer_tier: str  # offload_optimizer.device: "none", "cpu" or "nvme"
    device_share: Callable[[int], int] = no_device_share


@dataclass(frozen=True)
class GradMemory:
    """The gradient bytes one rank allocated (`ZeroEngine.gradient_memory()`), counted from the tensors.

    The compute device holds `device_bytes`: at stages 0-1 a gradient buffer of the whole model (plus, on a
    GPU, the fp32 partition for the optimizer); at stage 2 the buckets, and the rank's partition only when
    the optimizer is not offloaded. Autograd's gradient of the parameter being produced is transient and
    not counted."""

    full_buffer_bytes: int = 0  # a gradient buffer of the whole model (stages 0-1)
    partition_device_bytes: int = 0  # the rank's gradient partition, on the compute device
    partition_host_bytes: int = 0  # the rank's gradient partition, in (pinned) host memory
    bucket_bytes: int = 0  # stage 2: the buckets gradients pass through (compute device)
    staging_bytes: int = 0  # stage 2 from a GPU to the host: pinned staging of the buckets
    buckets_reduced: int = 0  # stage 2: buckets flushed so far (shows the bucketed path ran)

    @property
    def device_bytes(self) -> int:
        """Gradient bytes on the compute device."""
        return self.full_buffer_bytes + self.partition_device_bytes + self.bucket_bytes


def allocate_pinned(
    pool: PinnedPool,
    numel: int,
    what: str,
    dtype: torch.dtype = torch.float32,
    *,
    pinned: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """`numel` zeros from the pinned pool; a budget error says what they were for and how to raise it.
    `pinned`: only elements [start, end) need pinning (one tensor whose other elements are pageable host
    memory, charged for the pinned pages only); an empty range: a plain host tensor, nothing pinned."""
    try:
        if pinned is not None and pinned != (0, numel):
            if pinned[0] >= pinned[1]:
                return torch.zeros(numel, dtype=dtype)
            return pool.allocate_partly(numel, dtype, *pinned)
        return pool.allocate(numel, dtype)
    except PinnedMemoryBudgetError as e:
        err = PinnedMemoryBudgetError(e.requested, e.in_use, e.cap)
        err.args = (
            f"{e} - needed for {what} ({numel} x {dtype}); raise zero_offload.pinned_budget_bytes "
            f"or {PINNED_BUDGET_ENV}",
        )
        raise err from None


def cast_parameters(
    model: nn.Module, dtype: torch.dtype, skip: Optional[Callable[[nn.Parameter], bool]] = None
) -> None:
    """Cast the model's floating-point parameters to the compute dtype, in place (the Parameter objects
    stay), except those `skip(p)` is true for (partitioned already). Buffers keep their dtype: a model
    keeps some in float32 on purpose (a Llama's rotary frequencies), and transformers' from_pretrained
    (dtype=) and DeepSpeed (0.19.8, without data_types.buffer_dtype) leave them so; `model.to(dtype)`
    before initialize casts them too."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype and (skip is None or not skip(p)):
                p.data = p.data.to(dtype)


def trainable_params(model: nn.Module, model_parameters: Optional[Any]) -> List[nn.Parameter]:
    """The parameters to optimize: `model_parameters` (tensors or param groups) or all of the model's,
    those with requires_grad, each once. Tensors that are not the model's are refused."""
    if model_parameters is None:
        candidates: List[Any] = list(model.parameters())
    else:
        candidates = []
        for item in model_parameters:
            if isinstance(item, dict):  # a param group
                candidates.extend(item["params"])
            else:
                candidates.append(item)
    seen, params = set(), []
    for p in candidates:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    owned = {id(p) for p in model.parameters()}
    if any(id(p) not in owned for p in params):
        raise ValueError("model_parameters contains tensors that are not parameters of the model")
    return params


def index_names(model: nn.Module) -> Tuple[Dict[int, List[str]], List[str], List[str]]:
    """For `master_index`: every parameter's state-dict names (id -> [name, *tied aliases]), the state
    dict's keys in order, and the names of its buffers."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    keys = list(model.state_dict(keep_vars=True))
    params = {n for ns in names.values() for n in ns}
    return names, keys, [k for k in keys if k not in params]


class Layout(Protocol):
    """The layout strategy the engine composes (see the module doc)."""

    module: nn.Module
    pool: PinnedPool
    part_numel: int  # elements of the rank's optimizer partition
    lo: int  # the partition's place among all ranks' (checkpoint metadata)
    hi: int
    padded_numel: int  # all ranks' partitions together
    trainable_numel: int
    grad_host: torch.Tensor  # the partition's gradients as the optimizer reads them
    reducer: Any  # stages 1-2 with several ranks: the gradient reducer; else None
    partitioner: Any  # stage 3: the parameter partitioner; else None

    def master_init(self) -> Union[torch.Tensor, Fill]:
        """The initial fp32 master of the partition: a tensor, or a fill(start, n, out) of its pieces."""

    def param_spans(self) -> List[Tuple[int, int, nn.Parameter]]:
        """(start, end, parameter) of each parameter's elements in the rank's partition."""

    def master_alias(self) -> Optional[torch.Tensor]:
        """The flat parameter buffer's slice the master shares storage with, or None."""

    def make_writer(self, chunk_numel: int) -> ParamWriter:
        """The writer that copies updated master chunks into the parameters."""

    def grad_gate(self, chunks: List[Tuple[int, int]]) -> Tuple[GradReadiness, Optional[DeviceGradFetch]]:
        """The readiness gate of the optimizer's `chunks` for a pass during backward, and its GPU fetch."""

    def early_grads(self, fetching: bool) -> torch.Tensor:
        """The gradients a pass during backward reads (`fetching`: a GPU fetch fills them)."""

    def gradients_to_host(self) -> int:
        """Move the partition's gradients into grad_host after backward; the bytes copied."""

    def device_grad(self, grad_scale: float) -> torch.Tensor:
        """The partition's gradients on the device as fp32, divided by `grad_scale`."""

    def put_master(self, writer: ParamWriter, tier: Any) -> None:
        """Write the committed master (from `tier`, through `writer`) into the parameters."""

    def master_from_module(self) -> Fill:
        """fill(start, n, out): the module's current weights of the partition, as fp32."""

    @property
    def gathers_after_step(self) -> bool:
        """Whether the updated partitions must be gathered after each step (`after_step`)."""

    def after_step(self) -> None:
        """Gather the updated partitions to every rank where the layout needs it."""

    def module_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's state dict on the CPU in the model dtype (collective where partitioned)."""

    def master_state_dict(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The trainable parameters by name, from this rank's fp32 `master` (collective where partitioned)."""

    def master_index(self) -> Dict[str, Any]:
        """What each element of the master is, for readers of checkpoints."""

    def zero_grads(self) -> None:
        """Zero the gradients for the next accumulation window."""

    def take_param_io(self) -> Optional[Dict[str, int]]:
        """The parameter tier's I/O counts since the last call; None without a parameter tier."""

    @property
    def param_nvme_bytes(self) -> int:
        """Bytes of parameters in NVMe swap files (0 without a parameter tier)."""

    def close(self) -> None:
        """Remove the hooks and release the layout's buffers."""

    def describe(self) -> str:
        """One line for logs: the stage and sizes."""
