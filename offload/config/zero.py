"""The ``"zero_optimization"`` section with its ``offload_optimizer`` / ``offload_param`` subsections.

Defaults are DeepSpeed's (deepspeed/runtime/zero/config.py and offload_config.py). Stage 3 and parameter
offload are parsed and validated fully; whether the engine can run them is the engine's decision.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

from ._reader import ConfigError, Context, Section, is_off_value
from .usage import warn_ignored

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Smallest zero_optimization.sub_group_size, in elements. A sub-group is the unit of the offloaded optimizer
# step and of NVMe swapping: the engine cuts the partition into chunks of at most sub_group_size elements
# (offload/swap/slots.py `plan_slot_numel` and `swap_chunk`); each chunk is one I/O
# request per pass and one region [master | states] of its swap file, padded to whole 4 KiB blocks (the
# swap alignment, offload/swap/slots.py `slot_bytes`). 1024 fp32 elements per array make every
# region a whole number of blocks for any number of states; a sub-group of 1 element would cost one request
# per element and, for Adam, 341x the disk space (4096 bytes for 12 bytes of state). DeepSpeed's default
# is 1e9.
MIN_SUB_GROUP_SIZE = 1024

_SUB_GROUP_WHY = (
    "the unit of the offloaded optimizer step and of NVMe swapping: each sub-group costs at least one I/O"
    " request and is padded to whole 4 KiB blocks in the swap files, so smaller ones multiply the requests"
    " and the disk space, 341x for Adam at 1 element; DeepSpeed's default is 1e9"
)
_NVME_BUFFER_WHY = "device 'nvme' swaps through these staging buffers and needs at least one"
_NVME_BUFFER_SIZE_WHY = "device 'nvme' reads partitions through staging buffers of this many elements"

_OFFLOAD_OPTIMIZER_KEYS = (
    "device",
    "nvme_path",
    "pin_memory",
    "buffer_count",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
    "max_in_cpu",
    "super_offload",
    "convert_grad_on_cpu",
    "cpuadam_cores_perc",
    "nvme_copies",
)

_OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")

# Modelled keys (fields of ZeroConfig) in the order to_dict writes them.
_ZERO_FIELDS = (
    "stage",
    "contiguous_gradients",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "load_from_fp32_weights",
    "ignore_unused_parameters",
    "round_robin_gradients",
    "sub_group_size",
    "offload_optimizer",
    "offload_param",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "memory_efficient_linear",
    "override_module_apply",
    "enable_sanity_checks",
)

# DeepSpeed's deprecated spellings, mapped onto the modern keys.
_LEGACY = (
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
)

# Keys accepted only while they leave their feature off; each names what turning it on would mean.
_OFF_ONLY = {
    "elastic_checkpoint": (lambda v: v is False, "elastic checkpoints (true)"),
    "legacy_stage1": (lambda v: v is False, "the legacy stage-1 implementation (true)"),
    "zero_hpz_partition_size": (lambda v: v in (0, 1), "ZeRO++ hierarchical partitioning (size > 1)"),
    "zero_quantized_weights": (lambda v: v is False, "ZeRO++ quantized weights (true)"),
    "zero_quantized_nontrainable_weights": (lambda v: v is False, "quantized non-trainable weights (true)"),
    "zero_quantized_gradients": (lambda v: v is False, "ZeRO++ quantized gradients (true)"),
    "zeropp_loco_param": (is_off_value, "LoCo-ZeRO++ (zeropp_loco_param)"),
    "mics_shard_size": (lambda v: v in (-1, 0), "MiCS sharding (mics_shard_size > 0)"),
    "mics_hierarchical_params_gather": (lambda v: v is False, "MiCS hierarchical gather (true)"),
    "pipeline_loading_checkpoint": (lambda v: v is False, "pipelined checkpoint loading (true)"),
    "save_muon_momentum_buffer_in_memory": (lambda v: v is False, "the Muon optimizer's buffers (true)"),
}

# DeepSpeed's pydantic model names these fields without the "stage3_" prefix and accepts both spellings.
STAGE3_SHORT_NAMES = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)

_ZENFLOW_INSTEAD = (
    "ZenFlow (the zenflow section) is not supported; what zero-offload offers for the same goal - keeping"
    " the GPU busy while the CPU steps the optimizer - is zero_offload.delayed_update (the host step of"
    " step t runs during step t+1's forward and backward, one step stale, as ZenFlow's asynchronous"
    " update), offload_optimizer.pipeline_read / pipeline_write (NVMe sub-groups stepped while backward"
    " runs, speculatively under gradient clipping) and offload_optimizer.ratio below 1.0 (Twin-Flow: that"
    " share of the optimizer state stepped on the device); remove the zenflow section"
)

# Keys that only tune logging, debugging or zero.Init memory use: accepted, warned about, not acted on.
_IGNORED = {
    "log_trace_cache_warnings": "trace-cache logging of DeepSpeed's stage-3 prefetcher",
    "stage3_partition_stream_chunk_size": "a zero.Init memory-bound knob of DeepSpeed's partitioner",
    "leaf_module": "DeepSpeed's stage-3 leaf-module hook grouping",
}

ZERO_KEYS = _ZERO_FIELDS + _LEGACY + tuple(_OFF_ONLY) + tuple(_IGNORED) + STAGE3_SHORT_NAMES + ("zenflow",)


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where optimizer states live and the optimizer step runs (``device`` cpu or nvme: on the CPU)."""

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True  # DeepSpeed's default is false; the engine always pins (usage.py: ignored)
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0
    nvme_copies: Union[str, int] = "auto"  # NVMe copies of the state: "auto" | 1 (in place) | 2 (atomic)
    # nvme: elements whose optimizer state stays in pinned host memory (multiples of
    # min(sub_group_size, 2048)); "auto": as many as the pinned budget holds after everything else pinned
    max_in_cpu: Union[int, str] = "auto"

    @property
    def pipeline(self) -> bool:
        """Whether the optimizer steps during backward (pipeline_read or pipeline_write)."""
        return self.pipeline_read or self.pipeline_write


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where stage-3 parameter partitions live; the buffer sizes are in elements (DeepSpeed's unit)."""

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    # nvme: elements of partitions kept in host memory; "auto": as many as the pinned budget holds (all of a
    # model that fits, so a forward reads nothing from disk), the rest streamed (zero/stage3/store.py)
    max_in_cpu: Union[int, str] = "auto"


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO partitioning and offload; sizes are element counts, as in DeepSpeed."""

    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    load_from_fp32_weights: bool = True
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False
    sub_group_size: int = 1_000_000_000
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    offload_param: Optional[OffloadParamConfig] = None
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_model_persistence_threshold: int = sys.maxsize
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    # GatheredParameters without modifier_rank raises when the block changed a parameter (DeepSpeed's check)
    enable_sanity_checks: bool = False


def _nvme_path(s: Section, device: str) -> Optional[str]:
    path = s.str("nvme_path", None, allow_none=True)
    if path is not None and not path.strip():
        raise s.fail("nvme_path", "must be a non-empty path")
    if device == "nvme" and path is None:
        raise s.fail("nvme_path", "is required when device is 'nvme' (the directory to swap to)")
    return path


def _nvme_copies(s: Section) -> Union[str, int]:
    """`nvme_copies`: "auto" (two copies when the disk has room, else one), 1 or 2."""
    value = s.get("nvme_copies", OffloadOptimizerConfig.nvme_copies)
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value in (1, 2)):
        return value
    raise s.fail("nvme_copies", f'must be "auto", 1 or 2, got {value!r}')


def _max_in_cpu(s: Section) -> Union[int, str]:
    """`max_in_cpu`: "auto" (the default: what the pinned budget holds) or a count of elements >= 0."""
    if s.get("max_in_cpu", "auto") == "auto":
        return "auto"
    return s.int("max_in_cpu", 0, min=0)


def _nvme_min(device: str) -> int:
    """Staging-buffer keys are only read for NVMe; there 0 buffers (or 0 elements each) cannot work."""
    return 1 if device == "nvme" else 0


def parse_offload_optimizer(raw: Any, ctx: Context, path: str) -> OffloadOptimizerConfig:
    """Validate an `offload_optimizer` section; warns about ignored keys."""
    s = Section(raw, path, ctx, _OFFLOAD_OPTIMIZER_KEYS)
    device = s.choice("device", OffloadOptimizerConfig.device, OFFLOAD_DEVICES)
    s.off_only("super_offload", lambda v: v is False, "SuperOffload for superchips (true)")
    # Only read by DeepSpeed's SuperOffload, which is refused above; still checked for type and range.
    s.ignored_unless(
        "convert_grad_on_cpu",
        s.bool("convert_grad_on_cpu", True),
        True,
        "read only by DeepSpeed's SuperOffload",
    )
    s.ignored_unless(
        "cpuadam_cores_perc",
        s.float("cpuadam_cores_perc", 0.8, min=0.0, max=1.0),
        0.8,
        "read only by DeepSpeed's SuperOffload; the CPU optimizer uses torch's thread count",
    )
    ratio = s.float("ratio", OffloadOptimizerConfig.ratio, min=0.0, max=1.0)
    max_in_cpu = _max_in_cpu(s)
    out = OffloadOptimizerConfig(
        device=device,
        nvme_path=_nvme_path(s, device),
        pin_memory=s.bool("pin_memory", OffloadOptimizerConfig.pin_memory),
        buffer_count=s.int(
            "buffer_count", OffloadOptimizerConfig.buffer_count, min=_nvme_min(device), why=_NVME_BUFFER_WHY
        ),
        pipeline_read=s.bool("pipeline_read", OffloadOptimizerConfig.pipeline_read),
        pipeline_write=s.bool("pipeline_write", OffloadOptimizerConfig.pipeline_write),
        fast_init=s.bool("fast_init", OffloadOptimizerConfig.fast_init),
        ratio=ratio,
        nvme_copies=_nvme_copies(s),
        max_in_cpu=max_in_cpu,
    )
    if out.nvme_copies == 1 and out.pipeline and device == "nvme":
        raise s.fail(
            "nvme_copies",
            "1 cannot be combined with pipeline_read/pipeline_write: stepping sub-groups during backward "
            'needs a second copy to fall back to when the pass is dropped (use 2 or "auto")',
        )
    warn_ignored(s, "zero_optimization.offload_optimizer.", out)
    return out


def parse_offload_param(raw: Any, ctx: Context, path: str) -> OffloadParamConfig:
    """Validate an `offload_param` section."""
    s = Section(raw, path, ctx, _OFFLOAD_PARAM_KEYS)
    device = s.choice("device", OffloadParamConfig.device, OFFLOAD_DEVICES)
    return OffloadParamConfig(
        device=device,
        nvme_path=_nvme_path(s, device),
        pin_memory=s.bool("pin_memory", OffloadParamConfig.pin_memory),
        buffer_count=s.int(
            "buffer_count", OffloadParamConfig.buffer_count, min=_nvme_min(device), why=_NVME_BUFFER_WHY
        ),
        buffer_size=s.int(
            "buffer_size", OffloadParamConfig.buffer_size, min=_nvme_min(device), why=_NVME_BUFFER_SIZE_WHY
        ),
        max_in_cpu=_max_in_cpu(s),
    )


def _legacy_replacing(s: Section, old: str, new: str) -> None:
    """DeepSpeed refuses a deprecated key next to the key that replaced it; so do we."""
    if s.has(old) and s.has(new):
        raise s.fail(old, f"is the deprecated spelling of '{s.key(new)}'; give only one of them")


def parse_zero(raw: Any, ctx: Context, *, legacy_allgather_size: Any = None) -> ZeroConfig:
    """Validate the `zero_optimization` section (legacy spellings mapped, ignored keys warned about)."""
    if isinstance(raw, bool):
        # DeepSpeed's oldest format: "zero_optimization": true means stage 1.
        ctx.warn_once(
            "zero_optimization",
            "'zero_optimization': true/false is DeepSpeed's deprecated format; use {\"stage\": N}",
        )
        raw = {"stage": 1 if raw else 0}
        if raw["stage"] and legacy_allgather_size is not None:
            raw["allgather_bucket_size"] = legacy_allgather_size
    raw = _short_names_mapped(raw, ctx)
    s = Section(raw, "zero_optimization", ctx, ZERO_KEYS)
    if s.has("zenflow") and not is_off_value(s.get("zenflow")):
        raise s.fail("zenflow", _ZENFLOW_INSTEAD)

    for name, (is_off, what) in _OFF_ONLY.items():
        s.off_only(name, is_off, what)
    for name, reason in _IGNORED.items():
        s.ignored(name, reason)

    stage = s.int("stage", ZeroConfig.stage, min=0, max=3)

    _legacy_replacing(s, "cpu_offload", "offload_optimizer")
    _legacy_replacing(s, "cpu_offload_param", "offload_param")
    _legacy_replacing(
        s, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
    )

    legacy_pin = s.bool("cpu_offload_use_pin_memory", None)
    offload_optimizer = _offload_section(
        s, "offload_optimizer", "cpu_offload", legacy_pin, parse_offload_optimizer
    )
    offload_param = _offload_section(s, "offload_param", "cpu_offload_param", legacy_pin, parse_offload_param)
    if legacy_pin is not None and not (s.has("cpu_offload") or s.has("cpu_offload_param")):
        ctx.warn_once(
            s.key("cpu_offload_use_pin_memory"),
            f"'{s.key('cpu_offload_use_pin_memory')}' only applies together with the deprecated 'cpu_offload'"
            " or 'cpu_offload_param'; set pin_memory inside offload_optimizer / offload_param instead",
        )

    if offload_param is not None and offload_param.device != "none" and stage != 3:
        ctx.warn_once(
            s.key("offload_param"),
            f"'{s.key('offload_param')}' only applies to stage 3; it has no effect at stage {stage}",
        )

    gather16_name = "stage3_gather_16bit_weights_on_model_save"
    if s.has("stage3_gather_fp16_weights_on_model_save"):
        gather16_name = "stage3_gather_fp16_weights_on_model_save"

    # DeepSpeed resolves an unset overlap_comm to "on for stage 3 only".
    overlap_comm = s.bool("overlap_comm", None)
    if overlap_comm is None:
        overlap_comm = stage == 3

    out = ZeroConfig(
        stage=stage,
        contiguous_gradients=s.bool("contiguous_gradients", ZeroConfig.contiguous_gradients),
        overlap_comm=overlap_comm,
        reduce_scatter=s.bool("reduce_scatter", ZeroConfig.reduce_scatter),
        reduce_bucket_size=s.int("reduce_bucket_size", ZeroConfig.reduce_bucket_size, min=0),
        use_multi_rank_bucket_allreduce=s.bool(
            "use_multi_rank_bucket_allreduce", ZeroConfig.use_multi_rank_bucket_allreduce
        ),
        allgather_partitions=s.bool("allgather_partitions", ZeroConfig.allgather_partitions),
        allgather_bucket_size=s.int("allgather_bucket_size", ZeroConfig.allgather_bucket_size, min=0),
        load_from_fp32_weights=s.bool("load_from_fp32_weights", ZeroConfig.load_from_fp32_weights),
        ignore_unused_parameters=s.bool("ignore_unused_parameters", ZeroConfig.ignore_unused_parameters),
        round_robin_gradients=s.bool("round_robin_gradients", ZeroConfig.round_robin_gradients),
        sub_group_size=_sub_group_size(s),
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        stage3_prefetch_bucket_size=s.int(
            "stage3_prefetch_bucket_size", ZeroConfig.stage3_prefetch_bucket_size, min=0
        ),
        stage3_param_persistence_threshold=s.int(
            "stage3_param_persistence_threshold", ZeroConfig.stage3_param_persistence_threshold, min=0
        ),
        stage3_model_persistence_threshold=s.int(
            "stage3_model_persistence_threshold", ZeroConfig.stage3_model_persistence_threshold, min=0
        ),
        stage3_max_live_parameters=s.int(
            "stage3_max_live_parameters", ZeroConfig.stage3_max_live_parameters, min=0
        ),
        stage3_max_reuse_distance=s.int(
            "stage3_max_reuse_distance", ZeroConfig.stage3_max_reuse_distance, min=0
        ),
        stage3_gather_16bit_weights_on_model_save=s.bool(
            gather16_name, ZeroConfig.stage3_gather_16bit_weights_on_model_save
        ),
        stage3_module_granularity_threshold=s.int(
            "stage3_module_granularity_threshold", ZeroConfig.stage3_module_granularity_threshold, min=0
        ),
        stage3_use_all_reduce_for_fetch_params=s.bool(
            "stage3_use_all_reduce_for_fetch_params", ZeroConfig.stage3_use_all_reduce_for_fetch_params
        ),
        stage3_allgather_sequential=s.bool(
            "stage3_allgather_sequential", ZeroConfig.stage3_allgather_sequential
        ),
        memory_efficient_linear=s.bool("memory_efficient_linear", ZeroConfig.memory_efficient_linear),
        override_module_apply=s.bool("override_module_apply", ZeroConfig.override_module_apply),
        enable_sanity_checks=s.bool("enable_sanity_checks", ZeroConfig.enable_sanity_checks),
    )
    warn_ignored(s, "zero_optimization.", out)
    return out


def _offload_section(s: Section, name: str, legacy: str, legacy_pin: Optional[bool], parse: Any) -> Any:
    if s.has(legacy):
        # "cpu_offload": true is DeepSpeed's old spelling of {"device": "cpu"}.
        if not s.bool(legacy, False):
            return None
        raw: Dict[str, Any] = {"device": "cpu"}
        if legacy_pin is not None:
            raw["pin_memory"] = bool(legacy_pin)
        return parse(raw, s.ctx, s.key(name))
    raw_section = s.mapping(name)
    if raw_section is None:
        return None
    return parse(raw_section, s.ctx, s.key(name))


def _short_names_mapped(raw: Any, ctx: Context) -> Any:
    """`raw` with DeepSpeed's prefix-less field names (`param_persistence_threshold`, ...) under their
    `stage3_` keys; both spellings of one field: ConfigError."""
    if not isinstance(raw, Mapping) or not any(k in raw for k in STAGE3_SHORT_NAMES):
        return raw
    out = dict(raw)
    for short in STAGE3_SHORT_NAMES:
        if short in out:
            long = "stage3_" + short
            if long in out:
                raise ConfigError(
                    f"zero_optimization.{short} and zero_optimization.{long} in {ctx.source}: both name the"
                    " same setting (DeepSpeed accepts either spelling); give only one"
                )
            out[long] = out.pop(short)
    return out


def _sub_group_size(s: Section) -> int:
    """DeepSpeed accepts any size >= 0; below MIN_SUB_GROUP_SIZE the engine uses MIN_SUB_GROUP_SIZE, with a
    warning naming it (see _SUB_GROUP_WHY)."""
    size = s.int("sub_group_size", ZeroConfig.sub_group_size, min=0)
    if size < MIN_SUB_GROUP_SIZE:
        s.ctx.warn_once(
            s.key("sub_group_size"),
            f"config key '{s.key('sub_group_size')}' = {size} is below {MIN_SUB_GROUP_SIZE}:"
            f" {MIN_SUB_GROUP_SIZE} is used (a sub-group is {_SUB_GROUP_WHY})",
        )
        size = MIN_SUB_GROUP_SIZE
    return size
