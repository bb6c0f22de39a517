"""Memory estimates for ZeRO stages 0-3 with CPU and NVMe offload: bytes per GPU, per node's host memory
(pinned and pageable) and per node's NVMe, with a per-component breakdown. See docs/estimator.md."""

from .activations import ActivationSettings, activation_bytes
from .counting import ParamCount, count_parameters, load_model_on_meta
from .deepspeed_compat import DeepSpeedRow, deepspeed_rows, zero2_model_states, zero3_model_states
from .ds_config import ConfigChoices, read_ds_config
from .errors import EstimateInputError
from .formulas import estimate, estimate_all, largest_layer_heuristic
from .machine import (
    FitCheck,
    MachineProfile,
    check_fit,
    detect_machine,
    load_machine_profile,
    nvme_io_seconds,
    recommend,
)
from .placement import (
    COMPONENTS,
    ENGINE_PLACEMENT,
    OPTIMIZER_STATES_PER_PARAM,
    EnginePlacement,
    check_combination,
    valid_combinations,
)
from .result import MemoryEstimate
from .setup import SwapBufferSettings, TrainingSetup
from .units import format_bytes, parse_count

__all__ = [
    "COMPONENTS",
    "ENGINE_PLACEMENT",
    "OPTIMIZER_STATES_PER_PARAM",
    "ActivationSettings",
    "ConfigChoices",
    "DeepSpeedRow",
    "EnginePlacement",
    "EstimateInputError",
    "FitCheck",
    "MachineProfile",
    "MemoryEstimate",
    "ParamCount",
    "SwapBufferSettings",
    "TrainingSetup",
    "activation_bytes",
    "check_combination",
    "check_fit",
    "count_parameters",
    "deepspeed_rows",
    "detect_machine",
    "estimate",
    "estimate_all",
    "format_bytes",
    "largest_layer_heuristic",
    "load_machine_profile",
    "load_model_on_meta",
    "nvme_io_seconds",
    "parse_count",
    "read_ds_config",
    "recommend",
    "valid_combinations",
    "zero2_model_states",
    "zero3_model_states",
]
