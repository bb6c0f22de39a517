"""What checkpoints need of an engine: the public members of `zero.engine.ZeroEngine` they use.

A Protocol, so that this package does not import the engine (the engine's save_checkpoint and
load_checkpoint call into this package).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol

import torch
from torch import nn

from offload.config.loader import ZeroOffloadConfig

__all__ = ["CheckpointEngine"]

VisitFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]


class CheckpointEngine(Protocol):
    rank: int
    world_size: int
    stage: int
    device: torch.device
    dtype: torch.dtype
    config: ZeroOffloadConfig
    module: nn.Module
    optimizer: Any
    rule: Any
    lr_scheduler: Optional[Any]
    loss_scaler: Optional[Any]
    layout: Any
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int

    @property
    def partitioner(self) -> Any: ...

    @property
    def part_numel(self) -> int: ...

    @property
    def trainable_numel(self) -> int: ...

    @property
    def lo(self) -> int: ...

    @property
    def hi(self) -> int: ...

    def check_open(self) -> None: ...

    def check_state_usable(self) -> None: ...

    def zero_gather_16bit_weights_on_model_save(self) -> bool: ...

    def prepare_checkpoint_save(self) -> None: ...

    def stream_optimizer_state(self, fn: VisitFn) -> None: ...

    def load_optimizer_state(self, fn: VisitFn) -> None: ...

    def sync_master_from_module(self) -> None: ...

    def poison_state(self, err: BaseException, what: Optional[str] = None) -> None: ...

    def mark_state_restored(self) -> None: ...

    def zero_grad(self) -> None: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]: ...
