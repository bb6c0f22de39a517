"""ZeRO partitioning and the offload engine: `engine, optimizer, loader, scheduler = zero.initialize(...)`;
`engine = zero.from_pretrained(checkpoint_dir, config=...)` for a Hugging Face checkpoint."""

from typing import TYPE_CHECKING, Any

from zero.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointPickleError,
    NoOptimizerError,
    StateCorruptedError,
)

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointPickleError",
    "GatheredParameters",
    "Init",
    "NoOptimizerError",
    "StateCorruptedError",
    "ZeroEngine",
    "ZeroParamStatus",
    "add_config_arguments",
    "consolidated_state_dict",
    "from_pretrained",
    "init_distributed",
    "initialize",
]

if TYPE_CHECKING:
    from zero.deepspeed_api import add_config_arguments, init_distributed
    from zero.engine import ZeroEngine, consolidated_state_dict
    from zero.initialization import initialize
    from zero.pretrained import from_pretrained
    from zero.stage3 import GatheredParameters, Init, ZeroParamStatus


def __getattr__(name: str) -> Any:
    # Lazy, so that `import zero.loss_scaler` (or zero.schedulers) does not load the engine, torch.distributed
    # and the native I/O extension.
    if name == "initialize":
        from zero.initialization import initialize

        # Importing the submodule bound `zero.initialize` to the module; the function is the public name.
        globals()["initialize"] = initialize
        return initialize
    if name == "from_pretrained":
        from zero.pretrained import from_pretrained

        globals()["from_pretrained"] = from_pretrained
        return from_pretrained
    if name == "ZeroEngine":
        from zero.engine import ZeroEngine

        globals()["ZeroEngine"] = ZeroEngine
        return ZeroEngine
    if name in ("Init", "GatheredParameters", "ZeroParamStatus"):
        import zero.stage3 as stage3

        value = getattr(stage3, name)
        globals()[name] = value
        return value
    if name in ("add_config_arguments", "init_distributed"):  # DeepSpeed's launcher conventions
        import zero.deepspeed_api as api

        value = getattr(api, name)
        globals()[name] = value
        return value
    if name == "checkpointing":  # activation checkpointing, DeepSpeed's `deepspeed.checkpointing`
        import zero.checkpointing as checkpointing

        return checkpointing
    if name == "utils":  # DeepSpeed's `deepspeed.utils`: the safe_get_* / safe_set_* state accessors
        import zero.utils as utils

        return utils
    if name == "consolidated_state_dict":
        from zero.engine import consolidated_state_dict

        globals()[name] = consolidated_state_dict
        return consolidated_state_dict
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
