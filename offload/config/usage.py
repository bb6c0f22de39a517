"""What the engine does with every modelled config key: reads it, or accepts and ignores it (with a warning
when the value asks for something the engine does not do). Keys and values the engine cannot honour at all
are refused while parsing (ConfigError); those are not listed here.

`FIELD_USAGE` covers every field of every config dataclass, by its path (`zero_optimization.stage`);
tests/test_config_keys.py walks the dataclasses and fails on a field missing here, and checks that every
READ field is read by code outside offload/config. `warn_ignored(section, values)` is called by the parse
functions: an IGNORED key given explicitly with a value outside its honoured values is warned about once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from ._reader import Section

__all__ = ["FIELD_USAGE", "IGNORED", "READ", "Usage", "warn_ignored"]

READ = "read"
IGNORED = "ignored"


@dataclass(frozen=True)
class Usage:
    """`kind` READ: `note` names the reader; IGNORED: `note` says why, `honoured` are the values that
    describe what the engine does anyway (given explicitly, they warn about nothing)."""

    kind: str
    note: str
    honoured: Tuple[Any, ...] = ()


def _r(where: str) -> Usage:
    return Usage(READ, where)


def _i(why: str, *honoured: Any) -> Usage:
    return Usage(IGNORED, why, honoured)


_Z = "zero_optimization."
_OO = "zero_optimization.offload_optimizer."
_OP = "zero_optimization.offload_param."
_WQ = "weight_quantization."

FIELD_USAGE: Dict[str, Usage] = {
    "train_batch_size": _r("zero/engine/engine.py (train_batch_size(), global_samples)"),
    "train_micro_batch_size_per_gpu": _r("zero/engine/engine.py, zero/initialization.py (the data loader)"),
    "gradient_accumulation_steps": _r("zero/engine/engine.py (accumulation boundary, loss scaling)"),
    "gradient_clipping": _r("zero/engine/engine.py, zero/optimizer/update.py (clipping coefficient)"),
    "steps_per_print": _r("zero/engine/engine.py (INFO log line on rank 0 every N steps, logger 'zero')"),
    "wall_clock_breakdown": _r("zero/engine/engine.py (prints the step report)"),
    "fp16": _r("zero/engine/engine.py (section)"),
    "bf16": _r("zero/engine/engine.py (section)"),
    "zero_optimization": _r("zero/engine/engine.py (section)"),
    "aio": _r("zero/engine/engine.py, zero/stage3, zero/checkpoint (section: every aio handle)"),
    "zero_offload": _r("zero/engine/engine.py (section)"),
    "optimizer": _r("zero/engine/engine.py (the update rule)"),
    "scheduler": _r("zero/engine/engine.py, zero/optimizer/schedulers.py"),
    "optimizer.type": _r("zero/engine/engine.py (rule_from_config)"),
    "optimizer.params": _r("zero/engine/engine.py (rule_from_config)"),
    "scheduler.type": _r("zero/optimizer/schedulers.py"),
    "scheduler.params": _r("zero/optimizer/schedulers.py"),
    "fp16.enabled": _r("zero/engine/engine.py (model dtype, loss scaling)"),
    "fp16.auto_cast": _r("zero/engine/engine.py (forward casts floating inputs to fp16)"),
    "fp16.loss_scale": _r("zero/engine/engine.py (static loss scale)"),
    "fp16.initial_scale_power": _r("zero/optimizer/loss_scaler.py"),
    "fp16.loss_scale_window": _r("zero/optimizer/loss_scaler.py"),
    "fp16.hysteresis": _r("zero/optimizer/loss_scaler.py"),
    "fp16.consecutive_hysteresis": _r("zero/optimizer/loss_scaler.py"),
    "fp16.min_loss_scale": _r("zero/optimizer/loss_scaler.py"),
    "bf16.enabled": _r("zero/engine/engine.py (model dtype)"),
    "bf16.check_grad_overflow": _r(
        "zero/engine/engine.py, zero/optimizer/update.py (skip steps with inf/nan gradients)"
    ),
    _Z + "stage": _r("zero/engine/engine.py (the layout)"),
    _Z + "contiguous_gradients": _i(
        "gradients always go into contiguous buffers (stage 2: the buckets; stages 0-1: a flat buffer)", True
    ),
    _Z + "overlap_comm": _r(
        "zero/layout/flat.py, zero/layout/grad_buckets.py (bucket reductions during backward; stage 2: "
        "two buckets)"
    ),
    _Z + "reduce_scatter": _i("stages 1-2 always reduce each bucket only to the ranks that own it", True),
    _Z + "reduce_bucket_size": _r("zero/layout/flat.py (GradReducer buckets; stage 2: GradBuckets size)"),
    _Z + "use_multi_rank_bucket_allreduce": _i(
        "buckets are reduced one collective per bucket; the multi-rank all-reduce variant is not used", True
    ),
    _Z + "allgather_partitions": _i("updated partitions are always all-gathered after the step", True),
    _Z + "allgather_bucket_size": _i(
        "the updated partitions are all-gathered in one collective, not in buckets", 500_000_000
    ),
    _Z + "load_from_fp32_weights": _r("zero/checkpoint/load.py (master from the 16-bit weights if false)"),
    _Z + "ignore_unused_parameters": _r("zero/engine/engine.py, zero/engine/unused.py"),
    _Z + "round_robin_gradients": _i("gradients are not reordered round-robin over ranks", False),
    _Z + "sub_group_size": _r("zero/engine/engine.py, offload/swap/slots.py (optimizer chunks)"),
    _Z + "offload_optimizer": _r("zero/engine/engine.py (optimizer tier)"),
    _Z + "offload_param": _r("zero/stage3/partitioner.py (parameter tier)"),
    _Z + "stage3_prefetch_bucket_size": _r("zero/stage3/partitioner.py (prefetch depth)"),
    _Z + "stage3_param_persistence_threshold": _r("zero/stage3/partitioner.py (persistent units)"),
    _Z + "stage3_model_persistence_threshold": _r("zero/stage3/partitioner.py (persistent units)"),
    _Z + "stage3_max_live_parameters": _r("zero/stage3/partitioner.py (gathered elements)"),
    _Z + "stage3_max_reuse_distance": _r("zero/stage3/partitioner.py (units kept for reuse)"),
    _Z + "stage3_gather_16bit_weights_on_model_save": _r(
        "zero/engine/engine.py (zero_gather_16bit_weights_on_model_save(); save_16bit_model at stage 3, "
        "zero/checkpoint/export16.py)"
    ),
    _Z + "stage3_module_granularity_threshold": _i("every module with parameters is its own unit", 0),
    _Z + "stage3_use_all_reduce_for_fetch_params": _i("parameters are fetched with all-gathers", False),
    _Z + "stage3_allgather_sequential": _i("each unit is gathered with one collective", False),
    _Z + "memory_efficient_linear": _i(
        "linear layers are plain torch modules; stage 3 releases gathered weights after use instead", True
    ),
    _Z + "override_module_apply": _i("zero.Init always gathers parameters for module.apply", True),
    _Z + "enable_sanity_checks": _r("zero/stage3/gathered.py (GatheredParameters without modifier_rank)"),
    _OO + "device": _r("zero/engine/engine.py (optimizer tier)"),
    _OO + "nvme_path": _r("zero/optimizer/tiers/build.py (swap space)"),
    _OO + "pin_memory": _i(
        "host buffers of the cpu/nvme tiers are always page-locked, up to zero_offload.pinned_budget_bytes",
        True,
    ),
    _OO + "buffer_count": _r("zero/optimizer/tiers/build.py (staging slots)"),
    _OO + "pipeline_read": _r("zero/engine/engine.py (optimizer steps during backward, via .pipeline)"),
    _OO + "pipeline_write": _r("zero/engine/engine.py (optimizer steps during backward, via .pipeline)"),
    _OO + "fast_init": _i("the initial NVMe state is always written in full", False),
    _OO + "nvme_copies": _r(
        "zero/optimizer/tiers/build.py (swap_copies: NVMe copies of the optimizer state)"
    ),
    _OO + "ratio": _r(
        "zero/optimizer/tiers/split.py (share of sub-groups on the offload tier, the rest on the device)"
    ),
    _OO + "max_in_cpu": _r("zero/optimizer/tiers/split.py (sub-groups kept in pinned host memory with nvme)"),
    _OP + "device": _r("zero/stage3/store.py (parameter tier)"),
    _OP + "nvme_path": _r("zero/stage3/store.py (swap space)"),
    _OP + "pin_memory": _r("zero/stage3/store.py (page-locked cpu tier)"),
    _OP + "buffer_count": _r("zero/stage3/store.py (staging slots)"),
    _OP + "buffer_size": _r("zero/stage3/store.py (staging slot size)"),
    _OP + "max_in_cpu": _r("zero/stage3/store.py (units kept in host memory with nvme)"),
    "aio.block_size": _r("offload/config/aio.py AioConfig.handle() (every aio handle)"),
    "aio.queue_depth": _r("offload/config/aio.py AioConfig.handle()"),
    "aio.intra_op_parallelism": _r("offload/config/aio.py AioConfig.handle()"),
    "aio.single_submit": _r("offload/config/aio.py AioConfig.handle()"),
    "aio.overlap_events": _r("offload/config/aio.py AioConfig.handle()"),
    "aio.use_gds": _r("refused when true at parse time (GPUDirect Storage is not supported)"),
    "aio.backend": _r("offload/config/aio.py AioConfig.handle()"),
    "activation_checkpointing": _r("zero/engine/engine.py (configures zero.checkpointing)"),
    "activation_checkpointing.partition_activations": _i(
        "one model-parallel rank holds whole activations: there is nothing to partition", False
    ),
    "activation_checkpointing.cpu_checkpointing": _r("offload/config/activation.py (offload_device 'cpu')"),
    "activation_checkpointing.contiguous_memory_optimization": _r("zero/activations/tiers.py (slots)"),
    "activation_checkpointing.number_checkpoints": _r("zero/activations/tiers.py (slot count)"),
    "activation_checkpointing.synchronize_checkpoint_boundary": _r("zero/activations/checkpointer.py"),
    "activation_checkpointing.profile": _r("zero/activations/stash.py (timings in the step report)"),
    "activation_checkpointing.offload_device": _r("zero/activations/checkpointer.py (make_tier)"),
    "activation_checkpointing.nvme_path": _r("zero/activations/nvme.py (NvmeTier scratch files)"),
    "zero_offload.report": _r("zero/engine/engine.py (prints the step report)"),
    "zero_offload.report_every": _r("zero/engine/engine.py"),
    "zero_offload.pinned_budget_bytes": _r("zero/engine/engine.py, zero/stage3 (pinned pool cap)"),
    "zero_offload.predicted_seconds": _r("zero/report.py (the plan's prediction beside the measurement)"),
    "zero_offload.int8_activations": _r("zero/stage3/fused.py (integer products of quantized Linears)"),
    "zero_offload.delayed_update": _r("zero/optimizer/delayed.py (section)"),
    "zero_offload.delayed_update.enabled": _r("zero/optimizer/delayed.py (DelayedUpdate)"),
    "zero_offload.delayed_update.warmup_steps": _r("zero/optimizer/delayed.py (ordinary steps first)"),
    "checkpoint": _r("zero/checkpoint/save.py (section)"),
    "data_types": _r("offload/config/data_types.py (section)"),
    "data_types.grad_accum_dtype": _r(
        "offload/config/data_types.py (honoured where the layouts accumulate in that dtype, else refused)"
    ),
    "gradient_allreduce_op": _r(
        "offload/config/data_types.py ('mean' is what zero/optimizer/update.py does)"
    ),
    "zero_allow_untested_optimizer": _r(
        "zero/optimizer/torch_step.py (a client optimizer the kernels do not implement needs it true)"
    ),
    "zero_force_ds_cpu_optimizer": _r(
        "zero/optimizer/torch_step.py (false lets such a client optimizer step offloaded states)"
    ),
    "checkpoint.tag_validation": _r("zero/checkpoint/save.py (tags compared across ranks before a save)"),
    "weight_quantization": _r("zero/inference/parts.py (stage 3 without an optimizer; refused with one)"),
    _WQ + "quantized_initialization": _r("zero/stage3/quant.py (every Linear/Embedding/Conv1D weight)"),
    _WQ + "quantized_initialization.num_bits": _r("zero/stage3/quant.py (int8 or int4 codes)"),
    _WQ + "quantized_initialization.group_size": _r("zero/stage3/quant.py (elements per scale)"),
    _WQ + "quantized_initialization.group_dim": _r("zero/stage3/quant.py (1 only: refused otherwise)"),
    _WQ + "quantized_initialization.symmetric": _r("zero/stage3/quant.py (offset or not)"),
    _WQ + "post_init_quant": _r("zero/stage3/quant.py (modules by name substring)"),
}


def warn_ignored(s: Section, prefix: str, values: Any) -> None:
    """Warn once about each IGNORED key of section `s` (path `prefix` + name) that the config gives
    explicitly with a value outside its honoured values; `values` is the parsed dataclass."""
    for path, usage in FIELD_USAGE.items():
        if usage.kind != IGNORED or not path.startswith(prefix):
            continue
        name = path[len(prefix) :]
        if "." in name or not s.has(name):
            continue
        value = getattr(values, name)
        if value not in usage.honoured:
            s.ignored_unless(name, value, usage.honoured[0], usage.note)
