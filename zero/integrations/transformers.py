"""Hugging Face transformers' `Trainer` through zero-offload: `ZeroTrainer` is a `transformers.Trainer`
that trains through a `ZeroEngine` (docs/integrations.md, "Hugging Face Trainer").

The one-line change: `Trainer(model=..., args=..., ...)` becomes `ZeroTrainer(..., zero_config=cfg)`, where
`cfg` is a DeepSpeed config (dict or JSON path). Its "auto" values are filled from the `TrainingArguments`
and the model as transformers fills them for DeepSpeed (`fill_zero_config`); a value that contradicts the
arguments is an error naming both. The engine is built when `train()` starts:

* optimizer: the config's `optimizer` block, else the Trainer's own (`create_optimizer`: AdamW from the
  arguments, biases and norms in a group without weight decay) as the client optimizer - the engine takes
  its type and each param group's hyperparameters;
* scheduler: the config's `scheduler` block, else the Trainer's (`create_scheduler`, `lr_scheduler_type`),
  built over the engine's optimizer and stepped by the engine after each optimizer step it takes;
* each micro-batch: forward through the engine, the loss divided over the accumulation window by the
  Trainer as it does without DeepSpeed, `engine.backward(loss, scale_wrt_gas=False)` (no second division),
  and on the window's last micro-batch `engine.step()` (the boundary set as accelerate sets it); the
  Trainer's `optimizer.step()` / `lr_scheduler.step()` are then no-ops, `grad_norm` is
  `engine.get_global_grad_norm()`;
* checkpoints: each `checkpoint-N` folder holds the engine's checkpoint under the tag `global_stepN` (as
  DeepSpeed's), beside the Trainer's own files; `train(resume_from_checkpoint=...)` loads it;
* `save_model`: the consolidated 16-bit weights as a Hugging Face checkpoint (`save_pretrained`).

This module imports transformers only when `ZeroTrainer` (or `from_pretrained`) is first used.
"""

from __future__ import annotations

import copy
import glob
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from zero.engine.auto_values import HIDDEN_SIZE_KEYS as _HIDDEN_SIZE_KEYS
from zero.engine.auto_values import hidden_size_of

if TYPE_CHECKING:
    from zero.engine.engine import ZeroEngine

    ZeroTrainer: Any  # a transformers.Trainer subclass, built on first access (module __getattr__)

__all__ = ["ZeroTrainer", "fill_zero_config", "from_pretrained", "hidden_size_of"]

logger = logging.getLogger("zero")

ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]


# ------------------------------------------------------------------------------------------ the config
def _read(zero_config: ConfigLike) -> Dict[str, Any]:
    """A private deep copy of the config (dict, or the JSON file at a path)."""
    if isinstance(zero_config, (str, os.PathLike)):
        from offload.config._reader import read_json_file

        raw = read_json_file(os.fspath(zero_config))
    else:
        raw = zero_config
    if not isinstance(raw, Mapping):
        raise TypeError(f"zero_config must be a dict or the path of a JSON file, got {type(raw).__name__}")
    return copy.deepcopy(dict(raw))


class _Filler:
    """Fills "auto" values of one config dict and collects the set values that contradict the arguments."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.cfg = cfg
        self.mismatches: List[str] = []

    def node(self, dotted: str, create: bool) -> Tuple[Optional[Dict[str, Any]], str]:
        *parents, key = dotted.split(".")
        node = self.cfg
        for name in parents:
            child = node.get(name)
            if child is None and create:
                child = node[name] = {}
            if not isinstance(child, dict):
                return None, key
            node = child
        return node, key

    def fill(self, dotted: str, value: Any, arg: Optional[str] = None, absent: bool = False) -> None:
        """ "auto" -> `value`; left out -> `value` when `absent`; set -> checked against `value` when `arg`
        names the argument it must match."""
        node, key = self.node(dotted, create=absent)
        if node is None:
            return
        if key not in node:
            if absent:
                node[key] = value
            return
        current = node[key]
        if isinstance(current, str) and current == "auto":
            node[key] = value
        elif arg is not None and _plain(current) != _plain(value):
            self.mismatches.append(
                f"- {dotted}={current!r} in zero_config vs {arg}={value!r} in TrainingArguments"
            )

    def is_auto(self, dotted: str) -> bool:
        node, key = self.node(dotted, create=False)
        return node is not None and isinstance(node.get(key), str) and node[key] == "auto"


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def fill_zero_config(
    zero_config: ConfigLike, args: Any, model: Any = None, num_training_steps: Optional[int] = None
) -> Dict[str, Any]:
    """The DeepSpeed config `zero_config` with its "auto" values filled from the TrainingArguments `args`
    (and `model`, a model or its config, for the hidden size), as transformers fills them for DeepSpeed:

    - `train_micro_batch_size_per_gpu` <- per_device_train_batch_size, `gradient_accumulation_steps`,
      `train_batch_size` <- world_size x both, `gradient_clipping` <- max_grad_norm (each also when left
      out: the Trainer's loop runs with the arguments' values);
    - `optimizer.params`: `lr` <- learning_rate, `betas` <- [adam_beta1, adam_beta2], `eps` <- adam_epsilon,
      `weight_decay`;
    - `scheduler.params`: `warmup_min_lr` <- 0, `warmup_max_lr` <- learning_rate, `total_num_steps` <-
      `num_training_steps` (default: max_steps when positive), `warmup_num_steps` <- the arguments' warmup
      steps over it (at least 1);
    - `fp16.enabled` / `bf16.enabled` <- fp16 / bf16 (or their *_full_eval), a section added when on;
    - `zero_optimization.reduce_bucket_size` <- h^2, `stage3_prefetch_bucket_size` <- 0.9 h^2,
      `stage3_param_persistence_threshold` <- 10 h, h = `hidden_size_of(model)`.

    A value given that differs from the arguments' raises one ValueError listing every such pair. Returns a
    new dict; `zero_config` is not changed."""
    cfg = _read(zero_config)
    f = _Filler(cfg)
    micro, gas = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    f.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", absent=True)
    f.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps", absent=True)
    total = int(args.world_size) * micro * gas
    f.fill(
        "train_batch_size", total, "world_size x per_device_train_batch_size x gradient_accumulation_steps"
    )
    f.fill("gradient_clipping", float(args.max_grad_norm), "max_grad_norm", absent=True)
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fp16 = bool(args.fp16 or getattr(args, "fp16_full_eval", False))
    bf16 = bool(args.bf16 or getattr(args, "bf16_full_eval", False))
    f.fill("fp16.enabled", fp16, "fp16", absent=fp16)
    f.fill(("bfloat16" if "bfloat16" in cfg else "bf16") + ".enabled", bf16, "bf16", absent=bf16)

    if num_training_steps is None and int(args.max_steps) > 0:
        num_training_steps = int(args.max_steps)
    if num_training_steps is not None:
        f.fill("scheduler.params.total_num_steps", int(num_training_steps), "num_training_steps")
        warmup = max(1, int(args.get_warmup_steps(num_training_steps)))
        f.fill("scheduler.params.warmup_num_steps", warmup, "warmup_steps")
    if f.mismatches:
        raise ValueError(
            "zero_config values contradict the TrainingArguments:\n"
            + "\n".join(f.mismatches)
            + "\nSet them to 'auto' (or leave them out) to take the arguments' values."
        )
    auto = [key for key, _ in _HIDDEN_SIZE_KEYS if f.is_auto(key)]
    if auto:
        hidden = hidden_size_of(model) if model is not None else None
        if hidden is None:
            raise ValueError(
                f"{', '.join(auto)} in zero_config: 'auto' needs the model's hidden size (config.hidden_size,"
                f" n_embd or d_model) and {'no model was given' if model is None else 'the model has none'}; "
                "give integers instead"
            )
        for key, size in _HIDDEN_SIZE_KEYS:
            f.fill(key, size(hidden))
    return cfg


def from_pretrained(
    path: Union[str, os.PathLike], zero_config: ConfigLike, args: Any, **hf_kwargs: Any
) -> nn.Module:
    """The causal LM of the local Hugging Face checkpoint `path`, its weights streamed straight into stage-3
    partitions (`zero.inference.pretrained.partitioned_model`: never whole in memory), for a `ZeroTrainer`
    given the same `zero_config` and `args`, whose engine takes the partitions over. The config must be stage
    3; its "auto" values are filled from `args` and the checkpoint's config.json. `hf_kwargs` as for
    `zero.from_pretrained`."""
    import transformers

    from zero.inference.pretrained import partitioned_model

    trust = {k: hf_kwargs[k] for k in ("trust_remote_code",) if k in hf_kwargs}
    cfg = fill_zero_config(zero_config, args, transformers.AutoConfig.from_pretrained(path, **trust))
    cfg.pop("optimizer", None)  # the partitions need only the stage-3 and precision keys
    cfg.pop("scheduler", None)
    fp16, bf16 = (bool((cfg.get(k) or {}).get("enabled")) for k in ("fp16", "bf16"))
    dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32  # the engine's dtype
    return partitioned_model(path, cfg, dtype=dtype, **hf_kwargs)


# ---------------------------------------------------------------------------------- the Trainer's view
class _EngineOptimizer:
    """`trainer.optimizer`: the engine's optimizer as the Trainer's loop sees it. The engine steps in
    `training_step`, so `step()` and `zero_grad()` do nothing; everything else (param_groups, state_dict)
    is the engine optimizer's. Not a torch Optimizer, so accelerate passes it through unwrapped."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)


class _EngineScheduler:
    """`trainer.lr_scheduler`: the engine steps the real scheduler (after each step it does not skip), so
    `step()` does nothing; `get_last_lr()` is the lr the last optimizer step used (what the Trainer logs
    without DeepSpeed), the current lr before the first step; the rest is the real scheduler's."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self.scheduler = engine.lr_scheduler
        self.used_lr: Optional[List[float]] = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> List[float]:
        return list(self.used_lr) if self.used_lr is not None else self.engine.get_lr()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def _is_partitioned(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_unit") for p in model.parameters())


def _engine_tags(checkpoint: str) -> List[str]:
    return sorted(os.path.basename(d) for d in glob.glob(os.path.join(checkpoint, "global_step*")))


def _trainer_class() -> type:
    """ZeroTrainer, defined on first use (it subclasses transformers.Trainer)."""
    import transformers

    from zero.initialization import initialize

    class ZeroTrainer(transformers.Trainer):  # type: ignore[misc]
        """`transformers.Trainer` through a zero-offload engine: the same arguments plus `zero_config` (a
        DeepSpeed config, dict or JSON path; "auto" values filled by `fill_zero_config`). The engine is
        built when `train()` starts and is `trainer.engine` afterwards; `engine.close()` frees its pinned
        memory and swap files (garbage collection and exit do too). See docs/integrations.md."""

        def __init__(self, *args: Any, zero_config: ConfigLike, **kwargs: Any) -> None:
            self._zero_raw = _read(zero_config)
            z = self._zero_raw.get("zero_optimization")
            self._zero_stage = int(z.get("stage", 0)) if isinstance(z, dict) else 0
            self._zero_engine: Optional[ZeroEngine] = None
            self._zero_config: Optional[Dict[str, Any]] = None
            self._zero_steps: Optional[int] = None
            super().__init__(*args, **kwargs)
            self._zero_check_arguments()

        def _zero_check_arguments(self) -> None:
            a = self.args
            refused = []
            if getattr(a, "deepspeed", None) or self.is_deepspeed_enabled:
                refused.append("DeepSpeed (args.deepspeed): zero_config takes its place")
            if self.is_fsdp_enabled:
                refused.append("FSDP")
            if a.auto_find_batch_size:
                refused.append("auto_find_batch_size")
            if a.n_gpu > 1:
                refused.append(f"{a.n_gpu} GPUs in one process (DataParallel): launch one process per GPU")
            if self.lr_scheduler is not None:
                refused.append("optimizers=(..., lr_scheduler): give a scheduler block or lr_scheduler_type")
            if str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type)) == "reduce_lr_on_plateau":
                refused.append("lr_scheduler_type 'reduce_lr_on_plateau' (the engine steps without metrics)")
            if refused:
                raise ValueError("ZeroTrainer does not support " + "; ".join(refused))

        @property
        def engine(self) -> Optional[ZeroEngine]:
            """The ZeroEngine training the model (None before `train()`)."""
            return self._zero_engine

        @property
        def zero_config(self) -> Optional[Dict[str, Any]]:
            """The config the engine was built with, "auto" values filled (None before `train()`)."""
            return self._zero_config

        # --------------------------------------------------------------------------------- building
        def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
            if self._zero_stage == 3 or _is_partitioned(model):
                return  # the engine partitions it from where it is
            super()._move_model_to_device(model, device)

        def _prepare_for_training(self, max_steps: int, *args: Any, **kwargs: Any) -> Any:
            if self._zero_engine is not None:
                raise RuntimeError(
                    "train() already ran on this ZeroTrainer and its engine holds the model; make a new "
                    "ZeroTrainer (train(resume_from_checkpoint=...) continues from a checkpoint)"
                )
            self._zero_steps = int(max_steps)
            return super()._prepare_for_training(max_steps, *args, **kwargs)

        def create_optimizer(self, model: Optional[nn.Module] = None) -> Any:
            """Build the engine (once) and return its optimizer as the Trainer's loop drives it."""
            if self._zero_engine is None:
                self._zero_build()
            return self.optimizer

        def _zero_build(self) -> None:
            steps = self._zero_steps
            cfg = fill_zero_config(self._zero_raw, self.args, self.model, steps)
            client = None
            if "optimizer" not in cfg:  # the Trainer's optimizer, as transformers hands it to DeepSpeed
                client = self.optimizer if self.optimizer is not None else super().create_optimizer()
            scheduler = None
            if "scheduler" not in cfg:

                def scheduler(optimizer: torch.optim.Optimizer) -> Any:
                    self.lr_scheduler = None
                    return self.create_scheduler(num_training_steps=steps, optimizer=optimizer)

            engine, *_ = initialize(model=self.model, optimizer=client, lr_scheduler=scheduler, config=cfg)
            self._zero_engine, self._zero_config = engine, cfg
            self.optimizer = _EngineOptimizer(engine)
            self.lr_scheduler = _EngineScheduler(engine)
            self._created_lr_scheduler = False

        def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
            if self._zero_engine is not None:
                return self._zero_engine  # forward (training and evaluation) runs through the engine
            if _is_partitioned(self.model):
                raise RuntimeError(
                    "the model's weights are in stage-3 partitions and its engine is built by train(): "
                    "evaluate or predict after train() has started"
                )
            return super()._wrap_model(model, training, dataloader)

        # --------------------------------------------------------------------------------- training
        def training_step(
            self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch: Any = None
        ) -> torch.Tensor:
            """One micro-batch through the engine; on the accumulation window's last one, its step."""
            engine = self._zero_engine
            if engine is None or model is not engine:
                return super().training_step(model, inputs, num_items_in_batch)
            engine.train()
            inputs = self._prepare_inputs(inputs)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
            del inputs
            # The Trainer's rule: the loss is divided over the window unless it was normalized by the
            # window's item count (model loss kwargs, compute_loss_func) or says it is already scaled.
            scaled = getattr(self, "loss_is_scaled_for_ga", None)
            if scaled is None:
                scaled = (
                    self.model_accepts_loss_kwargs and num_items_in_batch is not None
                ) or self.compute_loss_func is not None
            if not scaled:
                loss = loss / self.current_gradient_accumulation_steps
            boundary = bool(self.accelerator.gradient_state.sync_gradients)  # set by the Trainer's loop
            engine.set_gradient_accumulation_boundary(boundary)
            engine.backward(loss, scale_wrt_gas=False)
            if boundary:
                self.lr_scheduler.used_lr = engine.get_lr()
                engine.step()
            return loss.detach()

        def _clip_grad_norm(self, model: nn.Module) -> Any:
            if self._zero_engine is None:
                return super()._clip_grad_norm(model)
            return self._zero_engine.get_global_grad_norm()  # clipped by the engine's step

        def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
            if self._zero_engine is None:
                return super()._get_grad_norm(model, grad_norm)
            return self._zero_engine.get_global_grad_norm()

        # ------------------------------------------------------------------------------ checkpoints
        def _zero_tag(self) -> str:
            return f"global_step{self.state.global_step}"

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            if self._zero_engine is None:
                return super()._save_optimizer_and_scheduler(output_dir)
            self._zero_engine.save_checkpoint(output_dir, tag=self._zero_tag())  # all of the training state

        def _load_from_checkpoint(
            self, resume_from_checkpoint: str, model: Optional[nn.Module] = None
        ) -> None:
            # train() calls this before the engine exists: the engine loads the checkpoint once built
            if not _engine_tags(resume_from_checkpoint):
                raise ValueError(
                    f"{resume_from_checkpoint}: no engine checkpoint (global_step* folder) to resume from; "
                    "ZeroTrainer resumes from the checkpoint-N folders it saved (not with save_only_model)"
                )

        def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
            if self._zero_engine is None or checkpoint is None:
                return super()._load_optimizer_and_scheduler(checkpoint)
            path, _ = self._zero_engine.load_checkpoint(checkpoint)  # weights, optimizer, scheduler, RNG
            if path is None:
                raise ValueError(f"{checkpoint}: no engine checkpoint to resume from ('latest' is missing)")

        def _load_best_model(self) -> None:
            if self._zero_engine is None:
                return super()._load_best_model()
            best = self.state.best_model_checkpoint
            self._zero_engine.load_checkpoint(best, load_module_only=True)

        def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
            """The trained weights as a Hugging Face checkpoint in `output_dir` (config.json, safetensors),
            consolidated in the engine's 16-bit (or fp32) dtype; at stage 3 gathered one module at a time
            when `stage3_gather_16bit_weights_on_model_save` is true, else config.json and the engine's
            checkpoint (fp32 weights: the zero-to-fp32 command), as DeepSpeed does."""
            engine = self._zero_engine
            if engine is None:
                return super().save_model(output_dir, _internal_call)
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            if engine.stage < 3:
                self._save(output_dir, state_dict=engine.consolidated_state_dict())
            elif engine.zero_gather_16bit_weights_on_model_save():
                state_dict = engine._zero3_consolidated_16bit_state_dict()  # rank 0; None on the others
                self._save(output_dir, state_dict=state_dict if state_dict is not None else {})
            else:
                logger.warning(
                    "stage3_gather_16bit_weights_on_model_save is false: %s gets config.json and the "
                    "engine's checkpoint, no weights file (zero-to-fp32 %s <out> extracts them)",
                    output_dir,
                    output_dir,
                )
                if self.args.should_save:
                    os.makedirs(output_dir, exist_ok=True)
                    self.model.config.save_pretrained(output_dir)
                if not _internal_call or self.args.save_only_model:  # else the checkpoint follows
                    engine.save_checkpoint(output_dir, tag=self._zero_tag())
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save")

    ZeroTrainer.__module__, ZeroTrainer.__qualname__ = __name__, "ZeroTrainer"
    return ZeroTrainer


def __getattr__(name: str) -> Any:
    # ZeroTrainer subclasses transformers.Trainer: built on first access, so importing this module does not
    # import transformers.
    if name == "ZeroTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
