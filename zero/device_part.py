"""TorchDevicePart: the device share of a Twin-Flow split (`offload_optimizer.ratio` < 1.0), stepped by torch.

With a CUDA compute device the first sub-groups of the partition (zero.split_state) keep their fp32 master and
Adam states in device memory. One pass then runs in two flows at once: `launch` queues torch's fused
Adam/AdamW over the whole device share (asynchronous on the GPU), and the host thread goes on to walk the
offloaded chunks with the CPU kernels. The gradient scale (loss scale, world size, clipping coefficient) is
the pass's one divisor, applied to both shares; the overflow check happened before the pass started (a split
state is not atomic, so its overflow is always checked first), so neither share is ever stepped on an
overflowing gradient.

The part presents `StateTier` (zero.optimizer_state) by delegating to its `DeviceState`, so checkpoints,
`read_all` / `load` / `rewrite` and the split's index arithmetic are those of any other tier; only its `step`
differs: the update was already queued by `launch`, so `step` calls nothing.

On a CPU-only machine the device share is stepped by the CPU kernels as a plain `DeviceState` (bit-identical
to every other ratio); `TorchDevicePart` is used there only when asked for (`ZeroEngine(...,
device_part="torch")`), with torch's single-tensor Adam/AdamW instead of the fused one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from zero.optimizer_offload import DeviceState, UpdateRule

__all__ = ["DEVICE_PART_CHOICES", "TorchDevicePart", "check_device_part_rule", "wants_torch_part"]

DEVICE_PART_CHOICES = ("auto", "torch", "kernels")
VisitFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]


def wants_torch_part(choice: str, device: torch.device) -> bool:
    """Whether the device share is stepped by torch (`TorchDevicePart`): "auto" on CUDA, always with
    "torch", never with "kernels" (the CPU kernels, which need the share in host memory)."""
    if choice not in DEVICE_PART_CHOICES:
        raise ValueError(f"device_part={choice!r}: use one of {DEVICE_PART_CHOICES}")
    if choice == "kernels" and device.type != "cpu":
        raise ValueError(
            f"device_part='kernels': the CPU kernels cannot step optimizer state in {device.type} memory; "
            "use 'auto' or 'torch'"
        )
    return choice == "torch" or (choice == "auto" and device.type != "cpu")


def check_device_part_rule(rule: UpdateRule, group: Dict[str, Any]) -> None:
    """NotImplementedError, naming the key, unless torch's Adam/AdamW can step the device share."""
    if rule.kind not in ("adam", "adamw"):
        raise NotImplementedError(
            f"optimizer.type {rule.kind!r} with zero_optimization.offload_optimizer.ratio below 1.0 on the "
            "training device is not supported: the device share is stepped by torch's fused Adam/AdamW; "
            "use ratio 1.0 or optimizer type Adam / AdamW"
        )
    if rule.state_dtype != "fp32":
        raise NotImplementedError(
            f"optimizer.params.state_dtype={rule.state_dtype!r} (fp32_optimizer_states false) with "
            "zero_optimization.offload_optimizer.ratio below 1.0 on the training device is not supported: "
            "torch's fused Adam keeps fp32 states; use ratio 1.0 or fp32 states"
        )
    if not group.get("bias_correction", True):
        raise NotImplementedError(
            "optimizer.params.bias_correction=false with zero_optimization.offload_optimizer.ratio below "
            "1.0 on the training device is not supported: torch's Adam always corrects the bias"
        )


class TorchDevicePart:
    """The first `state.numel` elements of a split state, stepped by torch's Adam/AdamW (module doc).

    `fused`: torch's fused implementation (None: on CUDA; on the CPU the single-tensor one, which is what
    `torch.optim.AdamW` picks there by default)."""

    def __init__(
        self, rule: UpdateRule, group: Dict[str, Any], state: DeviceState, *, fused: Optional[bool] = None
    ) -> None:
        check_device_part_rule(rule, group)
        self.state = state
        self.numel = state.numel
        self.chunk_numel = state.chunk_numel
        self.stats = state.stats
        self.launches = 0  # updates queued: one per committed pass
        dev = state.master.device
        self.fused = dev.type == "cuda" if fused is None else bool(fused)
        self.param = nn.Parameter(state.master, requires_grad=False)
        cls = torch.optim.AdamW if group["adamw_mode"] else torch.optim.Adam
        impl: Dict[str, Any] = {"fused": True} if self.fused else {"foreach": False}
        self.opt = cls(
            [self.param],
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            **impl,
        )
        self.opt.state[self.param] = {  # the tier's tensors are the optimizer's state: no second copy
            "step": torch.zeros((), dtype=torch.float32, device=dev if self.fused else "cpu"),
            "exp_avg": state.states[0],
            "exp_avg_sq": state.states[1],
        }
        self._launched = False

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master of the share (device memory on CUDA)."""
        return self.state.master

    @property
    def pinned_bytes(self) -> int:
        return self.state.pinned_bytes

    def launch(self, grad: torch.Tensor, step: int, group: Dict[str, Any], grad_scale: float) -> None:
        """Queue update `step` of the share: `grad` holds its raw gradient sums (any dtype or device; not
        changed), divided by `grad_scale` here as the CPU kernels divide theirs. On CUDA the copy of `grad`
        to the device waits, the update itself does not."""
        dev = self.state.master.device
        g = grad.to(device=dev, dtype=torch.float32, copy=True)
        g.div_(grad_scale)
        pg = self.opt.param_groups[0]
        for k in ("lr", "betas", "eps", "weight_decay"):
            pg[k] = group[k]
        self.param.grad = g
        self.opt.state[self.param]["step"].fill_(step - 1)
        self.opt.step()
        self.param.grad = None
        self.launches += 1
        self._launched = True

    # ------------------------------------------------------------------------------ StateTier
    def prefetch(self) -> None:
        pass  # in memory

    def settle(self) -> None:
        pass

    def step(self, fn: Callable[..., bool]) -> bool:
        """The share was stepped by `launch` before the pass walked the offloaded chunks; `fn` (the CPU
        kernels' chunk update) is not called on device memory."""
        if not self._launched:
            raise RuntimeError("TorchDevicePart.step: this pass did not launch the device share's update")
        self._launched = False
        return True

    writes_in_flight = False

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        self._launched = False

    def read_all(self, fn: VisitFn) -> None:
        """Visit master and states chunk by chunk (device views; stream-ordered after the last update)."""
        self.state.read_all(fn)

    def load(self, fn: VisitFn) -> None:
        self.state.load(fn)

    def rewrite(self, fn: VisitFn) -> None:
        self.state.rewrite(fn)

    def take_lost(self) -> None:
        return None

    def close(self) -> None:
        self.opt.state.clear()
        self.state.close()
