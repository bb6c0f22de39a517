"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`), checkpoints on a memory tier.

    cfg = {"activation_checkpointing": {"cpu_checkpointing": True}}
    zero.checkpointing.configure(None, deepspeed_config=cfg)  # or let zero.initialize read cfg
    y = zero.checkpointing.checkpoint(block, x)  # where a model would call torch's checkpoint
    zero.checkpointing.apply(model)  # or: checkpoint a model's repeated blocks (HF models too)

`checkpoint` is `torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`: the same results
bit for bit, RNG state replayed. What it adds is where each checkpointed block's inputs wait for the
backward: in place (offload_device "none"), in pinned host memory ("cpu", `cpu_checkpointing`) or in an NVMe
scratch file ("nvme"), moved off as the next block runs and brought back one block ahead of the backward that
needs them (`zero.activations.stash`, `zero.activations.tiers`). The engine configures this module from
its config's `activation_checkpointing` section; `configure` does it by hand, as in DeepSpeed. Under
`torch.no_grad` nothing is checkpointed: the function just runs.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Union

import torch
import torch.utils.checkpoint as torch_checkpoint

from offload.config.activation import ActivationCheckpointingConfig
from offload.config.aio import AioConfig
from offload.config.loader import ConfigInput, ZeroOffloadConfig, load_config
from offload.pinned import PinnedPool, default_pinned_budget
from zero.activations.nvme import NvmeTier
from zero.activations.stash import ActivationStash, CheckpointingReport
from zero.activations.tiers import CheckpointBufferError, DeviceTier, HostBuffers, HostTier, Tier

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointBufferError",
    "Checkpointer",
    "CheckpointingReport",
    "checkpoint",
    "close",
    "configure",
    "current",
    "is_configured",
    "reset",
    "take_report",
]

logger = logging.getLogger("zero")


class Checkpointer:
    """A configuration in use: the stash over its tier, and the boundary synchronisation."""

    def __init__(
        self,
        config: ActivationCheckpointingConfig,
        aio: Optional[AioConfig] = None,
        pinned_budget_bytes: Optional[int] = None,
        pool: Optional[PinnedPool] = None,
    ) -> None:
        self.config = config
        # pinned staging comes out of the engine's pool (one cap for both) when it configures us
        self.pool = pool if pool is not None else PinnedPool(default_pinned_budget(pinned_budget_bytes))
        tier = make_tier(config, aio or AioConfig(), self.pool)
        # offload_device "none" without preallocated buffers moves nothing: no hooks at all then
        moves = config.offload_device != "none" or config.contiguous_memory_optimization
        self.stash: Optional[ActivationStash] = ActivationStash(tier, config.profile) if moves else None
        self._tier = tier
        self._checkpoints = 0
        self._lock = threading.Lock()

    @property
    def scratch_files(self) -> List[str]:
        """The NVMe scratch files that exist now (offload_device "nvme"; else empty)."""
        files = getattr(self._tier, "scratch_files", None)
        return files() if files is not None else []

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)` checkpointed (see `zero.checkpointing.checkpoint`)."""
        kwargs.setdefault("use_reentrant", False)
        sync = self.config.synchronize_checkpoint_boundary
        if sync:
            self._synchronize()
        if self.stash is None:
            with self._lock:
                self._checkpoints += 1
            out = torch_checkpoint.checkpoint(_nested(function), *args, **kwargs)
        else:
            self.stash.begin_block()
            with torch.autograd.graph.saved_tensors_hooks(self.stash.pack, self.stash.unpack):
                out = torch_checkpoint.checkpoint(_nested(function), *args, **kwargs)
        if sync:
            self._synchronize()
        return out

    def _synchronize(self) -> None:
        """synchronize_checkpoint_boundary: the device, and the checkpoint moves started so far."""
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        if self.stash is not None:
            self.stash.flush()

    def take_report(self) -> CheckpointingReport:
        """Counts and (with `profile`) times since the last call."""
        if self.stash is not None:
            return self.stash.take_report()
        with self._lock:
            n, self._checkpoints = self._checkpoints, 0
        return CheckpointingReport(checkpoints=n)

    def new_pass(self) -> None:
        """The next checkpoint starts a new pass (DeepSpeed's `reset`)."""
        if self.stash is not None:
            self.stash.new_pass()

    def close(self) -> None:
        """Free buffers and scratch files."""
        if self.stash is not None:
            self.stash.close()
        else:
            self._tier.close()


def make_tier(cfg: ActivationCheckpointingConfig, aio: AioConfig, pool: PinnedPool) -> Tier:
    """The tier a configuration asks for (`aio`: the settings of the NVMe tier's aio handle)."""
    slots = cfg.number_checkpoints if cfg.contiguous_memory_optimization else None
    if cfg.offload_device == "nvme":
        return NvmeTier(cfg.nvme_path, aio, pool, slots)
    if cfg.offload_device == "cpu":
        return HostTier(HostBuffers(pool, slots))
    return DeviceTier(slots, pool)


_active: Optional[Checkpointer] = None
_active_lock = threading.Lock()
_depth = threading.local()


@contextmanager
def _inside() -> Iterator[None]:
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        yield
    finally:
        _depth.n -= 1


def _nested(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, marked as running inside a checkpoint (in the forward and in the recompute alike), so a
    checkpoint nested in it is a plain torch checkpoint that stashes nothing."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _inside():
            return function(*args, **kwargs)

    return run


def _section(
    deepspeed_config: Union[ConfigInput, ActivationCheckpointingConfig],
) -> ActivationCheckpointingConfig:
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, ZeroOffloadConfig):
        return deepspeed_config.activation_checkpointing
    return load_config(deepspeed_config).activation_checkpointing


def configure(
    mpu_: Any = None,
    deepspeed_config: Union[ConfigInput, ActivationCheckpointingConfig] = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
    *,
    aio: Optional[AioConfig] = None,
    pinned_budget_bytes: Optional[int] = None,
    pool: Optional[PinnedPool] = None,
) -> Checkpointer:
    """Configure checkpointing for this process, as `deepspeed.checkpointing.configure` does.

    `deepspeed_config`: a config dict, a JSON path or a loaded config; its `activation_checkpointing` section
    is read, then each argument given here overrides its key (`checkpoint_in_cpu` is `cpu_checkpointing`,
    `contiguous_checkpointing` is `contiguous_memory_optimization`, `num_checkpoints` is
    `number_checkpoints`, `synchronize` is `synchronize_checkpoint_boundary`). `mpu_`: a model-parallel unit;
    with one model-parallel rank there is nothing to partition, more are refused. Ours, keyword only: `aio`
    (the NVMe tier's aio settings), `pinned_budget_bytes` or `pool` (a PinnedPool to take pinned staging
    from; the engine passes its own, so one cap covers both). Replaces (and closes) an earlier configuration;
    returns the new one.
    """
    import dataclasses

    cfg = _section(deepspeed_config)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    changes = {k: v for k, v in overrides.items() if v is not None}
    if checkpoint_in_cpu is not None:
        changes["cpu_checkpointing"] = bool(checkpoint_in_cpu)
        if checkpoint_in_cpu and cfg.offload_device == "none":
            changes["offload_device"] = "cpu"
        elif not checkpoint_in_cpu and cfg.offload_device == "cpu":
            changes["offload_device"] = "none"
    cfg = dataclasses.replace(cfg, **changes)
    if cfg.contiguous_memory_optimization and cfg.number_checkpoints is None:
        raise ValueError("contiguous_checkpointing needs num_checkpoints (how many buffers to preallocate)")
    mp = mpu_.get_model_parallel_world_size() if mpu_ is not None else 1
    if cfg.partition_activations:
        if mp > 1:
            raise NotImplementedError(
                f"partition_activations across {mp} model-parallel ranks is not supported; zero-offload runs"
                " one model-parallel rank per model"
            )
        logger.info(
            "activation_checkpointing.partition_activations: one model-parallel rank, nothing to split"
        )
    new = Checkpointer(cfg, aio, pinned_budget_bytes, pool)
    global _active
    with _active_lock:
        old, _active = _active, new
    if old is not None:
        old.close()
    return new


def is_configured() -> bool:
    """Whether `configure` (or an engine whose config has the section) has configured checkpointing."""
    return _active is not None


def current() -> Optional[Checkpointer]:
    """The configuration in use, or None."""
    return _active


def reset() -> None:
    """DeepSpeed's `reset`: the next checkpoint starts a new pass, for forwards run without a backward (their
    stashed inputs are freed when autograd drops them). Configuration and buffers stay."""
    if _active is not None:
        _active.new_pass()


def close(checkpointer: Optional[Checkpointer] = None) -> None:
    """Forget the configuration (only if it is `checkpointer`, when given) and free its buffers and files."""
    global _active
    with _active_lock:
        if _active is None or (checkpointer is not None and _active is not checkpointer):
            return
        old, _active = _active, None
    old.close()


def take_report() -> CheckpointingReport:
    """Counts since the last call for the configuration in use (empty when none is)."""
    return _active.take_report() if _active is not None else CheckpointingReport()


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`, with the block's
    inputs kept where the configuration says. Works as Hugging Face's `gradient_checkpointing_func`. Under
    `torch.no_grad` (or inside another checkpointed function) it runs like torch's checkpoint there."""
    if not torch.is_grad_enabled():
        return function(*args, **{k: v for k, v in kwargs.items() if k not in _TORCH_KWARGS})
    active = _active
    if active is None or getattr(_depth, "n", 0) > 0:
        kwargs.setdefault("use_reentrant", False)
        return torch_checkpoint.checkpoint(function, *args, **kwargs)
    return active.checkpoint(function, *args, **kwargs)


_TORCH_KWARGS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug")
