"""The DeepSpeed-compatible config schema: a user's DeepSpeed JSON works unchanged where a feature exists
in both, and anything else is a ConfigError naming the key, the source and the closest valid key.

See docs/configuration.md for every key, its default, and what is accepted-and-ignored versus rejected.
"""

from ._reader import ConfigError
from .aio import AIO_BACKENDS, AIO_LIMITS, AioConfig, validate_aio_section
from .loader import ZeroOffloadConfig, ZeroOffloadSection, load_config
from .optimizer import OPTIMIZER_TYPES, SCHEDULER_TYPES, OptimizerConfig, SchedulerConfig, parse_scheduler
from .precision import BF16Config, FP16Config
from .zero import MIN_SUB_GROUP_SIZE, OFFLOAD_DEVICES, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AIO_BACKENDS",
    "AIO_LIMITS",
    "MIN_SUB_GROUP_SIZE",
    "OFFLOAD_DEVICES",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "AioConfig",
    "BF16Config",
    "ConfigError",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroOffloadConfig",
    "ZeroOffloadSection",
    "load_config",
    "parse_scheduler",
    "validate_aio_section",
]
