"""PyTorch Lightning strategy: `Trainer(strategy="zero_offload")` trains through `zero.initialize`.

```python
import zero.integrations.lightning  # registers "zero_offload" and "zero_offload_stage_3"
trainer = lightning.Trainer(strategy="zero_offload", accelerator="cpu", devices=1)
trainer = lightning.Trainer(strategy=ZeroStrategy(config="ds_config.json"), ...)
```

`ZeroStrategy` drives one `ZeroEngine` the way Lightning's DeepSpeedStrategy drives DeepSpeed's: the
LightningModule and the optimizer of `configure_optimizers` (or the config's optimizer block) go through
`zero.initialize`; backward and the optimizer step are `engine.backward` / `engine.step`; `configure_model`
runs under `zero.Init` at stage 3; checkpoints are the engine's (a directory per `trainer.save_checkpoint`
path, Lightning's own state in its client state). One process on one device (docs/integrations.md).

The module is a little over 500 lines: ZeroStrategy is Lightning's Strategy interface, one short method
per hook, and a class split over modules would be harder to check against Lightning's than one.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Generator, List, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.core.optimizer import (
    LightningOptimizer,
    _init_optimizers_and_lr_schedulers,
    _MockOptimizer,
)
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer

from zero.integrations.config import apply_trainer_settings, config_from_arguments

__all__ = ["ZeroPrecision", "ZeroStrategy"]

_warnings = WarningCache()

CHECKPOINT_TAG = "checkpoint"  # the engine's tag inside each checkpoint directory (DeepSpeed's strategy's)
_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}
_DTYPES.update({"16-mixed": torch.float16, "16-true": torch.float16})


class ZeroPrecision(Precision):
    """The precision plugin `ZeroStrategy` installs: the engine does the mixed precision itself.

    "32-true" trains in fp32; "bf16-mixed" and "bf16-true" both mean the config's `bf16` (16-bit weights and
    activations, fp32 master and optimizer state), "16-mixed" / "16-true" its `fp16` (dynamic loss scaling
    by the engine). Floating-point inputs are cast to the 16-bit dtype; clipping is the engine's
    (`gradient_clipping`); there is no autocast.
    """

    def __init__(self, precision: str = "32-true") -> None:
        precision = "32-true" if str(precision) == "32" else str(precision)
        if precision not in _DTYPES:
            raise ValueError(
                f"ZeroStrategy does not support precision={precision!r}: use one of {sorted(_DTYPES)}"
            )
        self.precision = precision  # type: ignore[assignment]
        self.dtype = _DTYPES[precision]

    @property
    def config_key(self) -> Optional[str]:
        """The config section this precision enables: "bf16", "fp16", or None for fp32."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype)

    def convert_input(self, data: Any) -> Any:
        """Floating-point tensors of a batch in the 16-bit dtype (fp32: unchanged)."""
        if self.dtype == torch.float32:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)

    def tensor_init_context(self) -> ContextManager:
        """For "16-true" / "bf16-true": tensors made in `configure_model` are 16-bit (as DeepSpeed's)."""
        if "true" in self.precision and self.dtype != torch.float32:
            return _DtypeContextManager(self.dtype)
        return nullcontext()

    def module_init_context(self) -> ContextManager:
        """The same as `tensor_init_context`."""
        return self.tensor_init_context()

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        """Nothing: the engine clips by the config's `gradient_clipping` (the Trainer's gradient_clip_val)."""


class ZeroStrategy(Strategy):
    """Lightning 2.x strategy training a LightningModule with the zero-offload engine (one process).

    `config`: a DeepSpeed config, dict or JSON path (default: ZeRO stage 2 with the optimizer state in
    host memory). The keyword arguments of Lightning's DeepSpeedStrategy that name one config key are
    written into (a copy of) it, over what it says (`zero.integrations.config.config_from_arguments`):
    `stage`, `offload_optimizer` / `offload_parameters` (bool), `offload_optimizer_device` /
    `offload_params_device` ("cpu" or "nvme"), `nvme_path` and `pin_memory` (every offload block),
    `logging_batch_size_per_gpu` (train_micro_batch_size_per_gpu), and through `deepspeed_kwargs`
    sub_group_size, buffer counts and sizes, aio, fp16 loss scaling and activation checkpointing. The
    Trainer decides `gradient_accumulation_steps` (accumulate_grad_batches), `gradient_clipping`
    (gradient_clip_val) and `bf16`/`fp16` (precision); a config that says otherwise is an error.
    DeepSpeedStrategy arguments that cannot be honoured (`remote_device`, `load_full_weights`,
    `exclude_frozen_parameters`, a process group) raise. `allow_pickle`: passed to the checkpoint loader
    (a client state only pickle restores; trusted files only).
    """

    strategy_name = "zero_offload"
    is_distributed = False  # one process (the Trainer's connector reads it)

    def __init__(
        self,
        config: Optional[Union[str, os.PathLike, Mapping[str, Any]]] = None,
        stage: Optional[int] = None,
        offload_optimizer: Optional[bool] = None,
        offload_parameters: Optional[bool] = None,
        offload_optimizer_device: Optional[str] = None,
        offload_params_device: Optional[str] = None,
        nvme_path: Optional[str] = None,
        pin_memory: Optional[bool] = None,
        logging_batch_size_per_gpu: Union[str, int] = "auto",
        zero_optimization: bool = True,
        logging_level: Optional[int] = None,
        allow_pickle: bool = False,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        **deepspeed_kwargs: Any,
    ) -> None:
        super().__init__(accelerator, checkpoint_io, precision_plugin)
        if logging_level is not None:
            logging.getLogger("zero").setLevel(logging_level)
        if stage is None and not zero_optimization:
            stage = 0  # DeepSpeedStrategy(zero_optimization=False)
        micro = None if logging_batch_size_per_gpu == "auto" else int(logging_batch_size_per_gpu)
        cfg = config_from_arguments(
            config,
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            offload_optimizer_device=offload_optimizer_device,
            offload_params_device=offload_params_device,
            nvme_path=nvme_path,
            pin_memory=pin_memory,
            micro_batch_size=micro,
            **deepspeed_kwargs,
        )
        self.config: Dict[str, Any] = cfg
        self.allow_pickle = allow_pickle
        self.parallel_devices = parallel_devices  # the Trainer's connector sets it (one device)
        self.num_nodes = 1
        self.global_rank = self.local_rank = self.node_rank = 0
        self.world_size = 1
        self._finalized = False
        self._engine: Any = None
        self._engine_module: Optional[pl.LightningModule] = None
        self._scheduler_configs: List[Any] = []
        self._step_loss: Optional[Tensor] = None

    # ------------------------------------------------------------------------------ Lightning plumbing
    @property
    def precision_plugin(self) -> Precision:
        """A `ZeroPrecision`; Lightning's Precision / MixedPrecision / HalfPrecision are converted to one."""
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Take Lightning's precision plugin as a `ZeroPrecision`; others are refused (ValueError)."""
        if plugin is not None and type(plugin) in (Precision, MixedPrecision, HalfPrecision):
            plugin = ZeroPrecision(plugin.precision)
        elif plugin is not None and not isinstance(plugin, ZeroPrecision):
            raise ValueError(
                f"ZeroStrategy cannot use precision={getattr(plugin, 'precision', None)!r} "
                f"({type(plugin).__name__}): the engine does its own mixed precision; use {sorted(_DTYPES)}"
            )
        self._precision_plugin = plugin

    @property
    def root_device(self) -> torch.device:
        """The device the engine computes on."""
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    @property
    def is_global_zero(self) -> bool:
        """True: one process."""
        return True

    @property
    def engine(self) -> Any:
        """The `ZeroEngine` (after the Trainer's setup): `save_16bit_model`, `consolidated_state_dict`..."""
        if self._engine is None:
            raise RuntimeError("ZeroStrategy.engine exists once the Trainer has set the strategy up")
        return self._engine

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: checkpoints are loaded into the engine, which setup builds."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """False: the engine's checkpoint holds the optimizer state."""
        return False

    @property
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning decides the window (stepping on an epoch's last batch too) and the strategy
        tells the engine each backward whether it ends one (`set_gradient_accumulation_boundary`)."""
        return False

    def model_to_device(self) -> None:
        """Nothing: `zero.initialize` places the module (stage 3: its partitions)."""

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """The tensor itself (one process)."""
        return tensor

    def barrier(self, name: Optional[str] = None) -> None:
        """Nothing to wait for (one process)."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The object itself (one process)."""
        return obj

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """The tensor itself (one process)."""
        return tensor

    def setup_environment(self) -> None:
        """Refuse what one process on one device cannot do; the engine's accelerator must be Lightning's."""
        from zero.accelerator import accelerator_name

        devices = self.parallel_devices or [self.root_device]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # a group of this process alone (zero.Init starts one, as DeepSpeed's) is still one process
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        if initialized:
            world = max(world, torch.distributed.get_world_size())
        if len(devices) != 1 or self.num_nodes != 1 or world > 1:
            raise NotImplementedError(
                f"ZeroStrategy runs one process on one device (devices={len(devices)}, num_nodes="
                f"{self.num_nodes}, WORLD_SIZE={world}); use Trainer(devices=1, num_nodes=1)"
            )
        engine_device = accelerator_name()
        if self.root_device.type != engine_device:
            raise ValueError(
                f"Lightning's accelerator is {self.root_device.type!r} but the engine computes on "
                f"{engine_device!r}: set ZO_ACCELERATOR={self.root_device.type} or pass the matching "
                "Trainer(accelerator=...)"
            )
        super().setup_environment()

    # ------------------------------------------------------------------------------------------ config
    def _stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    def _finalize_config(self) -> None:
        """The Trainer's accumulate_grad_batches, gradient_clip_val and precision into the config."""
        if self._finalized:
            return
        module = self.lightning_module
        assert module is not None, "ZeroStrategy: the Trainer has not connected a LightningModule"
        trainer, precision = module.trainer, self.precision_plugin
        assert isinstance(precision, ZeroPrecision)
        apply_trainer_settings(
            self.config,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            clip_by_value=trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE,
            precision_key=precision.config_key,
            precision_name=precision.precision,
        )
        if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
            _warnings.warn(
                "ZeroStrategy: the engine clips by the config's gradient_clipping (the Trainer's "
                "gradient_clip_val); an overridden LightningModule.configure_gradient_clipping clips nothing"
            )
        self._finalized = True

    # -------------------------------------------------------------------------------------- model set-up
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Stage 3: `zero.Init` places the parameters (no device context); otherwise Lightning's."""
        if self._stage() != 3:
            with super().tensor_init_context(empty_init=empty_init):
                yield
            return
        with self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """At stage 3, `configure_model` runs under `zero.Init`: each layer is partitioned once built."""
        self._finalize_config()
        if self._stage() != 3:
            yield
            return
        from zero.stage3.init import Init

        with Init(config_dict_or_path=self.config):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        """Build the engine (fitting: with the optimizer; otherwise an inference engine), or reuse the one
        this strategy already built for the same LightningModule (validate/test after fit)."""
        self._finalize_config()
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._engine is not None and self._engine_module is module:
            if fitting and self._engine.optimizer is None:
                raise RuntimeError(
                    "ZeroStrategy: this LightningModule is held by an inference engine (validate/test/"
                    "predict ran first); fit it with a new Trainer and module"
                )
        else:
            self.close()
            self._build_engine(module, fitting)
        self.model = self._engine
        if fitting:
            self.optimizers = [self._engine.optimizer]
            self.lr_scheduler_configs = list(self._scheduler_configs)

    def _build_engine(self, module: pl.LightningModule, fitting: bool) -> None:
        from zero.initialization import initialize

        cfg = copy.deepcopy(self.config)
        client: Optional[Optimizer] = None
        schedulers: List[Any] = []
        if not fitting:  # an inference engine: no optimizer, nothing only training reads
            for key in ("optimizer", "scheduler", "gradient_clipping"):
                cfg.pop(key, None)
            cfg.get("zero_optimization", {}).pop("offload_optimizer", None)
        elif "optimizer" in cfg:
            rank_zero_info(
                "ZeroStrategy: the config's optimizer block is used; configure_optimizers is not called"
            )
        else:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError(
                    f"ZeroStrategy trains one optimizer with at most one LR scheduler; configure_optimizers "
                    f"returned {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s)"
                )
            client = optimizers[0]
            if isinstance(client, _MockOptimizer):
                raise ValueError(
                    "ZeroStrategy needs an optimizer: return one from configure_optimizers or give the "
                    "config an optimizer block"
                )
            if schedulers and "scheduler" in cfg:
                raise ValueError(
                    "configure_optimizers returned an LR scheduler and the config has one: keep one"
                )
        device = self.root_device.index if self.root_device.type == "cuda" else None
        engine, optimizer, _, _ = initialize(
            args=argparse.Namespace(device_rank=device),
            model=module,
            optimizer=client,
            model_parameters=client.param_groups if client is not None else None,
            config=cfg,
            dist_init_required=False,
        )
        if client is not None and schedulers:
            _rebind_scheduler(schedulers[0].scheduler, client, optimizer)
        self._engine, self._engine_module, self._scheduler_configs = engine, module, schedulers

    def close(self) -> None:
        """Close the engine (pinned memory, swap files); the strategy builds a new one at its next setup.
        At stage 3 the module's parameters are empty afterwards: export first (`engine.save_16bit_model`)."""
        if self._engine is not None:
            self._engine.close()
        self._engine = self._engine_module = None
        self._scheduler_configs = []

    def teardown(self) -> None:
        """The engine stays (trainer.save_checkpoint, validate and test after fit use it); the module is not
        moved to the CPU (its parameters are the engine's buffers or partitions)."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -------------------------------------------------------------------------------------- training
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step through the engine's forward; remembers the loss it returns."""
        out = super().training_step(*args, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        self._step_loss = loss if isinstance(loss, Tensor) else None
        return out

    def backward(
        self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        """`engine.backward`, told whether this micro-batch ends Lightning's accumulation window.

        Lightning divides the training step's loss by accumulate_grad_batches and the engine divides by
        gradient_accumulation_steps (DeepSpeed's rule), so the engine gets the loss the training step
        returned: the gradients are the default strategy's, divided once."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if is_overridden("backward", module, pl.LightningModule):
            _warnings.warn(
                "ZeroStrategy: LightningModule.backward is not called; the engine runs the backward"
            )
        loss, boundary = closure_loss, True
        if module.automatic_optimization:
            boundary = not module.trainer.fit_loop._should_accumulate()
            if self._step_loss is not None:
                loss = self._step_loss
        self._step_loss = None
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        """Run the closure (training step, backward), Lightning's before-step hooks, then `engine.step()`.
        A training step that returned None (no backward) steps nothing, as with Lightning's default."""
        model = model or self.lightning_module
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("ZeroStrategy cannot step LBFGS (it re-evaluates the closure)")
        result = closure()
        self.precision_plugin._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            return None
        self.engine.step()
        optimizer._opt_called = True  # torch's LR schedulers: the optimizer has stepped
        return result

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Tensor]:
        """Empty: the engine's checkpoint holds the optimizer state (reading it here would read it twice)."""
        return {}

    # -------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """`engine.save_checkpoint(filepath, tag="checkpoint")`: `filepath` becomes a directory; Lightning's
        state (loops, callbacks, LR schedulers, hyperparameters) is its client state."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint takes no storage_options (no CheckpointIO is used)")
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(os.fspath(filepath), tag=CHECKPOINT_TAG, client_state=client)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load a directory `save_checkpoint` wrote into the engine (module, optimizer state when fitting,
        RNG states) and return Lightning's state. `weights_only` is not used: loading never unpickles
        unless the strategy was built with allow_pickle=True."""
        from zero.checkpoint import load_checkpoint

        path = os.fspath(checkpoint_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"ZeroStrategy resumes from a checkpoint directory it saved; {path!r} is not a directory"
            )
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        loaded, client_state = load_checkpoint(
            self.engine,
            path,
            load_module_strict=module.strict_loading,
            load_optimizer_states=fitting,
            load_lr_scheduler_states=fitting,
            allow_pickle=self.allow_pickle,
        )
        if loaded is None:
            raise FileNotFoundError(f"{path} holds no checkpoint (no `latest` file)")
        return client_state if client_state is not None else {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: `load_checkpoint` loaded the module into the engine."""

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register "zero_offload" (stage 2, optimizer state in host memory) and "zero_offload_stage_3"
        (stage 3, parameters and optimizer state in host memory)."""
        strategy_registry.register(
            "zero_offload", cls, description="zero-offload: ZeRO stage 2, optimizer on CPU", override=True
        )
        strategy_registry.register(
            "zero_offload_stage_3",
            cls,
            description="zero-offload: ZeRO stage 3, parameters and optimizer on CPU",
            override=True,
            stage=3,
            offload_parameters=True,
        )


def _rebind_scheduler(scheduler: Any, client: Optimizer, optimizer: Optimizer) -> None:
    """Point the LR scheduler of `configure_optimizers` at the engine's optimizer: the client optimizer
    only lent its hyperparameters; the keys the scheduler added (initial_lr) come along."""
    if getattr(scheduler, "optimizer", None) is not client:
        raise ValueError("the LR scheduler is not attached to the optimizer configure_optimizers returned")
    for group, lent in zip(optimizer.param_groups, client.param_groups):  # the engine keeps its groups
        for key, value in lent.items():
            if key != "params" and key not in group:
                group[key] = value
        group["lr"] = lent["lr"]
    scheduler.optimizer = optimizer
    step = optimizer.step  # torch's schedulers check that optimizer.step is their wrapper: mark the engine's

    def marked_step(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)  # raises: the engine steps (engine.step() sets `_opt_called`)

    marked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked_step  # type: ignore[method-assign]


ZeroStrategy.register_strategies(StrategyRegistry)
