"""The compute device: CUDA when torch sees a GPU, else the CPU, unless the environment says otherwise.

`ZO_ACCELERATOR` (or DeepSpeed's `DS_ACCELERATOR`, so a DeepSpeed user's habit carries over) set to "cpu"
keeps the engine, its partitions and its process group (gloo) off the GPU on a machine that has one: for
debugging, for CPU-only runs beside a busy GPU, and for the test suite, whose default run checks the CPU
paths on any machine. "cuda" insists on the GPU and fails clearly when torch cannot use one.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

__all__ = ["ENV_VARS", "accelerator_name", "compute_device", "dist_backend"]

ENV_VARS: Tuple[str, ...] = ("ZO_ACCELERATOR", "DS_ACCELERATOR")
_KNOWN = ("cpu", "cuda")


def accelerator_name() -> str:
    """Which accelerator to compute on, "cuda" or "cpu": the first of ENV_VARS that is set, else "cuda"
    exactly when torch has a GPU."""
    for var in ENV_VARS:
        value = os.environ.get(var, "").strip().lower()
        if not value:
            continue
        if value not in _KNOWN:
            raise ValueError(
                f"{var}={os.environ[var]!r} is not an accelerator this engine runs on: use one of {_KNOWN}"
            )
        if value == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"{var}=cuda but torch sees no usable CUDA device (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'none'}); unset it or set it to 'cpu'"
            )
        return value
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_device(local_rank: Optional[int] = None) -> torch.device:
    """The device the model computes on; `local_rank` picks the GPU (None: torch's current one)."""
    if accelerator_name() == "cpu":
        return torch.device("cpu")
    index = torch.cuda.current_device() if local_rank is None else int(local_rank)
    return torch.device("cuda", index)


def dist_backend() -> str:
    """torch.distributed backend for the accelerator: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if accelerator_name() == "cuda" else "gloo"
