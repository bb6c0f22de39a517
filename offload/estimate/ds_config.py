"""Read the estimator's inputs from a DeepSpeed-style JSON config with plain json.

Only the keys that change memory are read: zero_optimization.stage, .offload_optimizer,
.offload_param, .sub_group_size, fp16/bf16, optimizer.type, train_micro_batch_size_per_gpu and where
activation checkpoints wait (activation_checkpointing.offload_device / cpu_checkpointing).
Values written "auto" (the Hugging Face integration's placeholder) count as not set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

from offload.config.zero import MIN_SUB_GROUP_SIZE

from .counting import read_json_file
from .errors import EstimateInputError
from .placement import OFFLOAD_DEVICES


@dataclass(frozen=True)
class ConfigChoices:
    """What a config fixes; None where it says nothing (the command line or the defaults decide)."""

    path: str
    stage: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    precision: Optional[str] = None
    optimizer: Optional[str] = None  # lower-cased optimizer.type, not yet checked against the known ones
    optimizer_state_dtype: Optional[str] = None  # optimizer.params.state_dtype / fp32_optimizer_states
    micro_batch_size: Optional[int] = None
    checkpoint_device: Optional[str] = None  # activation_checkpointing: "none", "cpu" or "nvme"
    buffers: Dict[str, object] = field(default_factory=dict)  # SwapBufferSettings keyword arguments
    optimizer_max_in_cpu: Union[int, str, None] = None  # offload_optimizer.max_in_cpu: a count or "auto"
    pinned_budget_bytes: Optional[int] = None  # zero_offload.pinned_budget_bytes


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _section(config: dict, key: str, path: str, where: str = "") -> dict:
    value = config.get(key)
    if value is None or _is_auto(value):
        return {}
    if not isinstance(value, dict):
        raise EstimateInputError(f"{path}: {where}{key} must be a JSON object, got {type(value).__name__}")
    return value


def _positive_int(section: dict, key: str, path: str, where: str) -> Optional[int]:
    value = section.get(key)
    if value is None or _is_auto(value):
        return None
    # DeepSpeed configs often write sizes as 1e9, a float: accept whole numbers.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EstimateInputError(f"{path}: {where}{key} must be a positive integer, got {value!r}")
    if value != int(value) or value < 1:
        raise EstimateInputError(f"{path}: {where}{key} must be a positive integer, got {value!r}")
    return int(value)


def _bool(section: dict, key: str, path: str, where: str) -> Optional[bool]:
    value = section.get(key)
    if value is None or _is_auto(value):
        return None
    if not isinstance(value, bool):
        raise EstimateInputError(f"{path}: {where}{key} must be true or false, got {value!r}")
    return value


def _device(section: dict, path: str, where: str) -> Optional[str]:
    value = section.get("device")
    if value is None or _is_auto(value):
        return None
    if not isinstance(value, str) or value.lower() not in OFFLOAD_DEVICES:
        raise EstimateInputError(f"{path}: {where}device must be none, cpu or nvme, got {value!r}")
    return value.lower()


def read_ds_config(path: str) -> ConfigChoices:
    """Parse path; bad JSON or a bad value raises EstimateInputError naming the file and the key."""
    config = read_json_file(path, "--config")
    if not isinstance(config, dict):
        raise EstimateInputError(f"--config {path}: expected a JSON object at the top level")
    where = "--config " + path
    zero = _section(config, "zero_optimization", where)

    stage = zero.get("stage")
    if stage is not None and not _is_auto(stage):
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            raise EstimateInputError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    else:
        stage = None

    buffers: Dict[str, object] = {}
    opt_section = _section(zero, "offload_optimizer", where, "zero_optimization.")
    prefix = "zero_optimization.offload_optimizer."
    offload_optimizer = _device(opt_section, where, prefix)
    if offload_optimizer is None and zero.get("cpu_offload") is True:  # DeepSpeed's legacy spelling
        offload_optimizer = "cpu"
    count = _positive_int(opt_section, "buffer_count", where, prefix)
    if count is not None:
        buffers["optimizer_buffer_count"] = count
    pin = _bool(opt_section, "pin_memory", where, prefix)
    if pin is not None:
        buffers["optimizer_pin_memory"] = pin
    copies = opt_section.get("nvme_copies")
    if copies is not None:
        if copies not in ("auto", 1, 2) or isinstance(copies, bool):
            raise EstimateInputError(f'{where}: {prefix}nvme_copies must be "auto", 1 or 2, got {copies!r}')
        buffers["optimizer_nvme_copies"] = copies

    opt_max_in_cpu = opt_section.get("max_in_cpu")
    if opt_max_in_cpu is not None and not _is_auto(opt_max_in_cpu):
        if isinstance(opt_max_in_cpu, float) and opt_max_in_cpu.is_integer():
            opt_max_in_cpu = int(opt_max_in_cpu)
        if isinstance(opt_max_in_cpu, bool) or not isinstance(opt_max_in_cpu, int) or opt_max_in_cpu < 0:
            raise EstimateInputError(
                f'{where}: {prefix}max_in_cpu must be "auto" or an integer >= 0, got {opt_max_in_cpu!r}'
            )
    elif opt_max_in_cpu is not None:
        opt_max_in_cpu = "auto"

    par_section = _section(zero, "offload_param", where, "zero_optimization.")
    prefix = "zero_optimization.offload_param."
    offload_param = _device(par_section, where, prefix)
    if offload_param is None and zero.get("cpu_offload_param") is True:
        offload_param = "cpu"
    for key, name in (("buffer_count", "param_buffer_count"), ("buffer_size", "param_buffer_size")):
        value = _positive_int(par_section, key, where, prefix)
        if value is not None:
            buffers[name] = value
    pin = _bool(par_section, "pin_memory", where, prefix)
    if pin is not None:
        buffers["param_pin_memory"] = pin
    max_in_cpu = par_section.get("max_in_cpu")
    if max_in_cpu is not None and not _is_auto(max_in_cpu):
        if isinstance(max_in_cpu, float) and max_in_cpu.is_integer():
            max_in_cpu = int(max_in_cpu)
        if isinstance(max_in_cpu, bool) or not isinstance(max_in_cpu, int) or max_in_cpu < 0:
            raise EstimateInputError(
                f'{where}: {prefix}max_in_cpu must be "auto" or an integer >= 0, got {max_in_cpu!r}'
            )
        buffers["param_max_in_cpu"] = max_in_cpu

    sub_group = _positive_int(zero, "sub_group_size", where, "zero_optimization.")
    if sub_group is not None:
        # the engine's config rounds a smaller size up to its minimum (with a warning): estimate that
        buffers["sub_group_size"] = max(sub_group, MIN_SUB_GROUP_SIZE)

    # stage 2's gradient buckets on the GPU
    bucket = zero.get("reduce_bucket_size")
    if bucket is not None and not _is_auto(bucket):
        if isinstance(bucket, float) and bucket.is_integer():
            bucket = int(bucket)
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
            raise EstimateInputError(
                f"{where}: zero_optimization.reduce_bucket_size must be an integer >= 0, got {bucket!r}"
            )
        buffers["reduce_bucket_size"] = bucket
    overlap = _bool(zero, "overlap_comm", where, "zero_optimization.")
    if overlap is not None:
        buffers["overlap_comm"] = overlap

    depth = _positive_int(_section(config, "aio", where), "queue_depth", where, "aio.")
    if depth is not None:
        buffers["aio_queue_depth"] = depth

    precision = None
    for key in ("bf16", "bfloat16", "fp16"):
        enabled = _bool(_section(config, key, where), "enabled", where, key + ".")
        if enabled:
            precision = "fp16" if key == "fp16" else "bf16"
            break
    if precision is None and ("fp16" in config or "bf16" in config or "bfloat16" in config):
        sections = [_section(config, k, where) for k in ("fp16", "bf16", "bfloat16")]
        if not any(_is_auto(s.get("enabled")) for s in sections):
            precision = "fp32"  # both explicitly disabled

    optimizer = None
    opt = _section(config, "optimizer", where)
    opt_type = opt.get("type")
    if opt_type is not None and not _is_auto(opt_type):
        if not isinstance(opt_type, str):
            raise EstimateInputError(f"{where}: optimizer.type must be a string, got {opt_type!r}")
        optimizer = opt_type.lower()
    params = _section(opt, "params", where, "optimizer.")
    state_dtype = params.get("state_dtype")
    if state_dtype is None and params.get("fp32_optimizer_states") is False:
        state_dtype = "bf16"
    if state_dtype is not None and state_dtype not in ("fp32", "bf16", "int8"):
        raise EstimateInputError(
            f'{where}: optimizer.params.state_dtype must be "fp32", "bf16" or "int8", got {state_dtype!r}'
        )

    budget = _section(config, "zero_offload", where).get("pinned_budget_bytes")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise EstimateInputError(
            f"{where}: zero_offload.pinned_budget_bytes must be an integer >= 0, got {budget!r}"
        )
    micro_batch = _positive_int(config, "train_micro_batch_size_per_gpu", where, "")
    act = _section(config, "activation_checkpointing", where)
    checkpoint_device = act.get("offload_device")
    if checkpoint_device is None and act:
        checkpoint_device = (
            "cpu" if _bool(act, "cpu_checkpointing", where, "activation_checkpointing.") else "none"
        )
    if checkpoint_device not in (None, "none", "cpu", "nvme"):
        raise EstimateInputError(
            f"{where}: activation_checkpointing.offload_device must be none, cpu or nvme,"
            f" got {checkpoint_device!r}"
        )
    return ConfigChoices(
        path=path,
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        precision=precision,
        optimizer=optimizer,
        optimizer_state_dtype=state_dtype,
        micro_batch_size=micro_batch,
        checkpoint_device=checkpoint_device,
        buffers=buffers,
        optimizer_max_in_cpu=opt_max_in_cpu,
        pinned_budget_bytes=budget,
    )
