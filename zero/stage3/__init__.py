"""ZeRO stage 3: parameters partitioned across ranks and tiers, gathered per module when needed."""

from zero.stage3.gathered import GatheredParameters
from zero.stage3.grads import GradSink, SummingSink
from zero.stage3.hooks import Stage3Hooks, register_external_parameter, unregister_external_parameter
from zero.stage3.init import Init
from zero.stage3.io_report import ParamIOReport
from zero.stage3.partitioner import Stage3Partitioner
from zero.stage3.store import PartitionStore, Stage3PinnedBudgetError
from zero.stage3.unit import ParamSlice, PartitionStatus, Unit, ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "GradSink",
    "ParamIOReport",
    "Init",
    "ParamSlice",
    "PartitionStatus",
    "PartitionStore",
    "Stage3Hooks",
    "Stage3Partitioner",
    "SummingSink",
    "Stage3PinnedBudgetError",
    "Unit",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
