"""The parts of an engine without an optimizer (ZeRO-Inference): `zero.initialize` with neither an
`optimizer` block in the config nor `optimizer=` builds the same `ZeroEngine`, composed of these instead of
the training parts (docs/inference.md):

* a layout that holds the weights and nothing else: `ReplicatedLayout` (stages 0-2: the whole module on the
  compute device in the model dtype, on every rank) or `PartitionedLayout` (stage 3: the stage-3
  partitioner streams each module's weights from `offload_param.device` none/cpu/nvme during forward);
  no flat buffers, no gradient partition, no fp32 master;
* `NoOptimizerState` and `NoUpdatePass` in place of the optimizer state and the update pass: nothing on a
  tier, no swap space, nothing to settle; whatever needs optimizer state raises `NoOptimizerError`;
* `check_inference_config`: a scheduler without an optimizer is an error; training-only keys are accepted
  with one warning that names them; `weight_quantization` needs stage 3 (`refuse_weight_quantization` is
  the training engine's refusal).

With `weight_quantization` the stage-3 store keeps the selected weights quantized in their partitions
(zero.stage3.quant) and dequantizes them after each read, just before their module runs.

At stage 3 a backward the user runs through the module (`loss.backward()`; `engine.backward` refuses)
still gathers the weights it needs and gives inputs their gradients; the parameters' gradients are dropped
unit by unit (`_DroppedGradients`), never accumulated.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from offload.config import ConfigError, load_config
from offload.config.loader import ZeroOffloadConfig
from offload.pinned import PinnedPool
from zero.errors import NoOptimizerError
from zero.layout.base import Placement, cast_parameters
from zero.optimizer.tiers.base import StateInfo
from zero.report import ForwardMeter, InferenceReport, inference_report
from zero.stage3.unit import Unit

__all__ = [
    "NoOptimizerState",
    "NoUpdatePass",
    "PartitionedLayout",
    "ReplicatedLayout",
    "check_inference_config",
    "refuse_weight_quantization",
    "inference_layout",
    "no_optimizer_error",
]

logger = logging.getLogger("zero")

_HOW = (
    'add an \'optimizer\' block to the config (e.g. "optimizer": {"type": "AdamW", "params": '
    '{"lr": 1e-4}}) or pass optimizer= to zero.initialize (a torch optimizer, or a callable taking the '
    "parameters)"
)

# Keys that act only on training (gradients, optimizer state, loss scaling), with why an engine without an
# optimizer has nothing to apply them to. Given with a value other than their default at the config's stage,
# they are named in one warning at initialize.
_TRAINING_ONLY = {
    "gradient_clipping": "no gradients to clip",
    "gradient_accumulation_steps": "no gradients to accumulate",
    "zero_optimization.offload_optimizer.device": "no optimizer state to offload",
    "zero_optimization.sub_group_size": "no optimizer state to split into sub-groups",
    "zero_optimization.reduce_bucket_size": "no gradients to reduce",
    "zero_optimization.overlap_comm": "no gradients to reduce",
    "zero_optimization.ignore_unused_parameters": "no backward to check",
    "fp16.loss_scale": "no loss to scale",
    "fp16.initial_scale_power": "no loss to scale",
    "fp16.loss_scale_window": "no loss to scale",
    "fp16.hysteresis": "no loss to scale",
    "fp16.consecutive_hysteresis": "no loss to scale",
    "fp16.min_loss_scale": "no loss to scale",
    "bf16.check_grad_overflow": "no gradients to check",
}


@functools.cache
def _defaults(stage: int) -> Any:
    """Every key's default at `stage` (DeepSpeed's overlap_comm depends on it); offload_optimizer present."""
    return load_config({"zero_optimization": {"stage": stage, "offload_optimizer": {}}})


def no_optimizer_error(what: str) -> NoOptimizerError:
    """The error for `what` (an engine call) on an engine built without an optimizer."""
    return NoOptimizerError(
        f"{what} needs an optimizer, and this engine has none: zero.initialize got neither an 'optimizer' "
        "block in the config nor optimizer=, so it built an inference engine (forward, generate, "
        f"load_checkpoint). To train, {_HOW}."
    )


def _value(cfg: ZeroOffloadConfig, path: str) -> Any:
    obj: Any = cfg
    for name in path.split("."):
        if obj is None:  # a section left out: its defaults
            return _value(_defaults(int(cfg.zero_optimization.stage)), path)
        obj = getattr(obj, name)
    return obj


def refuse_weight_quantization(cfg: ZeroOffloadConfig) -> None:
    """The training engine's check: `weight_quantization` (weights stored quantized, never updated) is
    for an engine without an optimizer; with one it is a ConfigError."""
    if cfg.weight_quantization.enabled:
        raise ConfigError(
            "weight_quantization stores the weights quantized for inference and cannot be trained: remove "
            "the 'optimizer' block (and optimizer=) to run inference, or the weight_quantization block to "
            "train"
        )


def check_inference_config(cfg: ZeroOffloadConfig, lr_scheduler: Optional[Any]) -> None:
    """Refuse a scheduler (the config's `scheduler` block or `lr_scheduler=`): it has no optimizer to
    drive; refuse `weight_quantization` below stage 3 (nothing is partitioned there). Warn once, naming
    them, about training-only keys given with a non-default value."""
    if cfg.weight_quantization.enabled and int(cfg.zero_optimization.stage) != 3:
        raise ConfigError(
            f"weight_quantization stores the weights quantized in their stage-3 partitions and needs "
            f"zero_optimization.stage 3, got {cfg.zero_optimization.stage}"
        )
    if cfg.scheduler is not None:
        raise ConfigError(
            f"scheduler (type {cfg.scheduler.type!r}) needs an optimizer, and the config has no 'optimizer' "
            f"block (nor was optimizer= given): to train, {_HOW}; for inference, remove the scheduler block"
        )
    if lr_scheduler is not None:
        raise ValueError(
            f"lr_scheduler= needs an optimizer, and none was configured: to train, {_HOW}; for inference, "
            "leave lr_scheduler out"
        )
    defaults = _defaults(int(cfg.zero_optimization.stage))
    ignored = [
        f"{path}={_value(cfg, path)!r} ({why})"
        for path, why in _TRAINING_ONLY.items()
        if _value(cfg, path) != _value(defaults, path)
    ]
    if ignored:
        logger.warning(
            "no optimizer configured: this engine runs inference only and ignores the training keys %s; "
            "to train, %s",
            ", ".join(ignored),
            _HOW,
        )


class NoOptimizerState:
    """The optimizer-state part of an engine without an optimizer: no master, no states, no swap space.
    Reading or loading optimizer state raises `NoOptimizerError`."""

    space = None  # no swap files
    tier = None
    atomic = False

    def info(self, tier: str) -> StateInfo:
        """Tier "none" and zero everywhere: nothing is held."""
        return StateInfo(
            tier="none", numel=0, chunk_numel=0, chunks=0, copies=0, pass_read_bytes=0, disk_bytes=0
        )

    def settle_write_back(self) -> None:
        """Nothing is ever written back."""

    def master_and_states(self) -> Any:
        """Refused: there is no fp32 master and no optimizer state."""
        raise no_optimizer_error("reading the fp32 master or the optimizer state")

    def load_values(self, master: Any, states: Any) -> None:
        """Refused: there is no optimizer state to load into."""
        raise no_optimizer_error("loading optimizer state")

    def stream_out(self, fn: Any) -> None:
        """Refused (see `master_and_states`)."""
        raise no_optimizer_error("reading the optimizer state")

    def stream_in(self, fn: Any) -> None:
        """Refused (see `load_values`)."""
        raise no_optimizer_error("loading optimizer state")

    def close(self) -> None:
        """Nothing to free."""


class NoUpdatePass:
    """The update-pass part of an engine without an optimizer: no pass runs, during or after backward."""

    last_grad_norm = None

    def drop_overlapped(self) -> None:
        """No pass was started during a backward: nothing to drop."""


class _DroppedGradients:
    """The stage-3 gradient sink of an engine without an optimizer: each unit's reduced gradient is dropped
    (a backward the user runs through the module still gives inputs their gradients)."""

    def accumulator(self, unit: Unit) -> Optional[torch.Tensor]:
        return None

    def partition_ready(self, unit: Unit, grad_partition: torch.Tensor) -> None:
        pass

    def unit_final(self, unit: Unit) -> None:
        pass


class _WeightsOnly:
    """What both inference layouts share: no optimizer partition, no gradients, nothing after a step."""

    reducer = None
    grad_host = None
    gathers_after_step = False
    part_numel = lo = hi = padded_numel = 0  # no optimizer partition
    module: nn.Module
    pool: PinnedPool
    trainable_numel: int
    meter: Optional[ForwardMeter] = None  # the root module's forwards, tokens and time (`inference_layout`)

    def take_param_io(self) -> Optional[Dict[str, int]]:
        """The parameter tier's counts since the last call (each layout gives its own)."""
        raise NotImplementedError

    def inference_report(
        self, read_ceiling_gbs: Optional[float] = None, machine_profile: Optional[str] = None
    ) -> InferenceReport:
        """Forwards, tokens, time and parameter bytes read since the last call (zero.report)."""
        if self.meter is None:
            raise RuntimeError("this layout was not built by inference_layout: its forwards are not metered")
        return inference_report(self.meter, self.take_param_io, read_ceiling_gbs, machine_profile)

    def _close_meter(self) -> None:
        if self.meter is not None:
            self.meter.close()


class ReplicatedLayout(_WeightsOnly):
    """Stages 0-2 without an optimizer: the whole module on the compute device in the model dtype, on every
    rank (nothing is partitioned: ZeRO stages 1-2 partition only optimizer state and gradients). No flat
    buffers, no hooks; the module's parameters keep their own storage."""

    partitioner = None

    def __init__(
        self, model: nn.Module, params: List[nn.Parameter], place: Placement, pool: PinnedPool
    ) -> None:
        """`params`: the trainable parameters (counted for `trainable_numel`)."""
        model.to(place.device)
        if place.dtype != torch.float32:
            cast_parameters(model, place.dtype)
        self.module, self.pool, self.place = model, pool, place
        self.trainable_numel = sum(p.numel() for p in params)

    def take_param_io(self) -> Optional[Dict[str, int]]:
        """No parameter tier: None."""
        return None

    @property
    def param_nvme_bytes(self) -> int:
        """No swap files: 0."""
        return 0

    def module_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's state dict on the CPU (model dtype)."""
        return {k: v.detach().to("cpu").clone() for k, v in self.module.state_dict().items()}

    def close(self) -> None:
        """Nothing to free: the module stays usable (the forward meter's hooks are removed)."""
        self._close_meter()

    def describe(self) -> str:
        """For the engine's repr."""
        return f"stage={self.place.stage}, params={self.trainable_numel}, no optimizer"


class PartitionedLayout(_WeightsOnly):
    """Stage 3 without an optimizer: the stage-3 partitioner (zero.stage3) holds each rank's partitions on
    `offload_param.device` and gathers each module's weights around its forward. No gradient partition and
    no fp32 copy of the weights: a model given in fp32 and run in 16 bits is cast as it is partitioned."""

    def __init__(
        self,
        model: nn.Module,
        params: List[nn.Parameter],
        place: Placement,
        pool: PinnedPool,
        config: ZeroOffloadConfig,
    ) -> None:
        """`params`: the trainable parameters (counted for `trainable_numel`, this rank's share)."""
        from zero.layout.units import _cast_unpartitioned, _check_dtypes

        self.place = place
        _check_dtypes(model, place.dtype)
        _cast_unpartitioned(model, place.device, place.dtype)
        self.module = model
        self.partitioner = _partitioner(model, config, place, pool)
        self.pool = self.partitioner.pool  # built under zero.Init: the Init's pinned budget
        wanted = {id(p) for p in params}
        self.trainable_numel = sum(
            s.param_hi - s.param_lo
            for u in self.partitioner.units
            for s in u.slices()
            if id(s.param) in wanted
        )
        self.partitioner.take_io_report()  # partitioning is not part of the first forward's counts

    def take_param_io(self) -> Optional[Dict[str, int]]:
        """The parameter tier's counts since the last call (zero.stage3.io_report.ParamIOReport)."""
        return self.partitioner.take_io_report().as_dict()

    def quantization(self) -> Dict[str, int]:
        """What weight quantization holds on this rank: `units` stored quantized, their `quantized_numel`
        (weight elements as codes), `stored_bytes` of every partition on its tier and `unquantized_bytes`
        (the same partitions in the model dtype). Without quantization the two byte counts are equal."""
        part = self.partitioner
        units = part.units
        codecs = [c for c in (part.codec(u) for u in units) if c is not None]
        return {
            "units": len(codecs),
            "quantized_numel": sum(c.quantized_numel for c in codecs),
            "stored_bytes": sum(part.stored_nbytes(u) for u in units),
            "unquantized_bytes": sum(u.part_nbytes for u in units),
        }

    @property
    def param_nvme_bytes(self) -> int:
        """Bytes of the parameter partitions' swap files."""
        return self.partitioner.bytes_on_disk

    def module_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model's state dict, gathered unit by unit (collective)."""
        return self.partitioner.gathered_state_dict(self.module)

    def close(self) -> None:
        """Hooks off, partitions freed, swap files removed; the parameters stay partitioned (empty)."""
        self._close_meter()
        self.partitioner.close()

    def describe(self) -> str:
        """For the engine's repr."""
        q = self.quantization()
        quant = f", {q['units']} units quantized" if q["units"] else ""
        return (
            f"stage=3, offload_param={self.partitioner.tier}, units={len(self.partitioner.units)}, "
            f"params={self.trainable_numel}{quant}, no optimizer"
        )


def _partitioner(model: nn.Module, config: ZeroOffloadConfig, place: Placement, pool: PinnedPool) -> Any:
    """The stage-3 partitioner of an inference engine: the one that partitioned the model (zero.Init,
    zero.from_pretrained), else a new one - with the config's weight quantization set before the model is
    partitioned, so each selected weight is stored quantized from the start."""
    from zero.stage3.partitioner import Stage3Partitioner
    from zero.stage3.quant import quantization_plan

    cfg = config if hasattr(config, "weight_quantization") else load_config(config)
    wq = cfg.weight_quantization
    sink = _DroppedGradients()
    owners = {id(p.ds_unit.owner): p.ds_unit.owner for p in model.parameters() if hasattr(p, "ds_unit")}
    if not wq.enabled or owners:
        if wq.enabled and not all(o.quantizes for o in owners.values()):
            raise ConfigError(
                "weight_quantization: the model was partitioned without it (built under zero.Init?); its "
                "weights are quantized as they are partitioned: build the model normally and pass it to "
                "zero.initialize, or load it with zero.from_pretrained(path, config=...)"
            )
        return Stage3Partitioner.for_model(model, config, grad_sink=sink, device=place.device, pool=pool)
    part = Stage3Partitioner(config, grad_sink=sink, device=place.device, pool=pool)
    try:
        part.set_quantization(quantization_plan(model, wq))
        part.attach(model)
    except BaseException:
        part.close()
        raise
    return part


def inference_layout(
    model: nn.Module,
    params: List[nn.Parameter],
    place: Placement,
    pool: PinnedPool,
    config: ZeroOffloadConfig,
) -> Union[ReplicatedLayout, PartitionedLayout]:
    """The layout of an engine without an optimizer at `place.stage`, its forwards metered."""
    if place.stage == 3:
        layout: Union[ReplicatedLayout, PartitionedLayout] = PartitionedLayout(
            model, params, place, pool, config
        )
    else:
        layout = ReplicatedLayout(model, params, place, pool)
    layout.meter = ForwardMeter(model, place.device)
    return layout
