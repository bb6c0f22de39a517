"""`zero.initialize` (exported by the package): DeepSpeed's `deepspeed.initialize`, same arguments."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from offload.config.loader import ZeroOffloadConfig
from zero.deepspeed_api import init_distributed
from zero.engine.engine import ZeroEngine

__all__ = ["initialize"]


def _data_loader(
    dataset: Any, cfg: ZeroOffloadConfig, rank: int, world_size: int, collate_fn: Optional[Callable]
) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if world_size > 1:
        sampler: Any = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    else:
        sampler = RandomSampler(dataset)
    return DataLoader(
        dataset, batch_size=int(cfg.train_micro_batch_size_per_gpu), sampler=sampler, collate_fn=collate_fn
    )


def initialize(
    args: Any = None,
    model: Optional[nn.Module] = None,
    optimizer: Optional[Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]] = None,
    model_parameters: Optional[Any] = None,
    training_data: Optional[Any] = None,
    lr_scheduler: Optional[Any] = None,
    collate_fn: Optional[Callable] = None,
    config: Optional[Union[str, Dict[str, Any]]] = None,
    config_params: Optional[Union[str, Dict[str, Any]]] = None,
    dist_init_required: Optional[bool] = None,
) -> Tuple[ZeroEngine, Optional[torch.optim.Optimizer], Optional[Any], Optional[Any]]:
    """Wrap `model` for training: returns `(engine, optimizer, training_dataloader, lr_scheduler)`.

    `config` (or DeepSpeed's older `config_params`, or `args.deepspeed_config`) is a dict or a JSON file path.
    Single process needs no launcher; under torchrun or the `deepspeed` launcher the process group is
    started (gloo on CPU, NCCL on CUDA) unless one exists, after the CUDA device was set from
    `args.local_rank` / LOCAL_RANK (zero.deepspeed_api.init_distributed). `optimizer` may be a torch
    optimizer or a callable taking the parameters; given together with the config's optimizer block, it
    wins and the block is ignored with a warning (DeepSpeed's rule). `lr_scheduler` may be a scheduler or
    a callable taking the optimizer; without one, the config's scheduler block is used. With neither an
    optimizer block nor `optimizer=`, the engine runs inference only (zero/inference/parts.py,
    docs/inference.md): `(engine, None, dataloader, None)`, forward and generate work, `backward`/`step` raise
    `zero.NoOptimizerError`.
    """
    from offload.config import load_config

    if model is None:
        raise ValueError("zero.initialize needs model=")
    if config is not None and config_params is not None:
        raise ValueError("give the config once: config= or config_params=, not both")
    raw = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if raw is not None and from_args is not None:
        raise ValueError(  # as DeepSpeed: which one was meant cannot be told
            f"a config was given both as config= and as args.deepspeed_config ({from_args!r}); give one"
        )
    raw = raw if raw is not None else from_args
    if raw is None:
        raise ValueError("zero.initialize needs config= (a dict or the path of a DeepSpeed JSON config)")
    rank, world_size, local_rank = init_distributed(args, dist_init_required)
    raw = _filled(raw, model, world_size)
    cfg = load_config(raw, world_size)
    engine = ZeroEngine(
        model,
        cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
    )
    loader = (
        _data_loader(training_data, cfg, rank, world_size, collate_fn) if training_data is not None else None
    )
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _filled(raw: Any, model: Any, world_size: int) -> Any:
    """`raw` with Hugging Face's "auto" values filled from the model and a plan
    (zero.engine.auto_values); unchanged when it has none."""
    from offload.config._reader import read_json_file
    from zero.engine.auto_values import auto_keys, fill_auto_values

    data = raw if isinstance(raw, dict) else read_json_file(os.fspath(raw)) if _is_path(raw) else raw
    if not isinstance(data, dict) or not auto_keys(data):
        return raw
    return fill_auto_values(data, model, world_size)


def _is_path(raw: Any) -> bool:
    return isinstance(raw, (str, os.PathLike)) and os.path.isfile(os.fspath(raw))
