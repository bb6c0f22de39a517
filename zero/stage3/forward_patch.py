"""Instance `forward`s set on modules and taken off again: how the stage-3 CPU inference paths
(zero/stage3/fused.py, zero/stage3/linear_layout.py) replace a module's forward, the way accelerate's hooks
wrap one, without touching its class."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

from torch import nn

__all__ = ["ForwardPatches"]


class ForwardPatches:
    """The forwards set so far; `remove()` takes them off again."""

    def __init__(self) -> None:
        self._set: List[Tuple[nn.Module, Callable[..., Any]]] = []

    @staticmethod
    def free(module: nn.Module) -> bool:
        """Whether `module` runs its class's forward (no instance `forward` of its own, ours or another's)."""
        return "forward" not in module.__dict__

    def set(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Make `forward` the module's forward."""
        module.forward = forward
        self._set.append((module, forward))

    def remove(self) -> None:
        """Give every module its class's forward back (one replaced by something else since is left as is)."""
        for m, fwd in self._set:
            if m.__dict__.get("forward") is fwd:
                del m.forward
        self._set.clear()
