"""ZeRO partitioning and the offload engine: `engine, optimizer, loader, scheduler = zero.initialize(...)`;
`engine = zero.from_pretrained(checkpoint_dir, config=...)` for a Hugging Face checkpoint."""

from typing import TYPE_CHECKING, Any

from offload import __version__
from offload.config import ConfigError
from zero.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointPickleError,
    CheckpointTagError,
    NoOptimizerError,
    StateCorruptedError,
)

# DeepSpeed's version attributes, of this package's version (not a DeepSpeed release's)
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split(".")[:3])
__git_hash__ = None
__git_branch__ = None

# DeepSpeed's names for the same exceptions
DeepSpeedConfigError = ConfigError

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointPickleError",
    "CheckpointTagError",
    "ConfigError",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "GatheredParameters",
    "Init",
    "NoOptimizerError",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "StateCorruptedError",
    "ZeroEngine",
    "ZeroParamStatus",
    "add_config_arguments",
    "consolidated_state_dict",
    "from_pretrained",
    "init_distributed",
    "initialize",
    "unwrap_model_for_generation",
]

if TYPE_CHECKING:
    from zero.deepspeed_api import add_config_arguments, init_distributed
    from zero.engine.api import OffloadDeviceEnum, OffloadStateTypeEnum
    from zero.engine.engine import ZeroEngine, consolidated_state_dict
    from zero.engine.engine import ZeroEngine as DeepSpeedEngine
    from zero.engine.generation import unwrap_model_for_generation
    from zero.inference.pretrained import from_pretrained
    from zero.initialization import initialize
    from zero.stage3 import GatheredParameters, Init, ZeroParamStatus


def __getattr__(name: str) -> Any:
    # Lazy, so that `import zero.optimizer.loss_scaler` (or zero.optimizer.schedulers) does not load the
    # engine, torch.distributed and the native I/O extension.
    if name == "initialize":
        from zero.initialization import initialize

        # Importing the submodule bound `zero.initialize` to the module; the function is the public name.
        globals()["initialize"] = initialize
        return initialize
    if name == "from_pretrained":
        from zero.inference.pretrained import from_pretrained

        globals()["from_pretrained"] = from_pretrained
        return from_pretrained
    if name in ("ZeroEngine", "DeepSpeedEngine"):  # DeepSpeed's class name, for isinstance checks
        from zero.engine.engine import ZeroEngine

        globals()[name] = ZeroEngine
        return ZeroEngine
    if name in ("OffloadDeviceEnum", "OffloadStateTypeEnum"):
        import zero.engine.api as engine_api

        value = getattr(engine_api, name)
        globals()[name] = value
        return value
    if name == "unwrap_model_for_generation":  # TRL's context manager, for an engine of ours
        from zero.engine.generation import unwrap_model_for_generation

        globals()[name] = unwrap_model_for_generation
        return unwrap_model_for_generation
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
        from zero.engine.engine import consolidated_state_dict

        globals()[name] = consolidated_state_dict
        return consolidated_state_dict
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
