"""UnusedParameterCheck: `zero_optimization.ignore_unused_parameters: false`, as DeepSpeed means it.

A trainable parameter that receives no gradient in a whole accumulation window usually means a bug in
the model (a branch never taken, a layer left out of forward). With the key false, the backward that ends
the window raises, naming those parameters; with DeepSpeed's default (true) nothing is checked and such
parameters are simply not changed by the gradient (weight decay still applies).
"""

from __future__ import annotations

from typing import List, Set

import torch
from torch import nn

__all__ = ["UnusedParameterCheck"]


class UnusedParameterCheck:
    """Records which parameters got a gradient (post-accumulate-grad hooks) during the window."""

    def __init__(self, module: nn.Module, params: List[nn.Parameter]) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        self._names = [names.get(id(p), f"<parameter {i}>") for i, p in enumerate(params)]
        self._seen: Set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, index: int):  # type: ignore[no-untyped-def]
        def hook(param: torch.Tensor) -> None:
            self._seen.add(index)

        return hook

    def begin_backward(self, first: bool) -> None:
        """Called before each backward; `first`: it starts a new accumulation window."""
        if first:
            self._seen.clear()

    def check(self) -> None:
        """At the end of the window: raise if a trainable parameter never got a gradient in it."""
        missing = [name for i, name in enumerate(self._names) if i not in self._seen]
        self._seen.clear()
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RuntimeError(
                f"{len(missing)} trainable parameter(s) received no gradient in this accumulation window: "
                f"{shown}. zero_optimization.ignore_unused_parameters is false; set it true (DeepSpeed's "
                "default) if that is intended, or freeze them (requires_grad=False)"
            )

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
