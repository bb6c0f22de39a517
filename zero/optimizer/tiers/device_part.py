"""TorchDevicePart: the device share of a Twin-Flow split (`offload_optimizer.ratio` < 1.0), stepped by torch.

With a CUDA compute device the first sub-groups of the partition (zero.optimizer.tiers.split) keep their fp32
master and Adam states in device memory. One pass then runs in two flows at once: `launch` queues torch's
fused Adam/AdamW over the whole device share (asynchronous on the GPU), and the host thread goes on to walk
the offloaded chunks with the CPU kernels. The gradient scale (loss scale, world size, clipping coefficient)
is the pass's one divisor, applied to both shares; the overflow check happened before the pass started (a
split state is not atomic, so its overflow is always checked first), so neither share is ever stepped on an
overflowing gradient.

The part presents `StateTier` (zero.optimizer.tiers.base) by delegating to its `DeviceState`, so checkpoints,
`read_all` / `load` / `rewrite` and the split's index arithmetic are those of any other tier; only its `step`
differs: the update was already queued by `launch`, so `step` calls nothing.

On a CPU-only machine the device share is stepped by the CPU kernels as a plain `DeviceState` (bit-identical
to every other ratio); `TorchDevicePart` is used there only when asked for (`ZeroEngine(...,
device_part="torch")`), with torch's single-tensor Adam/AdamW instead of the fused one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from zero.optimizer.rules import UpdateRule, ZeroOptimizer
from zero.optimizer.tiers.base import ChunkFn, ReadyFn, TierStats, VisitFn
from zero.optimizer.tiers.device import DeviceState

__all__ = [
    "DEVICE_PART_CHOICES",
    "FusedDeviceStep",
    "TorchAdamSpans",
    "TorchDevicePart",
    "check_device_part_rule",
    "wants_torch_part",
]

DEVICE_PART_CHOICES = ("auto", "torch", "kernels")
Span = Tuple[int, int, int]  # [start, end) of the master and its param group (zero.optimizer.param_groups)


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


class TorchAdamSpans:
    """torch's Adam/AdamW over a flat fp32 master and its two states: one torch parameter (a view) per run of
    one param group (`spans`: (start, end, group index) over the master), in torch param groups holding
    their group's hyperparameters, so each run is updated as torch updates that group. The tier's tensors
    are the optimizer's state (views: no second copy). `fused`: torch's fused implementation (CUDA), else
    the single-tensor one."""

    def __init__(
        self,
        groups: Sequence[Dict[str, Any]],
        spans: Sequence[Span],
        master: torch.Tensor,
        states: List[torch.Tensor],
        *,
        fused: bool,
    ) -> None:
        used = sorted({gi for _, _, gi in spans})
        modes = {bool(groups[gi]["adamw_mode"]) for gi in used}
        if len(modes) > 1:
            raise NotImplementedError(
                "param groups mixing Adam (L2) and AdamW (decoupled) weight decay cannot be stepped by "
                "torch's fused Adam on the device; use one mode, or offload_optimizer.device cpu or nvme"
            )
        self.group_ids = used
        self.views: List[Tuple[int, int, nn.Parameter]] = []
        members: Dict[int, List[nn.Parameter]] = {gi: [] for gi in used}
        step_dev = master.device if fused else torch.device("cpu")
        state: Dict[nn.Parameter, Dict[str, torch.Tensor]] = {}
        for a, z, gi in spans:
            p = nn.Parameter(master[a:z], requires_grad=False)
            self.views.append((a, z, p))
            members[gi].append(p)
            state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=step_dev),
                "exp_avg": states[0][a:z],
                "exp_avg_sq": states[1][a:z],
            }
        cls = torch.optim.AdamW if modes.pop() else torch.optim.Adam
        impl: Dict[str, Any] = {"fused": True} if fused else {"foreach": False}
        self.opt = cls([{"params": members[gi], **_torch_hyper(groups[gi])} for gi in used], **impl)
        for p, st in state.items():
            self.opt.state[p] = st

    def step(self, grad: torch.Tensor, step: int, groups: Sequence[Dict[str, Any]]) -> None:
        """Update `step` with the fp32 gradient `grad` (unscaled, on the master's device) and the groups'
        current hyperparameters."""
        for tg, gi in zip(self.opt.param_groups, self.group_ids):
            tg.update(_torch_hyper(groups[gi]))
        for a, z, p in self.views:
            p.grad = grad[a:z]
            self.opt.state[p]["step"].fill_(step - 1)
        self.opt.step()
        for _, _, p in self.views:
            p.grad = None

    def close(self) -> None:
        """Drop torch's references to the state tensors."""
        self.opt.state.clear()


def _torch_hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}


class TorchDevicePart:
    """The first `state.numel` elements of a split state, stepped by torch's Adam/AdamW (module doc).

    `fused`: torch's fused implementation (None: on CUDA; on the CPU the single-tensor one, which is what
    `torch.optim.AdamW` picks there by default)."""

    def __init__(
        self,
        rule: UpdateRule,
        group: Union[Dict[str, Any], Sequence[Dict[str, Any]]],
        state: DeviceState,
        *,
        spans: Optional[Sequence[Span]] = None,
        fused: Optional[bool] = None,
    ) -> None:
        """`group`: the optimizer's param group, or its groups with `spans`
        (zero.optimizer.param_groups.group_spans
        over the partition; clipped to this share)."""
        groups = [group] if isinstance(group, dict) else list(group)
        for g in groups:
            check_device_part_rule(rule, g)
        self.state = state
        self.numel = state.numel
        self.chunk_numel = state.chunk_numel
        self.stats: TierStats = state.stats
        self.launches = 0  # updates queued: one per committed pass
        dev = state.master.device
        self.fused = dev.type == "cuda" if fused is None else bool(fused)
        share = [
            (a, min(z, self.numel), gi) for a, z, gi in (spans or [(0, self.numel, 0)]) if a < self.numel
        ]
        self.torch = TorchAdamSpans(groups, share, state.master, state.states, fused=self.fused)
        self._launched = False

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master of the share (device memory on CUDA)."""
        return self.state.master

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes of the share (0: device memory)."""
        return self.state.pinned_bytes

    @property
    def chunks(self) -> List[Tuple[int, int]]:
        """(start, numel) of the share's chunks (read_all, load, rewrite visit them)."""
        return self.state.chunks

    @property
    def device_numel(self) -> int:
        """Elements of the share in device memory."""
        return self.state.device_numel

    copies = 1
    pass_bytes = 0
    swapped_numel = 0
    overlap_chunks: Optional[List[Tuple[int, int]]] = None  # stepped in place: never during backward
    resident_share = (0, 0)

    @property
    def atomic_from(self) -> int:
        """Updated in place: a failed pass leaves no element committed."""
        return self.numel

    @property
    def device_part(self) -> TorchDevicePart:
        """This share: stepped by `launch`, apart from the chunk walk."""
        return self

    def launch(
        self,
        grad: torch.Tensor,
        step: int,
        group: Union[Dict[str, Any], Sequence[Dict[str, Any]]],
        grad_scale: float,
    ) -> None:
        """Queue update `step` of the share: `grad` holds its raw gradient sums (any dtype or device; not
        changed), divided by `grad_scale` here as the CPU kernels divide theirs; `group`: the optimizer's
        param groups (or its one group). On CUDA the copy of `grad` to the device waits, the update itself
        does not."""
        dev = self.state.master.device
        g = grad.to(device=dev, dtype=torch.float32, copy=True)
        g.div_(grad_scale)
        self.torch.step(g, step, [group] if isinstance(group, dict) else group)
        self.launches += 1
        self._launched = True

    # ------------------------------------------------------------------------------ StateTier
    def prefetch(self) -> None:
        """Nothing to read: in memory."""

    def settle(self) -> None:
        """Nothing is written back later."""

    def step(self, fn: ChunkFn, ready: Optional[ReadyFn] = None) -> bool:
        """The share was stepped by `launch` before the pass walked the offloaded chunks; `fn` (the CPU
        kernels' chunk update) is not called on device memory."""
        if not self._launched:
            raise RuntimeError("TorchDevicePart.step: this pass did not launch the device share's update")
        self._launched = False
        return True

    def step_resident(self, fn: ChunkFn) -> bool:
        """Nothing is left after `step`."""
        return True

    writes_in_flight = False

    def commit(self) -> None:
        """Updated in place: nothing to commit."""

    def abort(self) -> None:
        """Forget this pass's launch."""
        self._launched = False

    def read_all(self, fn: VisitFn) -> None:
        """Visit master and states chunk by chunk (device views; stream-ordered after the last update)."""
        self.state.read_all(fn)

    def load(self, fn: VisitFn) -> None:
        """Fill master and states chunk by chunk, in place."""
        self.state.load(fn)

    def rewrite(self, fn: VisitFn) -> None:
        """Let `fn` change every chunk in place."""
        self.state.rewrite(fn)

    def take_lost(self) -> Optional[OSError]:
        """None: nothing is written back later (or what `keep_lost` kept)."""
        return self.state.take_lost()

    def keep_lost(self, err: OSError) -> None:
        """Keep a failure a discarded pass had taken, for the next `take_lost`."""
        self.state.keep_lost(err)

    def close(self) -> None:
        """Drop torch's optimizer and the share."""
        self.torch.close()
        self.state.close()


class FusedDeviceStep:
    """offload none on CUDA: torch's fused Adam/AdamW on the flat fp32 partition in device memory, one torch
    param group per param group (`spans`: zero.optimizer.param_groups.group_spans; None: one group)."""

    def __init__(
        self,
        rule: UpdateRule,
        optimizer: ZeroOptimizer,
        state: DeviceState,
        spans: Optional[List[Tuple[int, int, int]]] = None,
    ) -> None:
        if rule.kind not in ("adam", "adamw"):
            raise NotImplementedError(
                f"optimizer {rule.kind!r} without offload on CUDA is not supported; "
                "use offload_optimizer.device cpu or nvme"
            )
        if rule.state_dtype != "fp32":
            raise NotImplementedError(
                f"optimizer.params.state_dtype={rule.state_dtype!r} (fp32_optimizer_states false) without "
                "offload on CUDA is not supported: the device step is torch's fused Adam, which keeps fp32 "
                "states; use offload_optimizer.device cpu or nvme for 16-bit or 8-bit states"
            )
        self.optimizer = optimizer
        spans = spans or [(0, state.numel, 0)]
        self.torch = TorchAdamSpans(optimizer.param_groups, spans, state.master, state.states, fused=True)

    def step(self, grad: torch.Tensor, step: int, group: Dict[str, Any]) -> None:
        """One update of the master with the fp32 gradient `grad` (already unscaled); each param group's
        current hyperparameters (`group` is the first one's)."""
        self.torch.step(grad, step, self.optimizer.param_groups)
