"""ZeroEngine: DeepSpeed's engine face (forward, backward, step, checkpoints) over every ZeRO stage.

The engine is composed of parts, each in a module of its own:

* a layout (zero.layout): how the rank's parameters and gradients are partitioned - `FlatLayout` for
  stages 0-2 (one flat buffer, a slice per rank), `UnitLayout` for stage 3 (parameters partitioned per
  module over ranks and tiers by the stage-3 partitioner);
* the optimizer state (zero.optimizer.state): fp32 master + states on their tier (device memory, pinned
  host memory, NVMe), passes over it with the fused kernels, and a parameter writer
  (zero.layout.param_writer) that copies the updated weights into the parameters;
* the overlap (zero.optimizer.overlap): the pass that steps NVMe sub-groups during backward;
* the guard (zero.optimizer.integrity): whether a failure left the state unusable;
* activation checkpointing (zero.checkpointing), configured from the config's section; its counts join the
  step report.

Without an optimizer (no `optimizer` block, no `optimizer=`) the engine is composed of the inference parts
instead (zero.inference.parts): a layout that holds only the weights, and optimizer-state and update parts
that hold nothing; `backward` and `step` raise `NoOptimizerError`.

One step, on one rank: forward and backward run on the model as the user wrote it; gradients reach the
layout's `grad_host` (reduced over ranks on the way); at the end of an accumulation window the optimizer
walks the partition chunk by chunk - the fused kernel unscales (loss scale, world size, clipping in one
`grad_scale`), updates master + states and writes the new model-dtype weights, which the writer moves into
the parameters; stages 1-2 then all-gather the updated partitions.

The parts are built by zero.engine.build; DeepSpeed's accessors and reports are in zero.engine.api, the
checkpoint face in zero.engine.checkpoints. What stays here is the step itself (forward, backward, step, the
accumulation window, the report) and the engine's lifetime, about 550 lines: one piece of state (counters,
the window, the held step) that splitting would spread over modules that all write it.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from offload.config.activation import ActivationCheckpointingConfig
from offload.config.loader import ZeroOffloadConfig
from offload.pinned import PINNED_BUDGET_ENV, PinnedPool, default_pinned_budget, pinned_bytes_in_use
from zero.accelerator import compute_device
from zero.activations import checkpointer as checkpointing
from zero.activations.apply import why_nothing_checkpointed
from zero.deepspeed_api import init_distributed  # noqa: F401 - its old home; zero.initialize uses it
from zero.engine.api import EngineAPI
from zero.engine.build import (
    build_optimizer_state,
    build_scheduler,
    choose_rule,
    enable_overlap,
    refuse_meta_tensors,
    refuse_partitioned,
)
from zero.engine.checkpoints import CheckpointAPI
from zero.engine.placement import format_placement
from zero.engine.state_access import StateAccess
from zero.engine.unused import UnusedParameterCheck
from zero.inference import parts as inference
from zero.layout.base import Layout, Placement, no_device_share, trainable_params
from zero.layout.flat import FlatLayout
from zero.optimizer.client_face import optimizer_class
from zero.optimizer.delayed import DelayedUpdate, check_delayed, make_delayed
from zero.optimizer.integrity import StateGuard
from zero.optimizer.loss_scaler import build_loss_scaler
from zero.optimizer.overlap import OverlapPass
from zero.optimizer.param_groups import build_groups
from zero.optimizer.tiers.build import describe_placement, device_share_numel
from zero.optimizer.tiers.device_part import wants_torch_part
from zero.optimizer.update import UpdatePass
from zero.report import PhaseClock, StepReport

__all__ = ["PINNED_BUDGET_ENV", "ZeroEngine", "consolidated_state_dict", "init_distributed"]

logger = logging.getLogger("zero")


class ZeroEngine(EngineAPI, CheckpointAPI):
    """What `zero.initialize` returns. Method names and semantics follow DeepSpeed's DeepSpeedEngine (its
    configuration accessors, `offload_states`, `empty_partition_cache`, `destroy`: zero.engine.api).

    `device_part`: what steps the device share of a Twin-Flow split (`offload_optimizer.ratio` below 1.0):
    "auto" (torch's fused Adam/AdamW on CUDA, the CPU kernels on a CPU-only machine), "torch"
    (zero.optimizer.tiers.device_part.TorchDevicePart on any device), or "kernels" (CPU compute only)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ZeroOffloadConfig,
        *,
        optimizer: Optional[Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]] = None,
        model_parameters: Optional[Any] = None,
        lr_scheduler: Optional[Any] = None,
        rank: int = 0,
        world_size: int = 1,
        local_rank: Optional[int] = None,
        device_part: str = "auto",
    ) -> None:
        refuse_meta_tensors(model)
        self.config = cfg
        self._device_part = device_part
        self.rank, self.world_size = rank, world_size
        self.device = compute_device(local_rank)
        wants_torch_part(device_part, self.device)  # a bad choice fails before anything is built
        zcfg = cfg.zero_optimization
        self.stage = int(zcfg.stage)
        if self.stage > 3:
            raise ValueError(f"zero_optimization.stage={self.stage}: stages 0, 1, 2 and 3 exist")
        if self.stage < 3 and zcfg.offload_param is not None and zcfg.offload_param.device != "none":
            raise ValueError(
                f"zero_optimization.offload_param.device={zcfg.offload_param.device!r} needs stage 3; "
                "with stages 0-2 only offload_optimizer is supported"
            )
        if self.stage < 3:
            refuse_partitioned(model, self.stage)
        off = zcfg.offload_optimizer
        self.gas = int(cfg.gradient_accumulation_steps)
        self.micro_batch_size = int(cfg.train_micro_batch_size_per_gpu)
        self.train_batch_size_ = int(cfg.train_batch_size)
        self.gradient_clipping = float(cfg.gradient_clipping or 0.0)
        self.fp16 = bool(cfg.fp16.enabled)
        self.bf16 = bool(cfg.bf16.enabled)
        self.dtype = torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32
        # forward casts floating inputs to fp16 (fp16.auto_cast); bf16 steps with inf/nan gradients are
        # skipped (bf16.check_grad_overflow); fp16 steps always are
        self.auto_cast = self.fp16 and bool(cfg.fp16.auto_cast)
        self.check_overflow = self.fp16 or (self.bf16 and bool(cfg.bf16.check_grad_overflow))
        self.steps_per_print = int(cfg.steps_per_print or 0)
        self.report_enabled = bool(cfg.zero_offload.report or cfg.wall_clock_breakdown)
        self.report_every = int(cfg.zero_offload.report_every or 1)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary; None: from micro_steps
        self._window_backwards = 0  # backward calls since the last optimizer step
        self._window_start = 0  # micro_steps when the current accumulation window began
        self._backward_since_step = False  # a backward completed since the last step() call
        self.skipped_steps = 0
        self.last_report: Optional[StepReport] = None
        self.last_param_io: Optional[Dict[str, int]] = None  # stage 3: parameter I/O of the last step
        self.load_report: Optional[Any] = None  # zero.from_pretrained's LoadReport (None: built otherwise)
        self._closed = False
        self._guard = StateGuard()
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
        self._clock = PhaseClock(sync if self.report_enabled else None)

        # -- optimizer rule: from the config's optimizer block or the client optimizer, not both (DeepSpeed);
        # neither: an inference engine (zero.inference.parts), whose optimizer tier is none whatever the
        # config says
        if model_parameters is not None:
            model_parameters = list(model_parameters)  # read twice: the parameters, then their groups
        params = trainable_params(model, model_parameters)
        self.rule, hyper, client = choose_rule(cfg, optimizer, params)
        self._client_class = optimizer_class(client)  # isinstance of the client's class too
        groups = build_groups(params, model_parameters, client) if self.rule is not None else []
        self.offload_device = off.device if off is not None and self.rule is not None else "none"

        # -- the parts: layout, optimizer state on its tier, overlap with backward
        self._checkpointing = None  # activation checkpointing this engine configured from its config
        pool = PinnedPool(default_pinned_budget(cfg.zero_offload.pinned_budget_bytes))
        # On a CPU-only machine the device share's gradients and master never leave host memory, so they
        # need no pinning; on an accelerator they cross the bus, and pinned memory keeps those copies
        # asynchronous (the device share's gradients stay pinned there until they stay on the device).
        share = no_device_share
        if self.rule is not None and self.device.type == "cpu":
            share = partial(
                device_share_numel,
                tier=self.offload_device,
                offload=off,
                sub_group=int(zcfg.sub_group_size),
                state_dtype=self.rule.state_dtype,
            )
        place = Placement(self.device, self.dtype, rank, world_size, self.stage, self.offload_device, share)
        self.overlap = OverlapPass()  # the optimizer pass during backward (enabled below when it can run)
        self._delayed: Optional[DelayedUpdate] = None  # zero_offload.delayed_update (zero.optimizer.delayed)
        try:
            if cfg.activation_checkpointing != ActivationCheckpointingConfig():
                # as if zero.checkpointing.configure had been called with this config (DeepSpeed needs that)
                self._checkpointing = checkpointing.configure(
                    deepspeed_config=cfg.activation_checkpointing,
                    aio=cfg.aio,
                    pool=pool,
                )
            if self.rule is None:
                self._build_inference(model, params, place, pool, lr_scheduler)
            else:
                self._build(model, params, hyper, place, pool, lr_scheduler, groups)
        except BaseException:
            self.close()  # no hooks, pinned buffers or swap directories left behind
            raise
        if self.rank == 0:
            logger.info("%s", format_placement(self.placement()))

    def _build(
        self,
        model: nn.Module,
        params: List[nn.Parameter],
        hyper: Dict[str, Any],
        place: Placement,
        pool: PinnedPool,
        lr_scheduler: Optional[Any],
        groups: List[Dict[str, Any]],
    ) -> None:
        """The parts, in dependency order: layout, optimizer state, overlap, update pass, scheduler.
        `groups`: the optimizer's param groups (zero.optimizer.param_groups.build_groups)."""
        inference.refuse_weight_quantization(self.config)
        zcfg = self.config.zero_optimization
        check_delayed(
            self.config, offload_device=self.offload_device, stage=self.stage, world=self.world_size
        )
        self.layout: Layout
        if self.stage == 3:
            from zero.layout.units import UnitLayout

            self.layout = UnitLayout(
                model, params, place, pool, self.config, on_grad=self.overlap.source_ready
            )
        else:
            self.layout = FlatLayout(model, params, place, pool, zcfg, on_grad=self.overlap.source_ready)
        self.module = self.layout.module
        self.pool: PinnedPool = self.layout.pool  # stage 3 under zero.Init: the Init's pinned budget
        self.optimizer = self._client_class(groups, self.rule, hyper)
        self.optimizer.engine = self
        self._opt = build_optimizer_state(
            self.layout,
            self.rule,
            self.optimizer,
            self.config,
            offload_device=self.offload_device,
            device=self.device,
            dtype=self.dtype,
            pool=self.pool,
            rank=self.rank,
            device_part=self._device_part,
            guard=self._guard,
            on_step_lost=self.zero_grad,
            world_size=self.world_size,
        )
        off = zcfg.offload_optimizer
        if self.rank == 0:
            info = self.optimizer_state_info()
            logger.info("%s", describe_placement(info, self.rule.n_states, off, self.pool.cap_bytes))
        enable_overlap(
            self.overlap,
            self._opt,
            self.layout,
            off,
            offload_device=self.offload_device,
            world_size=self.world_size,
            delayed=self.config.zero_offload.delayed_update.enabled,
        )
        self._update = UpdatePass(
            self.layout,
            self._opt,
            self.overlap,
            self.optimizer,
            device=self.device,
            world_size=self.world_size,
            stage=self.stage,
            clipping=self.gradient_clipping,
            check_overflow=self.check_overflow,
            loss_scale=lambda: self.loss_scale,
        )
        self._delayed = make_delayed(self.config, self._update, self._opt, self.layout)
        self._unused = None if zcfg.ignore_unused_parameters else UnusedParameterCheck(self.module, params)
        if self.layout.partitioner is not None:
            self.layout.take_param_io()  # building and initialising are not part of the first step's report
        self.lr_scheduler = build_scheduler(lr_scheduler, self.config, self.optimizer)
        self.loss_scaler = build_loss_scaler(self.config.fp16)
        self._state_access = StateAccess(self)  # zero.utils' safe_get_* / safe_set_* find it per parameter

    def _build_inference(
        self, model: nn.Module, params: List[nn.Parameter], place: Placement, pool: PinnedPool, sched: Any
    ) -> None:
        """No optimizer: a layout holding only the weights; no optimizer state, update pass or scheduler."""
        inference.check_inference_config(self.config, sched)
        self.layout = inference.inference_layout(model, params, place, pool, self.config)  # type: ignore[assignment]
        self.module, self.pool = self.layout.module, self.layout.pool
        self.optimizer, self.lr_scheduler, self.loss_scaler = None, None, None  # type: ignore[assignment]
        self._opt, self._update = inference.NoOptimizerState(), inference.NoUpdatePass()  # type: ignore[assignment]
        self._unused = None

    # ------------------------------------------------------------------------------------ DeepSpeed face
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A forward between backward and step() sees the committed weights: the pass that began stepping
        # during backward is dropped (step() then runs the optimizer after all).
        """The wrapped module's forward (fp16 inputs cast when `fp16.auto_cast`), timed for the report."""
        self._update.drop_overlapped()
        if self.auto_cast:
            args, kwargs = _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)
        with self._clock.phase("forward_s"):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> ZeroEngine:
        """Put the module in training mode; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        """Put the module in evaluation mode; returns the engine."""
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The wrapped module's parameters."""
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        """The wrapped module's named parameters."""
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The wrapped module's state dict (stage 3: partitioned; see consolidated_state_dict)."""
        return self.module.state_dict(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() updates the weights: every gradient_accumulation_steps micro-batches,
        unless `set_gradient_accumulation_boundary` said otherwise."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: from now on the boundary is `is_boundary`, not counted from micro-batches (set it
        before each backward; True on the last micro-batch of a window, then call step() once)."""
        self._boundary = bool(is_boundary)

    def gradient_accumulation_steps(self) -> int:
        """DeepSpeed's: micro-steps per optimizer step."""
        return self.gas

    def train_micro_batch_size_per_gpu(self) -> int:
        """DeepSpeed's: samples per micro-step on one rank."""
        return self.micro_batch_size

    def train_batch_size(self) -> int:
        """DeepSpeed's: samples per optimizer step over all ranks."""
        return self.train_batch_size_

    def get_lr(self) -> List[float]:
        """DeepSpeed's: the learning rate of each param group."""
        if self.optimizer is None:
            return []  # DeepSpeed's answer without an optimizer
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale; 1.0 without fp16."""
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    def zero_grad(self) -> None:
        """Drop the accumulated gradients of the current window."""
        self._update.drop_overlapped()  # it read gradients that are being cleared
        if self.layout.grad_host is not None:
            self.layout.zero_grads()

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of `loss / gradient_accumulation_steps` (times the loss scale in fp16). DeepSpeed's
        `scale_wrt_gas=False`: `loss` as given, for callers that already divided it over the accumulation
        window (transformers' Trainer, accelerate)."""
        self._require_optimizer("engine.backward()")
        self.check_open()
        self.check_state_usable()
        boundary = self.is_gradient_accumulation_boundary()
        reducer = self.layout.reducer
        # stage 2's buckets reduce every backward; the stage 0-1 reducer at the end of the window only
        reducing = reducer is not None and (boundary or getattr(reducer, "every_backward", False))
        if reducing:
            reducer.begin()
        if boundary:
            # NVMe: the first sub-groups' states do not depend on the gradients; read them during backward.
            self._update.drop_overlapped()  # a second boundary backward without step(): start over
            if self._delayed is None:  # (a delayed pass walks the tier now)
                self._opt.tier.prefetch()
        early = boundary and self.overlap.enabled and not retain_graph
        if early:
            self._update.start_overlapped()
        if self._unused is not None:
            self._unused.begin_backward(first=self._window_backwards == 0)
        self._window_backwards += 1
        scale = self.loss_scale / self.gas if scale_wrt_gas else self.loss_scale
        try:
            with self._clock.phase("backward_s"):
                scaled = loss.float() * scale if scale != 1.0 else loss
                scaled.backward(retain_graph=retain_graph)
            if reducing:
                with self._clock.phase("comm_s"):
                    reducer.finish()  # before the overlapped pass may read what no hook reported
        except BaseException:
            if early:
                self._update.drop_overlapped()
            self._drop_window()  # its gradients are partial: none is left for a later step
            raise
        if early:
            self.overlap.backward_done()
        if self._unused is not None and boundary:
            self._unused.check()
        self._clock.current.micro_batches += 1
        self._backward_since_step = True
        return loss

    def _drop_window(self) -> None:
        """A backward or step failed: forget the accumulation window - every gradient in it (a failed
        backward's partial ones too) and its micro-batch count - so that redoing the window's micro-batches
        (forward, backward, step) continues exactly as a run without the failure."""
        self.micro_steps = self._window_start
        self._window_backwards = 0
        self._backward_since_step = False
        if self.layout.grad_host is None:
            return
        for p in self.module.parameters():  # a failed backward's gradients no hook moved yet
            p.grad = None
        self.zero_grad()  # stages 0-1 point the .grads at the zeroed flat buffer again

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Count the micro-batch; at the end of an accumulation window, update the weights."""
        self._require_optimizer("engine.step()")
        self.check_open()
        self.check_state_usable()
        if not self._backward_since_step:
            logger.warning(
                "engine.step() without an engine.backward() since the last step(): skipped (weights, "
                "optimizer state, learning-rate schedule and step counters unchanged)"
            )
            return
        self._backward_since_step = False
        if self.is_gradient_accumulation_boundary():
            try:
                self._take_model_step(lr_kwargs)
            except OSError:
                # The previous state is kept: the window's gradients go, so that redoing its micro-batches
                # (forward, backward, step) is the one retry, whatever failed.
                self._drop_window()
                raise
            self.global_steps += 1
            self.global_samples += self.train_batch_size_
            report = self._finish_report()
            if self.report_enabled and self.rank == 0 and self.global_steps % self.report_every == 0:
                print(f"[zero] {report.format()}", flush=True)
            if self.steps_per_print and self.rank == 0 and self.global_steps % self.steps_per_print == 0:
                logger.info(
                    "step=%d, skipped=%d, lr=%s, loss_scale=%g",
                    self.global_steps,
                    self.skipped_steps,
                    self.get_lr(),
                    self.loss_scale,
                )
            self._window_start = self.micro_steps + 1
        self.micro_steps += 1

    # -------------------------------------------------------------------------------------- the update
    def _take_model_step(self, lr_kwargs: Optional[Dict[str, Any]]) -> None:
        rep = self._clock.current
        reducer = self.layout.reducer
        if reducer is not None:
            rep.comm_bytes += reducer.bytes_sent
            reducer.bytes_sent = 0
        with self._clock.phase("optimizer_s"):
            overflow = (self._delayed or self._update).run(rep)
        if not overflow and self.layout.gathers_after_step:
            with self._clock.phase("comm_s"):
                self.layout.after_step()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
        self.optimizer.overflow = overflow  # DeepSpeed's optimizer.overflow: this step was skipped
        self._window_backwards = 0
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.optimizer._opt_called = True  # torch's schedulers check that the optimizer stepped first
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.zero_grad()
        rep.skipped = overflow
        rep.loss_scale = self.loss_scale

    def _finish_report(self) -> StepReport:
        rep = self._clock.finish()
        rep.step = self.global_steps
        rep.pinned_bytes_in_use = pinned_bytes_in_use()
        rep.nvme_bytes_in_use = self.optimizer_nvme_bytes
        rep.predicted_s = self.config.zero_offload.predicted_seconds
        io = self.layout.take_param_io()
        if io is not None:
            rep.device_to_host_bytes += io.pop("device_to_host_bytes", 0)  # gradients summed per parameter
            self.last_param_io = io
        activations = checkpointing.take_report()
        if activations.checkpoints:
            rep.activations = activations.as_dict()
        elif self._checkpointing is not None and self.global_steps == 1:
            logger.warning(
                "activation_checkpointing is configured but the first step checkpointed no block: %s",
                why_nothing_checkpointed(self.module),
            )
        self.last_report = rep
        return rep

    # --------------------------------------------------------------------------------------- lifetime
    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise inference.no_optimizer_error(what)

    @property
    def delayed_update(self) -> Optional[DelayedUpdate]:
        """The delayed host update (`zero_offload.delayed_update`), or None when it is off."""
        return self._delayed

    def settle_update(self) -> None:
        """With `zero_offload.delayed_update`: apply the optimizer update still pending (wait for its host
        pass, commit it, put its weights into the parameters), e.g. before evaluating the model. Without
        one pending (or the delayed update off), nothing happens. Checkpoints and `close()` call it."""
        if self._delayed is not None and not self._closed:
            self._delayed.settle(self._clock.current)

    def _require_checkpointable(self, what: str) -> None:
        """NotImplementedError for a client optimizer stepped by its own class (zero.optimizer.torch_step)."""
        if self.rule is not None and not self.rule.checkpointable:
            raise NotImplementedError(
                f"{what}: the client optimizer ({self.rule.kind}) is stepped by its own class, whose state "
                "(momentum buffers, ...) a checkpoint would not hold; save the weights with "
                "save_16bit_model, or use Adam, AdamW, Adagrad or Lion"
            )

    def check_open(self) -> None:
        """Raise RuntimeError if the engine was closed."""
        if self._closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Free pinned buffers and remove the swap files. Stages 0-2: the model stays usable (its weights are
        kept). Stage 3: the parameters stay partitioned (empty): take `consolidated_state_dict()` first.
        Also frees what a failed construction had built (parts not built yet are skipped)."""
        if self._closed:
            return
        pending_error: Optional[BaseException] = None
        try:
            self.settle_update()  # the delayed update still pending is part of the trained weights
        except BaseException as e:  # noqa: BLE001 - raised once the parts are freed
            pending_error = e
        self._closed = True
        overlap, unused = getattr(self, "overlap", None), getattr(self, "_unused", None)
        opt, layout = getattr(self, "_opt", None), getattr(self, "layout", None)
        if getattr(self, "_state_access", None) is not None:
            self._state_access.detach()
        if getattr(self, "_checkpointing", None) is not None:
            checkpointing.close(self._checkpointing)  # its scratch files and pinned buffers
        if overlap is not None:
            overlap.cancel()  # nothing may touch the slots once they are freed
        if unused is not None:
            unused.close()
        try:
            if opt is not None:
                opt.close()
        finally:
            self._opt = None  # type: ignore[assignment]
            if layout is not None:
                layout.close()
        if pending_error is not None:
            raise pending_error

    def __enter__(self) -> ZeroEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"ZeroEngine({self.layout.describe()}, offload_optimizer={self.offload_device}, "
            f"dtype={self.dtype}, rank={self.rank}/{self.world_size}, device={self.device})"
        )


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it (tuples, lists, dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def consolidated_state_dict(engine: ZeroEngine, fp32: bool = False) -> Dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU, whatever the stage (collective at stage 3: every rank
    calls it). `fp32=True`: trainable parameters from the fp32 master instead of the model-dtype weights."""
    return engine.consolidated_state_dict(fp32)
