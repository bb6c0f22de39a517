"""What stage 3 takes from the config: the loaded config itself, and the pinned pool it is capped by.

Both the partitioner and `zero.Init` (which may build one, or override the config's offload_param first)
start from these, so neither restates a default the config already has.
"""

from __future__ import annotations

import os
from typing import Optional

from offload.config.loader import ConfigInput, ZeroOffloadConfig, load_config
from offload.pinned import PinnedPool, default_pinned_budget

__all__ = ["default_pinned_pool", "load_stage3_config"]


def load_stage3_config(config: ConfigInput, world_size: int = 1) -> ZeroOffloadConfig:
    """A loaded config (ZeroOffloadConfig) from a dict, a JSON path, None (defaults) or a loaded one.
    `world_size`: the data-parallel ranks a training config's batch sizes are checked against."""
    if config is None or isinstance(config, (dict, str, os.PathLike)):
        return load_config(config, world_size)
    return config


def default_pinned_pool(config: Optional[ZeroOffloadConfig] = None) -> PinnedPool:
    """A PinnedPool capped by the config's zero_offload.pinned_budget_bytes, else the process default."""
    configured = config.zero_offload.pinned_budget_bytes if config is not None else None
    return PinnedPool(default_pinned_budget(configured))
