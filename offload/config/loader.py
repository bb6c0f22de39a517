"""``load_config``: a DeepSpeed JSON config (dict, file or None) -> a validated, frozen ZeroOffloadConfig."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from ._reader import ConfigError, Context, Section, is_off_value, read_json_file
from .activation import ActivationCheckpointingConfig, parse_activation_checkpointing
from .aio import AioConfig, parse_aio
from .data_types import DataTypesConfig, parse_allreduce_op, parse_data_types
from .optimizer import OptimizerConfig, SchedulerConfig, parse_optimizer, parse_scheduler
from .precision import BF16Config, FP16Config, parse_bf16, parse_fp16
from .quantization import WeightQuantizationConfig, parse_weight_quantization
from .zero import ZeroConfig, parse_zero

_MODELLED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "zero_optimization",
    "aio",
    "zero_offload",
    "activation_checkpointing",
    "weight_quantization",
    "checkpoint",
    "data_types",
    "gradient_allreduce_op",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
)

# Legacy spellings DeepSpeed still reads.
_ALIASES = ("bfloat16", "allgather_size")

# Logging, profiling, monitoring and tooling keys: they do not change what a step computes, so they are
# accepted, reported once with a warning (unless they are switched off anyway) and otherwise ignored.
IGNORED_TOP_LEVEL: Dict[str, str] = {
    "tensorboard": "zero-offload has no TensorBoard monitor",
    "wandb": "zero-offload has no Weights & Biases monitor",
    "csv_monitor": "zero-offload has no CSV monitor",
    "comet": "zero-offload has no Comet monitor",
    "flops_profiler": "zero-offload has no FLOPs profiler",
    "comms_logger": "zero-offload does not log collectives",
    "timers": "DeepSpeed's throughput timers; use zero_offload.report",
    "memory_breakdown": "DeepSpeed's memory printout; use zero_offload.report",
    "dump_state": "DeepSpeed's debug dump of its own state",
    "autotuning": "read by DeepSpeed's autotuner launcher, not by the engine",
    "pipeline": "only read by DeepSpeed's PipelineEngine (pipeline parallelism)",
    "dataloader_drop_last": "only read by DeepSpeed's own data loader, which zero-offload does not provide",
    "vocabulary_size": "a hint for DeepSpeed's sparse-embedding path",
    "seq_parallel_communication_data_type": "only used by DeepSpeed's sequence parallelism",
}


def _enabled_false(value: Any) -> bool:
    return is_off_value(value)


# Keys that change what training computes (or how state is stored): accepted only while off, i.e. exactly
# as if they were absent; turned on they are a ConfigError "not supported yet".
OFF_ONLY_TOP_LEVEL: Dict[str, Tuple[Any, str]] = {
    "amp": (_enabled_false, "NVIDIA Apex AMP (amp.enabled: true)"),
    "torch_autocast": (_enabled_false, "torch autocast (torch_autocast.enabled: true)"),
    "communication_data_type": (lambda v: v is None, "a communication data type other than the default"),
    "prescale_gradients": (lambda v: v is False, "gradient prescaling (prescale_gradients: true)"),
    "gradient_predivide_factor": (
        lambda v: v == 1 and not isinstance(v, bool),
        "gradient_predivide_factor != 1.0",
    ),
    "sparse_gradients": (lambda v: v is False, "sparse gradients (sparse_gradients: true)"),
    "disable_allgather": (lambda v: v is False, "disable_allgather: true"),
    "graph_harvesting": (lambda v: v is False, "graph harvesting (graph_harvesting: true)"),
    "elasticity": (_enabled_false, "elastic training (elasticity.enabled: true)"),
    "compression_training": (lambda v: v is None or v == {}, "compression training"),
    "data_efficiency": (_enabled_false, "data efficiency (data_efficiency.enabled: true)"),
    "curriculum_learning": (_enabled_false, "curriculum learning (curriculum_learning.enabled: true)"),
    "progressive_layer_drop": (
        _enabled_false,
        "progressive layer drop (progressive_layer_drop.enabled: true)",
    ),
    "eigenvalue": (_enabled_false, "eigenvalue computation (eigenvalue.enabled: true)"),
    "quantize_training": (_enabled_false, "quantized training (quantize_training.enabled: true)"),
    "sparse_attention": (lambda v: v is None or v == {}, "DeepSpeed sparse attention"),
    "hybrid_engine": (_enabled_false, "the RLHF hybrid engine (hybrid_engine.enabled: true)"),
    "compile": (_enabled_false, "DeepSpeed compile (compile.enabled: true)"),
    "nebula": (_enabled_false, "the Nebula checkpoint service (nebula.enabled: true)"),
    "tensor_parallel": (
        lambda v: v is None or (isinstance(v, Mapping) and v.get("autotp_size", 0) in (0, 1)),
        "automatic tensor parallelism (tensor_parallel.autotp_size > 1)",
    ),
    "use_data_before_expert_parallelism": (lambda v: v is False, "mixture-of-experts topology options"),
}

TOP_LEVEL_KEYS = _MODELLED + _ALIASES + tuple(IGNORED_TOP_LEVEL) + tuple(OFF_ONLY_TOP_LEVEL)

# Keys inside "checkpoint" that would change where or how checkpoints are read/written.
_CHECKPOINT_OFF_ONLY = {
    "load_universal": "loading universal checkpoints (load_universal: true)",
    "use_node_local_storage": "node-local checkpoint storage (use_node_local_storage: true)",
}


@dataclass(frozen=True)
class CheckpointConfig:
    """The `checkpoint` section: `tag_validation` ("Ignore", "Warn" or "Fail"), what `save_checkpoint` does
    when ranks give different tags. DeepSpeed's default is "Warn"."""

    tag_validation: str = "Warn"


@dataclass(frozen=True)
class DelayedUpdateConfig:
    """`zero_offload.delayed_update`: the host optimizer step of step t runs while step t+1's forward and
    backward run (one step of staleness, after `warmup_steps` ordinary steps); zero/optimizer/delayed.py."""

    enabled: bool = False
    warmup_steps: int = 0


@dataclass(frozen=True)
class ZeroOffloadSection:
    """Our own keys (DeepSpeed has none of them): the per-step report, the pinned-memory cap, int8
    activations for the products of quantized weights, and the delayed host update."""

    report: bool = False
    report_every: int = 1
    # None: $ZERO_OFFLOAD_PINNED_BUDGET if set, else offload.pinned.automatic_pinned_budget(): half of
    # min(physical memory, cgroup memory limit), shared by the processes of this node.
    pinned_budget_bytes: Optional[int] = None
    # CPU inference forwards of weight_quantization's Linears: activations rounded to int8 per group too
    # (offload.ops.qmatmul.quantized_linear); needs weight_quantization.
    int8_activations: bool = False
    delayed_update: DelayedUpdateConfig = field(default_factory=DelayedUpdateConfig)
    # the plan's predicted seconds per optimizer step (or per forward without an optimizer), as
    # `ds-estimate-memory --plan` writes it: the reports show it beside the measurement
    predicted_seconds: Optional[float] = None


@dataclass(frozen=True)
class ZeroOffloadConfig:
    """A validated DeepSpeed config. Attribute names are DeepSpeed's JSON keys; batch sizes are resolved."""

    train_batch_size: int = 1
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    zero_offload: ZeroOffloadSection = field(default_factory=ZeroOffloadSection)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    weight_quantization: WeightQuantizationConfig = field(default_factory=WeightQuantizationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    gradient_allreduce_op: str = "mean"
    # DeepSpeed's checks of a client optimizer the kernels do not implement (zero.optimizer.torch_step):
    # outside the tested list it needs the first true; under ZeRO-Offload the second false
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True

    def to_dict(self) -> Dict[str, Any]:
        """Every modelled key with its resolved value, as JSON-ready dicts and lists; loads back equal."""
        return _jsonable(dataclasses.asdict(self))


# What the public entry points take as a config: a loaded one, a dict, a JSON path, or None (defaults)
ConfigInput = Union[ZeroOffloadConfig, Mapping[str, Any], str, os.PathLike, None]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def load_config(
    config: Union[Mapping[str, Any], str, os.PathLike, None] = None, world_size: int = 1
) -> ZeroOffloadConfig:
    """Validate a DeepSpeed config (a dict, a path to a JSON file, or None for all defaults).

    ``world_size`` is the number of data-parallel ranks, used to resolve the batch sizes as DeepSpeed does:
    ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
    Raises ConfigError naming the key, the source and the closest valid key for anything not accepted.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if config is None:
        raw: Any = {}
        source = "<defaults>"
    elif isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        raw = read_json_file(source)
    elif isinstance(config, Mapping):
        raw = config
        source = "<dict>"
    else:
        raise ConfigError(
            f"config must be a dict, a path to a JSON file, or None; got {type(config).__name__}"
        )
    return _parse(raw, Context(source), world_size)


def _parse(raw: Any, ctx: Context, world_size: int) -> ZeroOffloadConfig:
    if isinstance(raw, Mapping) and "checkpoint_activations" in raw:
        # Megatron's --checkpoint-activations flag, as DeepSpeed tutorials write it; not a DeepSpeed key.
        raise ConfigError(
            f"checkpoint_activations in {ctx.source}: is not a config key; activation checkpointing is"
            " configured by the 'activation_checkpointing' section (e.g. {\"activation_checkpointing\":"
            ' {"cpu_checkpointing": true}}) and applied with zero.checkpointing.apply(model) or'
            " model.gradient_checkpointing_enable()"
        )
    top = Section(raw, "", ctx, TOP_LEVEL_KEYS)

    for name, (is_off, what) in OFF_ONLY_TOP_LEVEL.items():
        top.off_only(name, is_off, what)
    for name, reason in IGNORED_TOP_LEVEL.items():
        top.ignored(name, reason)
    checkpoint = _parse_checkpoint(top.get("checkpoint"), ctx)

    if top.has("bf16") and top.has("bfloat16"):
        raise top.fail("bfloat16", "is the old spelling of 'bf16'; give only one of them")
    bf16 = parse_bf16(
        top.get("bf16", top.get("bfloat16")), ctx, "bfloat16" if top.has("bfloat16") else "bf16"
    )
    fp16 = parse_fp16(top.get("fp16"), ctx)
    if fp16.enabled and bf16.enabled:
        raise ConfigError(
            f"fp16.enabled and bf16.enabled in {ctx.source}: enable at most one of fp16 and bf16"
        )

    if top.has("allgather_size") and not isinstance(top.get("zero_optimization"), bool):
        raise top.fail(
            "allgather_size",
            "only applies to the deprecated 'zero_optimization': true; use"
            " zero_optimization.allgather_bucket_size",
        )
    zero = parse_zero(top.get("zero_optimization"), ctx, legacy_allgather_size=top.get("allgather_size"))

    train, micro, acc = _resolve_batch(top, world_size)
    model_dtype = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
    off = zero.offload_optimizer.device if zero.offload_optimizer is not None else "none"
    data_types = parse_data_types(top.get("data_types"), ctx, model_dtype, zero.stage, off)
    allreduce_op = parse_allreduce_op(top.get("gradient_allreduce_op", "mean"), ctx, world_size)
    zero_offload = _parse_zero_offload(top.get("zero_offload"), ctx)
    weight_quantization = parse_weight_quantization(top.get("weight_quantization"), ctx)
    if zero_offload.int8_activations and not weight_quantization.enabled:
        raise ConfigError(
            f"zero_offload.int8_activations in {ctx.source}: applies to the products of quantized weights;"
            " enable weight_quantization too, or remove the key"
        )
    steps_per_print = top.int("steps_per_print", ZeroOffloadConfig.steps_per_print, min=1, allow_none=True)

    return ZeroOffloadConfig(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=acc,
        gradient_clipping=top.float("gradient_clipping", ZeroOffloadConfig.gradient_clipping, min=0.0),
        # DeepSpeed's newest releases let null mean "never print"; 10 is its documented default.
        steps_per_print=ZeroOffloadConfig.steps_per_print if steps_per_print is None else steps_per_print,
        wall_clock_breakdown=top.bool("wall_clock_breakdown", ZeroOffloadConfig.wall_clock_breakdown),
        optimizer=parse_optimizer(top.get("optimizer"), ctx),
        scheduler=parse_scheduler(top.get("scheduler"), ctx),
        fp16=fp16,
        bf16=bf16,
        zero_optimization=zero,
        aio=parse_aio(top.get("aio"), ctx),
        zero_offload=zero_offload,
        activation_checkpointing=parse_activation_checkpointing(top.get("activation_checkpointing"), ctx),
        weight_quantization=weight_quantization,
        checkpoint=checkpoint,
        data_types=data_types,
        gradient_allreduce_op=allreduce_op,
        zero_allow_untested_optimizer=top.bool(
            "zero_allow_untested_optimizer", ZeroOffloadConfig.zero_allow_untested_optimizer
        ),
        zero_force_ds_cpu_optimizer=top.bool(
            "zero_force_ds_cpu_optimizer", ZeroOffloadConfig.zero_force_ds_cpu_optimizer
        ),
    )


def _parse_zero_offload(raw: Any, ctx: Context) -> ZeroOffloadSection:
    s = Section(
        raw,
        "zero_offload",
        ctx,
        (
            "report",
            "report_every",
            "pinned_budget_bytes",
            "int8_activations",
            "delayed_update",
            "predicted_seconds",
        ),
    )
    d = Section(s.mapping("delayed_update"), "zero_offload.delayed_update", ctx, ("enabled", "warmup_steps"))
    return ZeroOffloadSection(
        report=s.bool("report", ZeroOffloadSection.report),
        report_every=s.int("report_every", ZeroOffloadSection.report_every, min=1),
        pinned_budget_bytes=s.int("pinned_budget_bytes", None, min=0, allow_none=True),
        int8_activations=s.bool("int8_activations", ZeroOffloadSection.int8_activations),
        delayed_update=DelayedUpdateConfig(
            enabled=bool(d.bool("enabled", DelayedUpdateConfig.enabled)),
            warmup_steps=int(d.int("warmup_steps", DelayedUpdateConfig.warmup_steps, min=0) or 0),
        ),
        predicted_seconds=s.float("predicted_seconds", None, min=0.0, allow_none=True),
    )


def _parse_checkpoint(raw: Any, ctx: Context) -> CheckpointConfig:
    s = Section(
        raw,
        "checkpoint",
        ctx,
        ("tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer"),
    )
    tag_validation = s.choice("tag_validation", CheckpointConfig.tag_validation, ("Ignore", "Warn", "Fail"))
    for name, what in _CHECKPOINT_OFF_ONLY.items():
        s.bool(name, False)
        s.off_only(name, lambda v: v is False, what)
    s.off_only("writer", lambda v: v is None, "a custom checkpoint writer (checkpoint.writer)")
    if s.has("parallel_write"):
        pw = Section(s.get("parallel_write"), "checkpoint.parallel_write", ctx, ("pipeline_stage",))
        pw.bool("pipeline_stage", False)
        pw.off_only("pipeline_stage", lambda v: v is False, "pipeline-stage parallel checkpoint writes")
    return CheckpointConfig(tag_validation=tag_validation)


def _resolve_batch(top: Section, world_size: int) -> Tuple[int, int, int]:
    """DeepSpeed's rule: any two of the three batch keys determine the third; all three must agree."""
    train = top.int("train_batch_size", None, min=1, allow_none=True)
    micro = top.int("train_micro_batch_size_per_gpu", None, min=1, allow_none=True)
    acc = top.int("gradient_accumulation_steps", None, min=1, allow_none=True)

    if train is not None and micro is not None and acc is None:
        acc = train // micro // world_size
    elif train is not None and acc is not None and micro is None:
        micro = train // world_size // acc
    elif micro is not None and train is None:
        acc = 1 if acc is None else acc
        train = micro * acc * world_size
    elif train is not None and micro is None and acc is None:
        acc = 1
        micro = train // world_size
    elif train is None and micro is None:
        # DeepSpeed refuses a config without a batch size; zero-offload defaults to micro batch 1 so that
        # a config can be just {"zero_optimization": ...}.
        micro = 1
        acc = 1 if acc is None else acc
        train = micro * acc * world_size

    assert train is not None and micro is not None and acc is not None
    if micro < 1 or acc < 1 or train != micro * acc * world_size:
        names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        t, m, a = (_given(top, n, v) for n, v in zip(names, (train, micro, acc)))
        raise ConfigError(
            f"inconsistent batch sizes in {top.ctx.source}: train_batch_size ({t}) must equal"
            f" train_micro_batch_size_per_gpu ({m}) * gradient_accumulation_steps ({a})"
            f" * world_size ({world_size})"
        )
    return train, micro, acc


def _given(top: Section, name: str, value: int) -> str:
    return str(value) if top.has(name) else f"{value}, derived"
