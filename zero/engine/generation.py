"""TRL's `unwrap_model_for_generation` for an engine of ours: the plain module to call `generate` on, with a
stage-3 model's parameters gathered once for the whole block.

TRL's own version asks accelerate whether DeepSpeed runs ZeRO-3, gathers every parameter with
`deepspeed.zero.GatheredParameters` and removes DeepSpeed's module hooks through the optimizer's internal
`parameter_offload`. Here the stage-3 hooks can stay: a unit that a GatheredParameters block holds is not
freed by the modules' forwards, so each generated token costs no gather.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

__all__ = ["unwrap_model_for_generation"]


@contextlib.contextmanager
def unwrap_model_for_generation(
    model: Any, accelerator: Any = None, gather_deepspeed3_params: bool = True
) -> Iterator[nn.Module]:
    """Yield the module inside `model` (a ZeroEngine, an accelerate-wrapped model, or a plain module).

    Stage 3 with `gather_deepspeed3_params` (TRL's default): every parameter is gathered on entry and
    partitioned again on exit (weights modified inside the block are not written back, as in TRL: generation
    only reads them). `gather_deepspeed3_params=False`: each module gathers its parameters when it runs.
    `accelerator`: when given, its `unwrap_model` is applied first (TRL's signature)."""
    from zero.stage3 import GatheredParameters

    if accelerator is not None and hasattr(accelerator, "unwrap_model"):
        model = accelerator.unwrap_model(model)
    module = getattr(model, "module", model)
    while hasattr(module, "module") and isinstance(module.module, nn.Module):  # DDP and the like
        module = module.module
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    if gather_deepspeed3_params and stage in (None, 3):
        # no-op when nothing is partitioned (GatheredParameters ignores parameters stage 3 does not own)
        with GatheredParameters(list(module.parameters())):
            yield module
    else:
        yield module
