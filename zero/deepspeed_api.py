"""DeepSpeed's launcher conventions: `--local_rank` / LOCAL_RANK, the process group, the config arguments.

A script written for DeepSpeed keeps working unchanged under `deepspeed`, `torchrun` or a plain `python`:

* `add_config_arguments(parser)` (DeepSpeed's `deepspeed.add_config_arguments`) adds `--deepspeed`,
  `--deepspeed_config` (and the deprecated `--deepscale`, `--deepscale_config`) and accepts
  `--local_rank` / `--local-rank`, which the `deepspeed` launcher passes to every process (options the
  parser already has are left as they are);
* `init_distributed(args)`, called by `zero.initialize`: the local rank is `args.local_rank` or the
  LOCAL_RANK environment variable (torchrun and the `deepspeed` launcher set it); on CUDA the current device
  is set from it (or from `args.device_rank`, which Lightning passes) before the process group starts, so
  NCCL binds each process to its own GPU; a process group the script already started is used as it is,
  never started again; otherwise one is started when WORLD_SIZE > 1 (gloo on the CPU, NCCL on CUDA);
* `start_process_group()`, called by `zero.Init`: as DeepSpeed's Init, a process group always exists
  afterwards - the launchers' one (init_distributed) or, in a plain one-process run, a group of one process
  over an in-memory store (no port is opened).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from zero.accelerator import accelerator_name, dist_backend

__all__ = ["add_config_arguments", "init_distributed", "local_rank_of", "start_process_group"]


def _add(parser: Any, names: Tuple[str, ...], **kwargs: Any) -> None:
    """Add the option under those of `names` that `parser` does not know yet (none: nothing to do)."""
    known = parser._option_string_actions  # argparse's table of option strings (groups share it)
    missing = tuple(n for n in names if n not in known)
    if missing:
        parser.add_argument(*missing, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `add_config_arguments`: add the DeepSpeed options to `parser` and return it.

    `--deepspeed` (a flag for the script's own use), `--deepspeed_config PATH` (read by
    `zero.initialize(args=...)` when no `config=` is given), the deprecated `--deepscale` /
    `--deepscale_config`, and `--local_rank` / `--local-rank` (int, default -1: not launched by the
    `deepspeed` launcher). Options the parser already defines are kept as they are."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    _add(group, ("--deepspeed",), default=False, action="store_true", help="Enable DeepSpeed (for user code)")
    _add(group, ("--deepspeed_config",), default=None, type=str, help="DeepSpeed json configuration file.")
    _add(group, ("--deepscale",), default=False, action="store_true", help="Deprecated: --deepspeed")
    _add(group, ("--deepscale_config",), default=None, type=str, help="Deprecated: --deepspeed_config")
    _add(
        group,
        ("--local_rank", "--local-rank"),
        dest="local_rank",
        default=-1,
        type=int,
        help="local rank passed by the launcher (LOCAL_RANK is read as well)",
    )
    return parser


def local_rank_of(args: Any = None) -> Optional[int]:
    """This process's rank on its node: `args.local_rank` (the `deepspeed` launcher's `--local_rank`;
    negative or None: not given) or the LOCAL_RANK environment variable; None when neither is set.
    ValueError when both are set and differ (DeepSpeed refuses that too)."""
    arg = getattr(args, "local_rank", None) if args is not None else None
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, int):
            raise ValueError(f"args.local_rank must be an int, got {arg!r} ({type(arg).__name__})")
        if arg < 0:
            arg = None
    env = os.environ.get("LOCAL_RANK")
    env_rank = None
    if env is not None and env.strip():
        try:
            env_rank = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_RANK={env!r} is not an integer") from None
    if arg is not None and env_rank is not None and arg != env_rank:
        raise ValueError(
            f"args.local_rank={arg} but the environment has LOCAL_RANK={env_rank}: they must agree"
        )
    return arg if arg is not None else env_rank


def init_distributed(
    args: Any = None, dist_init_required: Optional[bool] = None
) -> Tuple[int, int, Optional[int]]:
    """(rank, world_size, device index) for `zero.initialize` (see the module doc).

    The device index is `args.device_rank` if given, else the local rank (`local_rank_of(args)`); None
    when neither is known (the engine then uses torch's current device). On CUDA it becomes the current
    device before any process group starts. An initialized process group is adopted. Otherwise one is
    started when WORLD_SIZE > 1 (the launchers' MASTER_ADDR / MASTER_PORT / RANK are read by torch),
    unless `dist_init_required` is False (then: one process, rank 0 of 1)."""
    device = getattr(args, "device_rank", None) if args is not None else None
    if device is None or device < 0:
        device = local_rank_of(args)
    if device is not None and accelerator_name() == "cuda":
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and dist_init_required is not False:
        dist.init_process_group(backend=dist_backend())
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def start_process_group() -> None:
    """Make sure a process group exists (DeepSpeed's zero.Init starts one when there is none).

    An initialized group is kept. Otherwise `init_distributed()` starts the launchers' group (WORLD_SIZE > 1,
    CUDA device from LOCAL_RANK first); in a plain one-process run a group of one process is started over an
    in-memory store, so nothing is read from the environment and no port is opened."""
    if not dist.is_available() or dist.is_initialized():
        return
    init_distributed()
    if not dist.is_initialized():
        dist.init_process_group(backend=dist_backend(), store=dist.HashStore(), rank=0, world_size=1)
