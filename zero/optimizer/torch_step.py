"""Client optimizers the fused kernels do not implement (SGD, RMSprop, any torch optimizer): stepped on the
host by the client's own class, over the fp32 master.

DeepSpeed steps such an optimizer itself on the host under ZeRO-Offload when the config allows it
(`zero_force_ds_cpu_optimizer: false`; and, being outside its tested list, `zero_allow_untested_optimizer:
true`). Here the engine's update pass walks the master chunk by chunk as for the kernels; `TorchStepRule`
is the rule it applies: each run of one param group inside a chunk is a parameter of its own (a view of the
master, so the step writes the master in place) with an optimizer of the client's class over it, built from
the client's defaults; before each step the run's group hyperparameters (as schedulers left them) are copied
into it and the gradient, unscaled, becomes its `.grad`. The optimizer's own state (momentum buffers,
square averages) lives in those optimizers, in host memory: the master's tier must hold the master in place
(offload_optimizer "cpu", or "none" on a machine without an accelerator); NVMe, Twin-Flow and a device
master are refused, and so are checkpoints (they would not hold that state).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload.config import ZeroOffloadConfig
from offload.swap.slots import StateFormat

__all__ = ["TorchStepRule", "kernel_implements", "torch_step_rule"]

# Client optimizer classes (by lower-case name) that the fused kernels implement (zero.optimizer.rules).
_KERNEL_NAMES = {
    "adam",
    "adamw",
    "cpuadam",
    "cpuadamw",
    "fusedadam",
    "adagrad",
    "cpuadagrad",
    "lion",
    "cpulion",
}


def kernel_implements(client: Any) -> bool:
    """Whether the fused kernels implement `client`'s update (the rule is then theirs)."""
    return type(client).__name__.lower() in _KERNEL_NAMES


def torch_step_rule(
    client: torch.optim.Optimizer, cfg: ZeroOffloadConfig, offload_device: str
) -> TorchStepRule:
    """The rule stepping `client`'s class on the host, after DeepSpeed's two config checks: an optimizer
    outside its tested list needs `zero_allow_untested_optimizer: true`, and a client optimizer under
    ZeRO-Offload `zero_force_ds_cpu_optimizer: false`. ValueError naming the key otherwise, or naming the
    tier when the master does not stay in place in memory."""
    name = type(client).__name__
    if not cfg.zero_allow_untested_optimizer:
        raise ValueError(
            f"client optimizer {name} is not one of ZeRO's tested optimizers (Adam, AdamW, Adagrad, Lion): "
            'as DeepSpeed, set "zero_allow_untested_optimizer": true in the config to step it with its own '
            "class on the host, or pass one of those"
        )
    if offload_device != "none" and cfg.zero_force_ds_cpu_optimizer:
        raise ValueError(
            f"ZeRO-Offload (offload_optimizer.device={offload_device!r}) with client optimizer {name}: as "
            "DeepSpeed, offloaded states are stepped by the CPU optimizer unless "
            '"zero_force_ds_cpu_optimizer": false is set (the client\'s class then steps on the host, slower '
            "than the fused kernels); or "
            "use Adam, AdamW, Adagrad or Lion"
        )
    if offload_device == "nvme":
        raise ValueError(
            f"client optimizer {name} with offload_optimizer.device='nvme': its own state stays in host "
            "memory and the master must too; use offload_optimizer.device 'cpu'"
        )
    return TorchStepRule(type(client), dict(client.defaults))


class TorchStepRule:
    """The update rule of a torch optimizer class (`UpdateRule`'s interface: `kind`, `n_states` 0 - the
    tier keeps no state for it -, `apply`). `bind` gives it the param groups and their runs of the
    partition before the first step."""

    state_dtype = "fp32"
    stochastic_rounding = False
    n_states = 0
    signed: Tuple[bool, ...] = ()
    checkpointable = False  # the optimizers' own state is not in the tier a checkpoint reads

    def __init__(self, cls: type, defaults: Dict[str, Any]) -> None:
        self.cls = cls
        self.defaults = defaults
        self.kind = f"torch.{cls.__name__}"
        self._groups: Sequence[Dict[str, Any]] = []
        self._spans: List[Tuple[int, int, int]] = [(0, 1 << 62, 0)]
        self._runs: Dict[Tuple[int, int], Tuple[nn.Parameter, torch.optim.Optimizer]] = {}

    @property
    def format(self) -> StateFormat:
        """The tier's layout: the master alone."""
        return StateFormat(0, "fp32")

    def bind(self, groups: Sequence[Dict[str, Any]], spans: Sequence[Tuple[int, int, int]]) -> None:
        """The engine optimizer's param groups (their current hyperparameters are read at each step) and
        the runs of the partition each covers (zero.optimizer.param_groups.group_spans)."""
        self._groups = groups
        self._spans = list(spans)

    def state(self) -> Dict[Tuple[int, int], Dict[str, Any]]:
        """Each run's optimizer state by its [start, end) in the partition (momentum buffers, ...)."""
        return {key: dict(opt.state[p]) for key, (p, opt) in self._runs.items()}

    def _run(self, a: int, z: int, master: torch.Tensor) -> Tuple[nn.Parameter, torch.optim.Optimizer]:
        entry = self._runs.get((a, z))
        if entry is not None and entry[0].data_ptr() == master.data_ptr():
            return entry
        if entry is not None:
            raise RuntimeError(
                f"{self.kind}: the master of elements [{a}, {z}) moved; its optimizer state is tied to it"
            )
        p = nn.Parameter(master, requires_grad=True)  # a view: the step writes the master in place
        entry = self._runs[(a, z)] = (p, self.cls([p], **self.defaults))
        return entry

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
        """Step elements [seed, seed + n) of the partition (`seed`: the chunk's first element) with the
        client's class, run by run of one param group; False before anything changed: a non-finite
        gradient (with `check_finite`)."""
        g = grad.float() / grad_scale
        if check_finite and not bool(torch.isfinite(g).all()):
            return False
        start, end = seed, seed + master.numel()
        for lo, hi, gi in self._spans:
            a, z = max(lo, start), min(hi, end)
            if a >= z:
                continue
            p, opt = self._run(a, z, master[a - start : z - start])
            hyper = self._groups[gi] if self._groups else group
            opt.param_groups[0].update({k: v for k, v in hyper.items() if k != "params"})
            p.grad = g[a - start : z - start]
            opt.step()
            p.grad = None
        if param_copy is not None:
            param_copy.copy_(master)
        return True
