"""The class of the optimizer `zero.initialize` returns when a client optimizer was given: `ZeroOptimizer`
that is also an instance of the client's class.

Code written for plain torch checks the optimizer it gets back (`isinstance(opt, torch.optim.AdamW)`,
`isinstance(opt, torch.optim.SGD)` in a training loop or an integration). With ZeRO the engine's optimizer
is a different object - its state is partitioned and lives on the offload tier - but it keeps the client's
class in its lineage: a subclass of `ZeroOptimizer` and of the client's class (made once per class), whose
every behaviour is `ZeroOptimizer`'s (param_groups, state_dict, zero_grad, step) because it comes first in
the method resolution order. The client's `__init__` never runs on it, so its `__del__` is replaced by one
that does nothing (it would find none of what that `__init__` sets up).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch

from zero.optimizer.rules import ZeroOptimizer

__all__ = ["optimizer_class"]

_classes: Dict[type, type] = {}
_lock = threading.Lock()


def _no_del(self: Any) -> None:
    """The client's `__del__` would clean up what its `__init__` set up, which never ran here."""


def optimizer_class(client: Optional[torch.optim.Optimizer]) -> type:
    """`ZeroOptimizer`, or with a client optimizer a subclass of `ZeroOptimizer` and of its class
    (`isinstance(engine.optimizer, type(client))` holds), the same class for every client of one class."""
    if client is None:
        return ZeroOptimizer
    cls = type(client)
    if issubclass(cls, ZeroOptimizer):  # an engine's optimizer given again: its own class
        return cls
    with _lock:
        face = _classes.get(cls)
        if face is None:
            attrs = {
                "__module__": ZeroOptimizer.__module__,
                "__doc__": f"ZeroOptimizer standing in for the client's {cls.__qualname__} (zero.optimizer."
                "client_face).",
                "__del__": _no_del,
            }
            face = _classes[cls] = type(f"Zero{cls.__name__}", (ZeroOptimizer, cls), attrs)
        return face
