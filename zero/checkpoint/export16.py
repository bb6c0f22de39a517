"""DeepSpeed's 16-bit model export: `save_16bit_model` and `_zero3_consolidated_16bit_state_dict`.

The weights as the model computes with them (fp16/bf16 when the config trains in 16 bits, else fp32 - as
DeepSpeed, whose "16bit" means the model's dtype), whole, as one `model.state_dict()` that a plain torch
model loads. At stage 3 the parameters are gathered one unit (module) at a time and copied to host memory
on rank 0 only, so no rank ever holds more than one whole unit on the device and only rank 0 holds the
result; at stages 0-2 every rank holds the whole module and rank 0 copies it. Both are collective at
stage 3: every rank must call them.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

import torch

from zero.checkpoint._agree import agree, attempt
from zero.checkpoint._engine import CheckpointEngine
from zero.checkpoint._output import save_atomic

__all__ = ["save_16bit_model", "zero3_consolidated_16bit_state_dict"]

logger = logging.getLogger("zero")


def _drop_frozen(engine: CheckpointEngine, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    frozen = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in sd.items() if k not in frozen}


def zero3_consolidated_16bit_state_dict(
    engine: CheckpointEngine, exclude_frozen_parameters: bool = False
) -> Optional[Dict[str, torch.Tensor]]:
    """The whole model's state dict in the model dtype on rank 0's host memory, None on the other ranks
    (DeepSpeed's `_zero3_consolidated_16bit_state_dict`). Stage 3 only (ValueError otherwise, as in
    DeepSpeed); collective. `exclude_frozen_parameters` leaves out parameters with requires_grad False."""
    if engine.stage != 3:
        raise ValueError(
            f"_zero3_consolidated_16bit_state_dict needs ZeRO stage 3; at stage {engine.stage} every rank "
            "holds the whole module: engine.module.state_dict() is the same thing"
        )
    engine.check_open()
    keep = engine.rank == 0
    sd = engine.partitioner.gathered_state_dict(engine.module, keep=keep)
    if not keep:
        return None
    return _drop_frozen(engine, sd) if exclude_frozen_parameters else sd


def save_16bit_model(
    engine: CheckpointEngine,
    save_dir: str,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the whole model's state dict (model dtype) to `save_dir/save_filename` from rank 0 with
    torch.save, atomically (a fresh temporary file beside it, fsynced, renamed; mode 0666 less the umask, as
    zero/checkpoint/_output.py says): True when saved. Every rank must call it.
    At stage 3 it needs `stage3_gather_16bit_weights_on_model_save: true`, as in DeepSpeed: without it a
    warning is logged, nothing is written and False returned. If the write fails, every rank raises."""
    engine.check_open()
    engine.check_state_usable()
    path = os.path.join(save_dir, save_filename)
    if engine.stage == 3:
        if not engine.zero_gather_16bit_weights_on_model_save():
            logger.warning(
                "save_16bit_model: %s not saved: at stage 3 it needs "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save = true",
                path,
            )
            return False
        sd = zero3_consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
    elif engine.rank == 0:
        sd = engine.layout.module_state_dict()
        if exclude_frozen_parameters:
            sd = _drop_frozen(engine, sd)
    else:
        sd = None
    err = None
    if engine.rank == 0:
        logger.info("save_16bit_model: saving the model weights to %s", path)
        _, err = attempt(lambda: save_atomic(sd, path))
    agree(engine, err, f"save_16bit_model({path})")
    return True
