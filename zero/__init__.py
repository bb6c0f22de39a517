"""ZeRO partitioning and the offload engine: `engine, optimizer, loader, scheduler = zero.initialize(...)`."""

from typing import TYPE_CHECKING, Any

__all__ = ["ZeroEngine", "initialize"]

if TYPE_CHECKING:
    from zero.engine import ZeroEngine
    from zero.initialization import initialize


def __getattr__(name: str) -> Any:
    # Lazy, so that `import zero.loss_scaler` (or zero.schedulers) does not load the engine, torch.distributed
    # and the native I/O extension.
    if name == "initialize":
        from zero.initialization import initialize

        # Importing the submodule bound `zero.initialize` to the module; the function is the public name.
        globals()["initialize"] = initialize
        return initialize
    if name == "ZeroEngine":
        from zero.engine import ZeroEngine

        globals()["ZeroEngine"] = ZeroEngine
        return ZeroEngine
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
