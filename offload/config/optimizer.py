"""The ``"optimizer"`` and ``"scheduler"`` sections.

Parameter names and defaults follow what DeepSpeed passes to its CPU optimizers (DeepSpeedCPUAdam,
DeepSpeedCPUAdagrad, DeepSpeedCPULion) and LR schedules (deepspeed/runtime/lr_schedules.py). ``params``
comes back fully resolved: every parameter the type knows, with its default where the user gave none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ._reader import ConfigError, Context, Section, closest

OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lion": "Lion"}

# Other names DeepSpeed builds from "optimizer.type" (its own optimizers and torch.optim classes it looks
# up by name); named so the error says "not supported yet" rather than "unknown".
_KNOWN_ELSEWHERE = (
    "lamb",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "muadam",
    "muadamw",
    "musgd",
    "muon",
    "sgd",
    "rmsprop",
    "adamax",
    "adadelta",
    "nadam",
    "radam",
    "sparseadam",
    "lbfgs",
    "asgd",
    "rprop",
)

# Each type's hyperparameter defaults: DeepSpeed's (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad; DeepSpeedCPULion
# and FusedLion agree on Lion's). The one source for this section's defaults, the engine's defaults under a
# client optimizer's values (zero.optimizer.rules) and the constructors of offload.ops' CPU optimizers.
OPTIMIZER_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "adam": MappingProxyType({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
        "adamw": MappingProxyType({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
        "adagrad": MappingProxyType({"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0}),
        "lion": MappingProxyType({"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}),
    }
)

SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


@dataclass(frozen=True)
class OptimizerConfig:
    """``type`` is lower-case ("adam", "adamw", "adagrad", "lion"); ``params`` holds every parameter."""

    type: str
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    """``type`` is DeepSpeed's spelling (e.g. "WarmupLR"); ``params`` holds every parameter."""

    type: str
    params: Dict[str, Any] = field(default_factory=dict)


def _nonzero_not_supported(s: Section, name: str, what: str) -> float:
    value = s.float(name, 0.0)
    if value != 0.0:
        raise s.not_supported(name, what)
    return value


def _adam_params(s: Section, kind: str) -> Dict[str, Any]:
    adam_w_mode = s.bool("adam_w_mode", True)
    if kind == "adamw" and not adam_w_mode:
        # DeepSpeed silently runs AdamW for type AdamW whatever adam_w_mode says; say so.
        s.ctx.warn_once(
            s.key("adam_w_mode"),
            f"'{s.key('adam_w_mode')}': false has no effect with type AdamW (DeepSpeed runs AdamW anyway)",
        )
        adam_w_mode = True
    if s.bool("amsgrad", False):
        raise s.not_supported("amsgrad", "AMSGrad (amsgrad: true)")
    torch_adam = s.bool("torch_adam", False)
    if torch_adam:
        s.ctx.warn_once(
            s.key("torch_adam"),
            f"config key '{s.key('torch_adam')}' is accepted but ignored: the offloaded step always runs"
            " zero-offload's CPU Adam, which computes the same update as torch.optim.Adam/AdamW",
        )
    default = OPTIMIZER_DEFAULTS[kind]
    return {
        "lr": s.float("lr", default["lr"], min=0.0),
        "betas": s.float_pair("betas", default["betas"]),
        "eps": s.float("eps", default["eps"], min=0.0),
        "weight_decay": s.float("weight_decay", default["weight_decay"], min=0.0),
        "adam_w_mode": adam_w_mode,
        "bias_correction": s.bool("bias_correction", True),
        "amsgrad": False,
        "torch_adam": torch_adam,
        **_state_dtype(s),
    }


def _adagrad_params(s: Section, kind: str) -> Dict[str, Any]:
    if s.bool("amsgrad", False):
        raise s.not_supported("amsgrad", "amsgrad: true")
    # torch.optim.Adagrad's extras, which DeepSpeed passes through when it does not offload. Only their
    # neutral 0 is accepted, so they are checked but not carried in params (a consumer never sees them).
    _nonzero_not_supported(s, "lr_decay", "Adagrad lr_decay != 0")
    _nonzero_not_supported(s, "initial_accumulator_value", "Adagrad initial_accumulator_value != 0")
    default = OPTIMIZER_DEFAULTS[kind]
    return {
        "lr": s.float("lr", default["lr"], min=0.0),
        "eps": s.float("eps", default["eps"], min=0.0),
        "weight_decay": s.float("weight_decay", default["weight_decay"], min=0.0),
        "amsgrad": False,
        **_state_dtype(s),
    }


def _lion_params(s: Section, kind: str) -> Dict[str, Any]:
    default = OPTIMIZER_DEFAULTS[kind]
    return {
        "lr": s.float("lr", default["lr"], min=0.0),
        "betas": s.float_pair("betas", default["betas"]),
        "weight_decay": s.float("weight_decay", default["weight_decay"], min=0.0),
        **_state_dtype(s),
    }


_PARAM_KEYS: Dict[str, Tuple[str, ...]] = {
    "adam": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "adam_w_mode",
        "bias_correction",
        "amsgrad",
        "torch_adam",
        "fp32_optimizer_states",
        "state_dtype",
        "stochastic_rounding",
        "max_grad_norm",
    ),
    "adagrad": (
        "lr",
        "eps",
        "weight_decay",
        "amsgrad",
        "lr_decay",
        "initial_accumulator_value",
        "fp32_optimizer_states",
        "state_dtype",
        "stochastic_rounding",
        "max_grad_norm",
    ),
    "lion": (
        "lr",
        "betas",
        "weight_decay",
        "fp32_optimizer_states",
        "state_dtype",
        "stochastic_rounding",
        "max_grad_norm",
    ),
}
_PARAM_KEYS["adamw"] = _PARAM_KEYS["adam"]

_PARAM_PARSERS: Dict[str, Callable[[Section, str], Dict[str, Any]]] = {
    "adam": _adam_params,
    "adamw": _adam_params,
    "adagrad": _adagrad_params,
    "lion": _lion_params,
}


def parse_optimizer(raw: Any, ctx: Context) -> Optional[OptimizerConfig]:
    """Validate the `optimizer` section into an OptimizerConfig (None when absent)."""
    if raw is None:
        return None
    s = Section(raw, "optimizer", ctx, ("type", "params", "legacy_fusion"))
    # legacy_fusion selects between two implementations of DeepSpeed's non-ZeRO fp16 optimizer.
    s.ignored_unless(
        "legacy_fusion", s.bool("legacy_fusion", False), False, "DeepSpeed's non-ZeRO fp16 optimizer choice"
    )
    if not s.has("type"):
        raise ConfigError(
            f"optimizer in {ctx.source}: 'type' is required (one of {', '.join(OPTIMIZER_TYPES.values())})"
        )
    name = s.str("type", None)
    kind = name.lower()
    if kind not in OPTIMIZER_TYPES:
        supported = ", ".join(OPTIMIZER_TYPES.values())
        if kind in _KNOWN_ELSEWHERE:
            raise s.fail("type", f"'{name}' is not supported yet by zero-offload (supported: {supported})")
        guess = closest(name, OPTIMIZER_TYPES.values())
        hint = f"; did you mean '{guess}'?" if guess else ""
        raise s.fail("type", f"unknown optimizer '{name}'{hint} (supported: {supported})")
    p = Section(s.get("params"), "optimizer.params", ctx, _PARAM_KEYS[kind])
    if p.has("max_grad_norm"):
        # DeepSpeed rejects it too: clipping is the top-level "gradient_clipping".
        raise p.fail("max_grad_norm", "is not an optimizer parameter; use the top-level 'gradient_clipping'")
    return OptimizerConfig(type=kind, params=_PARAM_PARSERS[kind](p, kind))


# --- schedulers ----------------------------------------------------------------------------------------


def _lr_value(s: Section, name: str, default: Any, *, allow_none: bool = False) -> Any:
    """A learning rate: a number, or (as DeepSpeed allows) one number per optimizer param group."""
    value = s.get(name, default)
    if isinstance(value, (list, tuple)):
        if not value:
            raise s.fail(name, "an empty array gives no learning rate")
        # Reuse the scalar checks (and their wording) on each element.
        return [Section({name: item}, s.path, s.ctx, (name,)).float(name, None, min=0.0) for item in value]
    return s.float(name, default, min=0.0, allow_none=allow_none)


def _warmup_common(s: Section) -> Dict[str, Any]:
    return {
        "warmup_num_steps": s.int("warmup_num_steps", 1000, min=1),
        "warmup_type": s.choice("warmup_type", "log", ("log", "linear")),
        "last_batch_iteration": s.int("last_batch_iteration", -1, min=-1),
    }


def _warmup_lr(s: Section) -> Dict[str, Any]:
    return {
        "warmup_min_lr": _lr_value(s, "warmup_min_lr", 0.0),
        # None: the optimizer's own lr, as DeepSpeed's WarmupLR does.
        "warmup_max_lr": _lr_value(s, "warmup_max_lr", None, allow_none=True),
        **_warmup_common(s),
    }


def _required_total(s: Section) -> int:
    if not s.has("total_num_steps"):
        raise s.fail("total_num_steps", "is required for this scheduler")
    return s.int("total_num_steps", None, min=1)


def _warmup_decay_lr(s: Section) -> Dict[str, Any]:
    return {
        "total_num_steps": _required_total(s),
        "warmup_min_lr": _lr_value(s, "warmup_min_lr", 0.0),
        "warmup_max_lr": _lr_value(s, "warmup_max_lr", 0.001),
        **_warmup_common(s),
    }


def _warmup_cosine_lr(s: Section) -> Dict[str, Any]:
    return {
        "total_num_steps": _required_total(s),
        "warmup_min_ratio": s.float("warmup_min_ratio", 0.0, min=0.0, max=1.0),
        "cos_min_ratio": s.float("cos_min_ratio", 0.0001, min=0.0, max=1.0),
        **_warmup_common(s),
    }


def _one_cycle(s: Section) -> Dict[str, Any]:
    for name in ("cycle_min_lr", "cycle_max_lr"):
        if not s.has(name):
            raise s.fail(name, "is required for OneCycle")
    first = s.int("cycle_first_step_size", 2000, min=1)
    return {
        "cycle_min_lr": s.float("cycle_min_lr", None, min=0.0),
        "cycle_max_lr": s.float("cycle_max_lr", None, min=0.0),
        "decay_lr_rate": s.float("decay_lr_rate", 0.0, min=0.0),
        "cycle_first_step_size": first,
        "cycle_second_step_size": s.int("cycle_second_step_size", None, min=1, allow_none=True),
        "cycle_first_stair_count": s.int("cycle_first_stair_count", 0, min=0),
        "cycle_second_stair_count": s.int("cycle_second_stair_count", None, min=0, allow_none=True),
        "decay_step_size": s.int("decay_step_size", 0, min=0),
        "cycle_momentum": s.bool("cycle_momentum", True),
        "cycle_min_mom": s.float("cycle_min_mom", 0.8, min=0.0, max=1.0, max_exclusive=True),
        "cycle_max_mom": s.float("cycle_max_mom", 0.9, min=0.0, max=1.0, max_exclusive=True),
        "decay_mom_rate": s.float("decay_mom_rate", 0.0, min=0.0),
        "last_batch_iteration": s.int("last_batch_iteration", -1, min=-1),
    }


def _lr_range_test(s: Section) -> Dict[str, Any]:
    return {
        "lr_range_test_min_lr": _lr_value(s, "lr_range_test_min_lr", 1e-3),
        "lr_range_test_step_size": s.int("lr_range_test_step_size", 2000, min=1),
        "lr_range_test_step_rate": s.float("lr_range_test_step_rate", 1.0, min=0.0),
        "lr_range_test_staircase": s.bool("lr_range_test_staircase", False),
        "last_batch_iteration": s.int("last_batch_iteration", -1, min=-1),
    }


_SCHEDULER_KEYS: Dict[str, Tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": (
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    ),
    "WarmupCosineLR": (
        "total_num_steps",
        "warmup_min_ratio",
        "cos_min_ratio",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    ),
    "OneCycle": (
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
        "last_batch_iteration",
    ),
    "LRRangeTest": (
        "lr_range_test_min_lr",
        "lr_range_test_step_size",
        "lr_range_test_step_rate",
        "lr_range_test_staircase",
        "last_batch_iteration",
    ),
}

_SCHEDULER_PARSERS: Dict[str, Callable[[Section], Dict[str, Any]]] = {
    "WarmupLR": _warmup_lr,
    "WarmupDecayLR": _warmup_decay_lr,
    "WarmupCosineLR": _warmup_cosine_lr,
    "OneCycle": _one_cycle,
    "LRRangeTest": _lr_range_test,
}


def parse_scheduler(raw: Any, ctx: Context, path: str = "scheduler") -> Optional[SchedulerConfig]:
    """Validate the `scheduler` section into a SchedulerConfig (None when absent)."""
    if raw is None:
        return None
    s = Section(raw, path, ctx, ("type", "params"))
    if not s.has("type"):
        raise ConfigError(f"{path} in {ctx.source}: 'type' is required (one of {', '.join(SCHEDULER_TYPES)})")
    kind = s.choice("type", "WarmupLR", SCHEDULER_TYPES)
    p = Section(s.get("params"), f"{path}.params", ctx, _SCHEDULER_KEYS[kind])
    return SchedulerConfig(type=kind, params=_SCHEDULER_PARSERS[kind](p))


STATE_DTYPES = ("fp32", "bf16", "int8")


def _state_dtype(s: Section) -> Dict[str, Any]:
    """The optimizer states' dtype: DeepSpeed's `fp32_optimizer_states` (false: bf16) and our `state_dtype`
    ("fp32" | "bf16" | "int8"), which must agree; `stochastic_rounding` (bf16 states only)."""
    fp32 = s.bool("fp32_optimizer_states", True)
    dtype = s.choice("state_dtype", "fp32" if fp32 else "bf16", STATE_DTYPES)
    if s.has("fp32_optimizer_states") and s.has("state_dtype") and fp32 != (dtype == "fp32"):
        raise s.fail(
            "state_dtype",
            f"'{dtype}' contradicts '{s.key('fp32_optimizer_states')}': {str(fp32).lower()} (true means fp32 "
            "states; give one of the two keys)",
        )
    rounding = s.bool("stochastic_rounding", False)
    if rounding and dtype != "bf16":
        raise s.fail("stochastic_rounding", f"rounds bf16 states; it needs state_dtype 'bf16', not '{dtype}'")
    return {"fp32_optimizer_states": dtype == "fp32", "state_dtype": dtype, "stochastic_rounding": rounding}
