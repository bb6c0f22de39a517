"""Hugging Face's `"auto"` config values outside the Trainer: `zero.initialize(model=..., config=...)` fills
them from the model and from a plan (offload.estimate.plan), where DeepSpeed would refuse them.

Inside `ZeroTrainer` the TrainingArguments fill them (zero.integrations.transformers.fill_zero_config).
Outside, there are no arguments; each "auto" takes:

* `train_micro_batch_size_per_gpu` <- the plan's micro-batch (1 without a plan), `gradient_accumulation_steps`
  <- 1, `train_batch_size` <- world size x both; `gradient_clipping` <- 0.0 (off);
* `fp16.enabled` / `bf16.enabled` <- whether the model's floating parameters are in that dtype;
* `optimizer.params`: `betas` <- [0.9, 0.999], `eps` <- 1e-8, `weight_decay` <- 0.0 (torch's Adam defaults);
  `lr` has no default and stays an error naming it;
* `scheduler.params.warmup_min_lr` <- 0, `warmup_max_lr` <- the optimizer's lr;
* `zero_optimization.reduce_bucket_size` <- h^2, `stage3_prefetch_bucket_size` <- 0.9 h^2,
  `stage3_param_persistence_threshold` <- 10 h (h: the model's hidden size, as transformers derives them);
* `zero_optimization.stage`, `offload_optimizer.device`, `offload_param.device`, `sub_group_size` <- the plan
  for this model on this machine (`plan_training`; NVMe only where the config names an `nvme_path`).

`max_in_cpu`, `nvme_copies` and the aio backend have an "auto" of the engine's own: they are left as they are.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Optional

from torch import nn

__all__ = ["ENGINE_AUTO_KEYS", "HIDDEN_SIZE_KEYS", "auto_keys", "fill_auto_values", "hidden_size_of"]

# The bucket sizes transformers derives from the model's hidden size (h): h^2, 0.9 h^2, 10 h
HIDDEN_SIZE_KEYS = (
    ("zero_optimization.reduce_bucket_size", lambda h: h * h),
    ("zero_optimization.stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
    ("zero_optimization.stage3_param_persistence_threshold", lambda h: 10 * h),
)

# "auto" values the engine resolves itself (offload/config): not the Trainer's convention
ENGINE_AUTO_KEYS = (
    "zero_optimization.offload_optimizer.max_in_cpu",
    "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.offload_optimizer.nvme_copies",
    "aio.backend",
    "aio.engine",
)
_PLANNED = (
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "zero_optimization.sub_group_size",
    "train_micro_batch_size_per_gpu",
)


def auto_keys(cfg: Mapping[str, Any], prefix: str = "") -> List[str]:
    """Dotted paths of the values "auto" in `cfg` that are Hugging Face's convention (not
    ENGINE_AUTO_KEYS)."""
    out: List[str] = []
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value == "auto" and path not in ENGINE_AUTO_KEYS:
            out.append(path)
        elif isinstance(value, dict):
            out += auto_keys(value, path + ".")
    return out


def hidden_size_of(model: Any) -> Optional[int]:
    """The hidden size the "auto" bucket sizes are derived from: of `model.config` (or `model` itself when
    it is a config), `hidden_size`, `n_embd` or `d_model`, the largest of `hidden_sizes`, or the same in its
    `text_config`; None when it has none of them."""
    cfg = getattr(model, "config", model)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    sizes = getattr(cfg, "hidden_sizes", None)
    if sizes:
        return max(int(s) for s in sizes)
    text = getattr(cfg, "text_config", None)
    return hidden_size_of(text) if text is not None and text is not cfg else None


def _node(cfg: Dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    *parents, key = dotted.split(".")
    for name in parents:
        node = node.get(name) if isinstance(node, dict) else None
    return node, key


def _set_if_auto(cfg: Dict[str, Any], dotted: str, value: Any) -> None:
    node, key = _node(cfg, dotted)
    if isinstance(node, dict) and node.get(key) == "auto":
        node[key] = value


def _get(cfg: Dict[str, Any], dotted: str) -> Any:
    node, key = _node(cfg, dotted)
    return node.get(key) if isinstance(node, dict) else None


def _model_dtype(model: nn.Module) -> Optional[str]:
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p.dtype, "fp32")
    return None


def _shape(model: nn.Module, seq_len: int) -> Any:
    from offload.estimate.counting import count_parameters
    from offload.estimate.plan import ModelShape

    counted = count_parameters(model)
    cfg = getattr(model, "config", None)
    hidden = hidden_size_of(model) or max(1, int(counted.largest_layer_params**0.5))
    layers = next(
        (
            int(getattr(cfg, k))
            for k in ("num_hidden_layers", "n_layer", "num_layers")
            if getattr(cfg, k, None)
        ),
        1,
    )
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    return ModelShape(
        params=max(1, counted.params),
        largest_layer_params=max(1, counted.largest_layer_params),
        hidden_size=hidden,
        num_layers=layers,
        seq_len=seq_len,
        vocab_size=vocab if vocab * hidden < counted.params else 0,
    )


def _plan(cfg: Dict[str, Any], model: nn.Module, planner: Optional[Callable[..., Any]]) -> Any:
    """The training plan for `model` on this machine, NVMe only where the config names an nvme_path."""
    from offload.estimate.machine import detect_machine
    from offload.estimate.plan import plan_training
    from offload.estimate.probe import probe_machine

    nvme_path = _get(cfg, "zero_optimization.offload_optimizer.nvme_path") or _get(
        cfg, "zero_optimization.offload_param.nvme_path"
    )
    dtype = (
        "bf16"
        if _get(cfg, "bf16.enabled") is True
        else "fp16"
        if _get(cfg, "fp16.enabled") is True
        else "fp32"
    )
    shape = _shape(model, seq_len=512)
    machine = detect_machine(nvme_path or ".")
    stage = _get(cfg, "zero_optimization.stage")
    kwargs: Dict[str, Any] = {
        "precision": dtype,
        "nvme_path": nvme_path or "/local_nvme",
        "checkpointing": False,
    }
    if isinstance(stage, int):
        kwargs["stages"] = (stage,)
    for key in ("offload_optimizer", "offload_param"):
        device = _get(cfg, f"zero_optimization.{key}.device")
        if isinstance(device, str) and device != "auto":
            kwargs[key] = device
    mb = _get(cfg, "train_micro_batch_size_per_gpu")
    kwargs["max_micro_batch"] = mb if isinstance(mb, int) else 1
    # no disk to plan with (no nvme_path, or no measured bandwidth): the NVMe choices are left out
    kwargs["allow_nvme"] = nvme_path is not None and machine.nvme_read_gbps is not None
    if planner is not None:
        return planner(shape, machine, **kwargs)
    compute = probe_machine(
        tokens=kwargs["max_micro_batch"] * shape.seq_len,
        hidden=shape.hidden_size,
        dtype=dtype,
        seq_len=shape.seq_len,
        heads=shape.num_heads,
    )
    return plan_training(shape, machine, compute, **kwargs)


def fill_auto_values(
    config: Dict[str, Any],
    model: nn.Module,
    world_size: int = 1,
    planner: Optional[Callable[..., Any]] = None,
) -> Dict[str, Any]:
    """A copy of `config` with its Hugging Face "auto" values filled (module doc). `planner(shape, machine,
    **choices)`: what returns the Plan for the planned keys (default: probe this machine and
    `plan_training`)."""
    cfg = copy.deepcopy(config)
    keys = auto_keys(cfg)
    if not keys:
        return cfg
    dtype = _model_dtype(model)
    _set_if_auto(cfg, "fp16.enabled", dtype == "fp16")
    _set_if_auto(cfg, "bf16.enabled", dtype == "bf16")
    if any(k in _PLANNED for k in keys):
        plan = _plan(cfg, model, planner)
        zo = plan.config["zero_optimization"]
        _set_if_auto(cfg, "zero_optimization.stage", zo["stage"])
        _set_if_auto(cfg, "zero_optimization.sub_group_size", zo.get("sub_group_size", 1_000_000_000))
        for key in ("offload_optimizer", "offload_param"):
            _set_if_auto(cfg, f"zero_optimization.{key}.device", zo.get(key, {}).get("device", "none"))
        _set_if_auto(cfg, "train_micro_batch_size_per_gpu", plan.config["train_micro_batch_size_per_gpu"])
    _set_if_auto(cfg, "train_micro_batch_size_per_gpu", 1)
    _set_if_auto(cfg, "gradient_accumulation_steps", 1)
    micro, gas = _get(cfg, "train_micro_batch_size_per_gpu"), _get(cfg, "gradient_accumulation_steps")
    if isinstance(micro, int) and isinstance(gas, int):
        _set_if_auto(cfg, "train_batch_size", world_size * micro * gas)
    _set_if_auto(cfg, "gradient_clipping", 0.0)
    _set_if_auto(cfg, "optimizer.params.betas", [0.9, 0.999])
    _set_if_auto(cfg, "optimizer.params.eps", 1e-8)
    _set_if_auto(cfg, "optimizer.params.weight_decay", 0.0)
    _set_if_auto(cfg, "scheduler.params.warmup_min_lr", 0)
    lr = _get(cfg, "optimizer.params.lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        _set_if_auto(cfg, "scheduler.params.warmup_max_lr", lr)
    if any(k in keys for k, _ in HIDDEN_SIZE_KEYS):
        hidden = hidden_size_of(model)
        if hidden is None:
            raise ValueError(
                "'auto' bucket sizes need the model's hidden size (config.hidden_size, n_embd or d_model) "
                "and the model has none; give integers instead"
            )
        for key, size in HIDDEN_SIZE_KEYS:
            _set_if_auto(cfg, key, size(hidden))
    return cfg
