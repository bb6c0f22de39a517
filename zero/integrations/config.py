"""The DeepSpeed config an integration hands to `zero.initialize`, from a framework's arguments.

Framework-free (no import of Lightning or any other trainer):

* `config_from_arguments(config, ...)`: a user's config (dict or JSON path; a default when None) with the
  keyword arguments of Lightning's DeepSpeedStrategy written into a copy of it - those that name one config
  key; the ones that cannot be honoured raise, unknown ones are a TypeError;
* `apply_trainer_settings(cfg, ...)`: what the trainer owns - gradient accumulation, clipping by norm,
  16-bit precision - written into the config, refusing a config that says something else.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple, Union

__all__ = ["DEFAULT_CONFIG", "apply_trainer_settings", "config_from_arguments"]

# Without a config: ZeRO stage 2 with the optimizer state (fp32 master, moments) in host memory.
DEFAULT_CONFIG: Dict[str, Any] = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

# DeepSpeedStrategy keyword arguments that are one config key each: name -> its path in the config.
_OO, _OP = ("zero_optimization", "offload_optimizer"), ("zero_optimization", "offload_param")
CONFIG_KWARGS: Dict[str, Tuple[str, ...]] = {
    "optimizer_buffer_count": (*_OO, "buffer_count"),
    "params_buffer_count": (*_OP, "buffer_count"),
    "params_buffer_size": (*_OP, "buffer_size"),
    "max_in_cpu": (*_OP, "max_in_cpu"),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer",),
}
for _section, _keys in (
    ("zero_optimization", "sub_group_size overlap_comm reduce_bucket_size contiguous_gradients"),
    ("zero_optimization", "allgather_partitions reduce_scatter allgather_bucket_size"),
    ("aio", "block_size queue_depth single_submit overlap_events thread_count"),
    ("fp16", "loss_scale initial_scale_power loss_scale_window hysteresis min_loss_scale"),
    ("activation_checkpointing", "partition_activations cpu_checkpointing contiguous_memory_optimization"),
    ("activation_checkpointing", "synchronize_checkpoint_boundary"),
):
    CONFIG_KWARGS.update({k: (_section, k) for k in _keys.split()})
_ONE_PROCESS = "the integration runs one process"
# DeepSpeedStrategy keyword arguments accepted only with the value that asks for nothing: value, why not.
REFUSED: Dict[str, Tuple[Any, str]] = {
    "remote_device": (
        None,
        "zero.Init puts parameters where offload_param.device says: set offload_params_device",
    ),
    "load_full_weights": (False, "only checkpoint directories saved through the engine can be loaded"),
    "exclude_frozen_parameters": (False, "the engine's checkpoints always hold every parameter"),
    "process_group_backend": (None, _ONE_PROCESS),
    "cluster_environment": (None, _ONE_PROCESS),
}
NO_EFFECT = ("timeout",)


def _set(cfg: Dict[str, Any], path: Tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        cfg = cfg.setdefault(key, {})
    cfg[path[-1]] = value


def _read(config: Union[str, os.PathLike, Mapping[str, Any]]) -> Dict[str, Any]:
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config={path!r}: no such file (give a dict or the path of a JSON file)")
    with open(path) as f:
        loaded = json.load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"config={path!r}: the JSON file must hold an object")
    return loaded


def _offload(zo: Dict[str, Any], key: str, on: Optional[bool], device: Optional[str]) -> None:
    """offload_optimizer / offload_parameters (a bool) and their *_device into zero_optimization[key]."""
    if on is False and device is not None:
        raise ValueError(f"{key}: offloading is off but a device ({device!r}) was given")
    if on is False:
        zo[key] = {"device": "none"}
    elif on or device is not None:
        block = zo.setdefault(key, {})
        current = block.get("device")
        block["device"] = device or (current if current not in (None, "none") else "cpu")


def config_from_arguments(
    config: Optional[Union[str, os.PathLike, Mapping[str, Any]]] = None,
    *,
    stage: Optional[int] = None,
    offload_optimizer: Optional[bool] = None,
    offload_parameters: Optional[bool] = None,
    offload_optimizer_device: Optional[str] = None,
    offload_params_device: Optional[str] = None,
    nvme_path: Optional[str] = None,
    pin_memory: Optional[bool] = None,
    micro_batch_size: Optional[int] = None,
    **deepspeed_kwargs: Any,
) -> Dict[str, Any]:
    """A new config dict: `config` (or DEFAULT_CONFIG) with the arguments written over what it says.

    `offload_*` True without a device means "cpu" (or the config's device); False means device "none";
    `nvme_path` goes to every offload block on nvme (an error if there is none), `pin_memory` to every
    offload block; `micro_batch_size` is train_micro_batch_size_per_gpu; `deepspeed_kwargs` are the
    names in CONFIG_KWARGS, REFUSED (only with their harmless value) and NO_EFFECT."""
    for name, value in deepspeed_kwargs.items():
        if name in REFUSED:
            ok, why = REFUSED[name]
            if value != ok:
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        elif name not in CONFIG_KWARGS and name not in NO_EFFECT:
            known = sorted([*CONFIG_KWARGS, *REFUSED, *NO_EFFECT])
            raise TypeError(f"unexpected keyword argument {name!r} (DeepSpeed's that are known: {known})")
    cfg = _read(config) if config is not None else copy.deepcopy(DEFAULT_CONFIG)
    zo = cfg.setdefault("zero_optimization", {})
    if stage is not None:
        zo["stage"] = int(stage)
    _offload(zo, "offload_optimizer", offload_optimizer, offload_optimizer_device)
    _offload(zo, "offload_param", offload_parameters, offload_params_device)
    blocks = [zo[k] for k in ("offload_optimizer", "offload_param") if isinstance(zo.get(k), dict)]
    if nvme_path is not None:
        nvme = [b for b in blocks if b.get("device") == "nvme"]
        if not nvme:
            raise ValueError(f"nvme_path={nvme_path!r} was given but nothing is offloaded to nvme")
        for b in nvme:
            b["nvme_path"] = os.fspath(nvme_path)
    if pin_memory is not None:
        for b in blocks:
            b["pin_memory"] = bool(pin_memory)
    for name, value in deepspeed_kwargs.items():
        if name in CONFIG_KWARGS:
            _set(cfg, CONFIG_KWARGS[name], value)
    if micro_batch_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    param_device = zo.get("offload_param", {}).get("device", "none")
    if param_device != "none" and int(zo.get("stage", 0)) != 3:
        raise ValueError(f"offloading parameters (offload_param.device={param_device!r}) needs stage 3")
    return cfg


def apply_trainer_settings(
    cfg: Dict[str, Any],
    *,
    accumulate_grad_batches: int,
    gradient_clip_val: Optional[float],
    clip_by_value: bool,
    precision_key: Optional[str],
    precision_name: str,
) -> None:
    """Write the trainer's settings into `cfg` (in place): gradient_accumulation_steps, gradient_clipping
    (clipping by norm only), `bf16`/`fp16` enabled for `precision_key` ("bf16", "fp16" or None: fp32);
    train_micro_batch_size_per_gpu 1 when the config has no batch size (it only feeds the engine's sample
    counters). A config that says otherwise is a ValueError naming both."""
    accumulate = int(accumulate_grad_batches)
    if cfg.get("gradient_accumulation_steps", accumulate) != accumulate:
        raise ValueError(
            f"the config's gradient_accumulation_steps={cfg['gradient_accumulation_steps']} but the "
            f"trainer accumulates {accumulate} batches: leave it out of the config"
        )
    cfg["gradient_accumulation_steps"] = accumulate
    if "train_batch_size" not in cfg:
        cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    if gradient_clip_val:
        if clip_by_value:
            raise ValueError("the engine clips by the global norm only: gradient_clip_algorithm='norm'")
        if float(cfg.get("gradient_clipping", gradient_clip_val) or 0.0) != float(gradient_clip_val):
            raise ValueError(
                f"the config's gradient_clipping={cfg['gradient_clipping']} but the trainer's "
                f"gradient_clip_val={gradient_clip_val}: give it once"
            )
        cfg["gradient_clipping"] = float(gradient_clip_val)
    enabled = [k for k in ("fp16", "bf16", "bfloat16") if (cfg.get(k) or {}).get("enabled") is True]
    if any(k.replace("bfloat16", "bf16") != precision_key for k in enabled):
        raise ValueError(
            f"the config enables {enabled} but precision={precision_name!r}: pass the matching precision "
            "('bf16-mixed' for bf16, '16-mixed' for fp16) and leave the section to the integration"
        )
    if precision_key is not None and not enabled:
        _set(cfg, (precision_key, "enabled"), True)
