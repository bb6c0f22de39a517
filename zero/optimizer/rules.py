"""The optimizer side of the engine: update rules and the torch face.

A rank owns one partition of the flat parameter buffer. Its fp32 master copy and optimizer states live on a
tier (zero.optimizer.tiers: device or pinned host memory, NVMe swap files, or a split of those), all driven
the same way - `step(fn)` calls `fn(start, n, master, states)` on chunks of the partition and the engine's
`fn` runs the `UpdateRule`'s fused CPU kernel of `offload.ops` on them. `ZeroOptimizer` is what
`zero.initialize` returns: torch's optimizer face (param groups, schedulers), stepped by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from offload.config.optimizer import OPTIMIZER_DEFAULTS
from offload.swap.slots import QUANT_BLOCK, STATE_DTYPES, StateFormat

__all__ = ["UpdateRule", "ZeroOptimizer", "rule_from_client_optimizer", "rule_from_config"]

N_STATES = {"adam": 2, "adamw": 2, "adagrad": 1, "lion": 1}
# The kernels' names of each rule's states (their int8 scales are `<name>_absmax`), and which are signed.
_STATE_NAMES = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adagrad": ("state_sum",),
    "lion": ("exp_avg",),
}
SIGNED_STATES = {"adam": (True, False), "adamw": (True, False), "adagrad": (False,), "lion": (True,)}


@dataclass(frozen=True)
class UpdateRule:
    """Which fused kernel updates a chunk, how many state tensors it keeps per element and in which dtype.

    `state_dtype`: "fp32", "bf16" or "int8" (uint8 codes with one fp32 absmax per `QUANT_BLOCK` elements,
    handed to `apply` after the codes: `states = [codes..., absmax...]`); the master is always fp32.
    `stochastic_rounding`: bf16 states rounded stochastically (the kernel's option)."""

    kind: str  # "adam" | "adamw" | "adagrad" | "lion"
    state_dtype: str = "fp32"
    stochastic_rounding: bool = False

    checkpointable = (
        True  # its whole state is in the tier a checkpoint reads (not so zero.optimizer.torch_step)
    )

    def bind(self, groups: Sequence[Dict[str, Any]], spans: Sequence[Tuple[int, int, int]]) -> None:
        """Nothing: the kernels read each group's hyperparameters at every pass (a rule stepping the client's
        class, zero.optimizer.torch_step, builds its optimizers over the groups here)."""

    def __post_init__(self) -> None:
        check_state_dtype(self.kind, self.state_dtype, self.stochastic_rounding)

    @property
    def n_states(self) -> int:
        """State tensors per element (Adam: 2, Adagrad and Lion: 1)."""
        return N_STATES[self.kind]

    @property
    def format(self) -> StateFormat:
        """The byte layout of one chunk of this rule's state (offload.swap.slots)."""
        return StateFormat(self.n_states, self.state_dtype)

    @property
    def signed(self) -> Tuple[bool, ...]:
        """Per state, whether its int8 codes are signed (momentum) or unsigned (squared gradients)."""
        return SIGNED_STATES[self.kind]

    def _state_kwargs(self, states: List[torch.Tensor], step: int, seed: int) -> Dict[str, Any]:
        """The kernel's extra arguments for non-fp32 states: int8 absmax scales, stochastic rounding (bits
        hashed from `seed`, the step and the element's index in the chunk)."""
        kw: Dict[str, Any] = {}
        if self.state_dtype == "int8":
            names = _STATE_NAMES[self.kind]
            kw.update({f"{name}_absmax": a for name, a in zip(names, states[len(names) :])})
        if self.stochastic_rounding:
            kw["stochastic_rounding"], kw["seed"] = True, seed
            if self.kind in ("adagrad", "lion"):
                kw["step"] = step  # Adam's step is its own argument
        return kw

    def apply(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        states: List[torch.Tensor],
        *,
        step: int,
        group: Dict[str, Any],
        grad_scale: float,
        param_copy: Optional[torch.Tensor],
        check_finite: bool,
        seed: int = 0,
    ) -> bool:
        """Update one chunk in place (master, states, the 16-bit `param_copy`); False: a non-finite gradient.
        `seed`: the stochastic-rounding seed of this chunk (the engine passes the chunk's first element)."""
        from offload import ops

        extra = self._state_kwargs(states, step, seed)

        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if self.kind in ("adam", "adamw"):
            b1, b2 = group["betas"]
            return ops.adam_update(
                master,
                grad,
                states[0],
                states[1],
                step=step,
                lr=lr,
                beta1=float(b1),
                beta2=float(b2),
                eps=float(group["eps"]),
                weight_decay=wd,
                adamw_mode=bool(group["adamw_mode"]),
                bias_correction=bool(group.get("bias_correction", True)),
                grad_scale=grad_scale,
                param_copy=param_copy,
                check_finite=check_finite,
                **extra,
            )
        if self.kind == "adagrad":
            return ops.adagrad_update(
                master,
                grad,
                states[0],
                lr=lr,
                eps=float(group["eps"]),
                weight_decay=wd,
                grad_scale=grad_scale,
                param_copy=param_copy,
                check_finite=check_finite,
                **extra,
            )
        b1, b2 = group["betas"]
        return ops.lion_update(
            master,
            grad,
            states[0],
            lr=lr,
            beta1=float(b1),
            beta2=float(b2),
            weight_decay=wd,
            grad_scale=grad_scale,
            param_copy=param_copy,
            check_finite=check_finite,
            **extra,
        )


def check_state_dtype(kind: str, state_dtype: str, stochastic_rounding: bool) -> None:
    """ValueError unless the kernels can keep `kind`'s states in `state_dtype` (with stochastic rounding)."""
    from offload import ops

    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"optimizer state dtype must be one of {sorted(STATE_DTYPES)}, got {state_dtype!r}")
    if state_dtype == "int8":
        if not hasattr(ops, "quantize_blockwise") or getattr(ops, "QUANT_BLOCK", None) != QUANT_BLOCK:
            raise ValueError(
                "optimizer.params.state_dtype='int8' needs block-quantized states in offload.ops "
                f"(ops.quantize_blockwise with QUANT_BLOCK={QUANT_BLOCK}), which this build does not have"
            )
    if stochastic_rounding:
        if state_dtype != "bf16":
            raise ValueError(
                "optimizer.params.stochastic_rounding=true rounds bf16 states; it needs state_dtype 'bf16' "
                f"(fp32_optimizer_states false), not {state_dtype!r}"
            )
        kernel = {"adagrad": ops.adagrad_update, "lion": ops.lion_update}.get(kind, ops.adam_update)
        if "stochastic_rounding" not in _kernel_params(kernel):
            raise ValueError(
                "optimizer.params.stochastic_rounding=true needs the kernel's stochastic rounding "
                f"({kernel.__name__}(..., stochastic_rounding=True)), which this build has not"
            )


def _kernel_params(fn: Callable[..., Any]) -> Iterable[str]:
    import inspect

    return inspect.signature(fn).parameters


def rule_from_config(opt_type: str, params: Mapping[str, Any]) -> Tuple[UpdateRule, Dict[str, Any]]:
    """The rule and hyperparameters of the config's `optimizer` section as offload.config checked and
    resolved it (`OptimizerConfig.type` and `.params`: every parameter of the type, its default where the
    config gave none; nothing is checked again here). `state_dtype` and `stochastic_rounding` go into the
    rule, the values the kernels read into the hyperparameters."""
    hyper = {key: params[key] for key in OPTIMIZER_DEFAULTS[opt_type]}
    if opt_type in ("adam", "adamw"):
        hyper["adamw_mode"] = bool(params["adam_w_mode"])
        hyper["bias_correction"] = bool(params["bias_correction"])
    return UpdateRule(opt_type, params["state_dtype"], params["stochastic_rounding"]), hyper


def rule_from_client_optimizer(opt: torch.optim.Optimizer) -> Tuple[UpdateRule, Dict[str, Any]]:
    """Translate a torch optimizer the user built into our rule + hyperparameters (its state is not used);
    an `offload.ops` optimizer built with `fp32_optimizer_states=False` gives bf16 states."""
    name = type(opt).__name__.lower()
    g = opt.param_groups[0]  # the defaults; each group's own values: zero.optimizer.param_groups.build_groups
    if name in ("adamw", "cpuadamw"):
        kind, adamw = "adamw", True
    elif name in ("adam", "cpuadam", "fusedadam"):
        kind, adamw = "adam", bool(g.get("adamw_mode", getattr(opt, "adamw_mode", name != "adam")))
    elif name in ("adagrad", "cpuadagrad"):
        kind, adamw = "adagrad", False
        if g.get("lr_decay", 0) or g.get("initial_accumulator_value", 0):
            raise ValueError("Adagrad lr_decay / initial_accumulator_value other than 0 are not supported")
    elif name in ("lion", "cpulion"):
        kind, adamw = "lion", False
    else:
        raise ValueError(
            f"client optimizer {type(opt).__name__} is not supported: pass Adam, AdamW, Adagrad or Lion "
            "(torch or offload.ops), or describe it in the config's optimizer block"
        )
    if g.get("amsgrad"):
        raise ValueError("amsgrad=True is not supported")
    hyper = dict(OPTIMIZER_DEFAULTS[kind])  # what the client optimizer does not say: DeepSpeed's defaults
    for k in ("lr", "eps", "weight_decay"):
        if k in g and k in hyper:
            hyper[k] = float(g[k])
    if "betas" in g and "betas" in hyper:
        hyper["betas"] = tuple(float(b) for b in g["betas"])
    if kind in ("adam", "adamw"):
        hyper["adamw_mode"] = adamw
        hyper["bias_correction"] = bool(g.get("bias_correction", True))
    # offload.ops' CPU optimizers (DeepSpeed's) keep bf16 states with fp32_optimizer_states=False; torch's
    # have no such option and keep fp32 states
    state_dtype = "fp32" if g.get("fp32_optimizer_states", True) else "bf16"
    return UpdateRule(kind, state_dtype), hyper


_OPTIMIZER_ADD_PARAM_GROUP = getattr(
    torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group
)


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer `zero.initialize` returns: torch's face (param_groups for schedulers), engine-driven.

    The hyperparameters live in `param_groups` (one per group of `params`, `hyper` their defaults) so that
    torch and config schedulers can change them; each step reads every group's current values
    (zero.optimizer.param_groups). The state lives in the engine's tier. `step()` is the engine's job
    (`engine.step()`), as in DeepSpeed.
    """

    def __init__(self, params: List[Any], rule: UpdateRule, hyper: Dict[str, Any]) -> None:
        # torch's own: a subclass that is also the client's class (zero.optimizer.client_face) must not run
        # the client's __init__
        torch.optim.Optimizer.__init__(self, params, dict(hyper))
        self.rule = rule
        self.step_count = 0  # optimizer updates applied (overflow-skipped steps excluded)
        self.overflow = False  # DeepSpeed's: whether the last step found inf/nan gradients and was skipped
        self.engine: Any = None

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group as torch does, without its dynamo guard (below)."""
        # torch wraps add_param_group in torch._disable_dynamo, whose first call imports torch._dynamo: over
        # a second of every engine's start-up, for a guard that matters only when torch.compile traces it.
        _OPTIMIZER_ADD_PARAM_GROUP(self, param_group)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """RuntimeError: the engine steps (`engine.step()`)."""
        raise RuntimeError(
            "the ZeRO optimizer is stepped by the engine: call engine.step() after engine.backward()"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's `zero_grad`."""
        if self.engine is not None:
            self.engine.zero_grad()

    def hyperparameters(self) -> Dict[str, Any]:
        """The first param group's hyperparameters."""
        return self.group_hyperparameters()[0]

    def group_hyperparameters(self) -> List[Dict[str, Any]]:
        """Every param group's hyperparameters (without its parameters), in order."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def check_hyperparameters(self, saved: List[Dict[str, Any]], where: str) -> None:
        """ValueError unless `saved` (`group_hyperparameters()` of a saved optimizer) has one entry per
        param group."""
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"{where}: the saved optimizer has {len(saved)} param group(s), this one "
                f"{len(self.param_groups)}: build the engine with the same groups"
            )

    def load_hyperparameters(self, saved: List[Dict[str, Any]], where: str = "optimizer state") -> None:
        """Each param group takes its saved hyperparameters (`check_hyperparameters` first)."""
        self.check_hyperparameters(saved, where)
        for group, values in zip(self.param_groups, saved):
            group.update({k: v for k, v in values.items() if k != "params"})

    def state_dict(self) -> Dict[str, Any]:
        """Hyperparameters, step count and this rank's partition state, as CPU tensors (read from NVMe)."""
        if self.engine is None:
            raise RuntimeError("optimizer is not attached to an engine")
        return self.engine.optimizer_state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The engine's `load_optimizer_state_dict`."""
        if self.engine is None:
            raise RuntimeError("optimizer is not attached to an engine")
        self.engine.load_optimizer_state_dict(state_dict)
