"""`Init`: build a model already partitioned; `GatheredParameters`: read or modify whole parameters.

Init wraps the `__init__` of every nn.Module subclass (those that exist on entry and those defined inside
the block) while it is active. When the outermost `__init__` of an object returns, the parameters of the
module and of its submodules that are not partitioned yet become units of the Init's partitioner: their
values go to their tier and `param.data` is emptied. A submodule's parameters are partitioned as soon as
its own `__init__` returns, so at any moment only the layer being built exists in full. `nn.Module.apply`
is wrapped too (DeepSpeed's override_module_apply): it gathers each module's own parameters around `fn`,
so weight-initialisation code written for plain torch still works, one module at a time. So is
`nn.Module.smart_apply`, the `apply` that Hugging Face transformers (5.x) initialises weights with.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from offload.config.loader import ConfigInput
from zero.deepspeed_api import start_process_group
from zero.stage3.comm import dist_info
from zero.stage3.config import load_stage3_config
from zero.stage3.gathered import GatheredParameters
from zero.stage3.partitioner import Stage3Partitioner
from zero.stage3.unit import is_partitioned

__all__ = ["GatheredParameters", "Init"]

logger = logging.getLogger("zero")

_state = threading.local()


def _active() -> Optional[Init]:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def _all_subclasses(cls: type) -> List[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


class Init:
    """Context manager: modules constructed inside have their parameters partitioned (and offloaded).

    DeepSpeed's `deepspeed.zero.Init`, same arguments in the same order. `config_dict_or_path` (or its
    older name `config`, which wins when both are given): the DeepSpeed config, a dict, a JSON path or a
    loaded config; zero_optimization.offload_param decides the tier, `fp16`/`bf16` the dtype.
    `module`: partition an already built module at once. `data_parallel_group` (or
    `sequence_data_parallel_group`): the ranks to partition over (default: all). `remote_device` /
    `pin_memory`: override offload_param's device and pin_memory (None: the config's). `dtype`: cast
    floating-point parameters to it first (default: the config's 16-bit dtype, else as built).
    `enabled=False`: the block does nothing. Enabled, it makes sure a process group exists, as DeepSpeed's
    (zero.deepspeed_api.start_process_group: the launchers', else one of this process alone). `mpu` (model
    parallelism): only its data-parallel world size is used, to check the config's batch sizes.
    `mem_efficient_linear` is accepted and has no effect (layers stay plain torch modules; their gathered
    weights are freed after use). Quantized weights, hpZ secondary
    partitions (`zero_param_parallel_group`) and an external `param_swapper` are refused.

    Not DeepSpeed's, keyword only: `partitioner`, an existing Stage3Partitioner to add to (default: a new
    one, available as `.partitioner`, which `Stage3Partitioner.attach(model)` / the engine take over
    afterwards); `device`, the compute device (default: the accelerator's).

    Several models in one block (`actor = Model()`, then `ref = Model()`: RLHF's actor and reference, a
    teacher and a student): each model (a module with submodules) built by a statement of its own gets a
    partitioner of its own (same config and pinned pool, its own store and swap space), so each can be
    wrapped by an engine of its own; lone layers built one by one share one.
    `.partitioner` is the last model's, `.partitioners` all of them in order. A module built from modules
    of the block (`Head(backbone)`) joins their partitioner; one composed afterwards (`nn.Sequential(a, b)`)
    has its parts moved into one partitioner when an engine (or `attach`) takes it (zero.stage3.adopt).
    With `partitioner=` given, everything goes into that one.
    """

    _lock = threading.Lock()
    _patch_depth = 0
    _originals: Dict[type, Callable] = {}
    _orig_init_subclass: Any = None
    _orig_apply: Any = None
    _orig_smart_apply: Any = None

    def __init__(
        self,
        module: Optional[nn.Module] = None,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        mem_efficient_linear: bool = True,
        remote_device: Optional[str] = None,
        pin_memory: Optional[bool] = None,
        config_dict_or_path: ConfigInput = None,
        config: ConfigInput = None,
        enabled: bool = True,
        dtype: Optional[torch.dtype] = None,
        mpu: Any = None,
        zero_param_parallel_group: Optional[dist.ProcessGroup] = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Optional[dist.ProcessGroup] = None,
        param_swapper: Any = None,
        *,
        partitioner: Optional[Stage3Partitioner] = None,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        _refuse_unsupported(
            zero_param_parallel_group,
            zero_quantized_weights,
            zero_quantized_nontrainable_weights,
            param_swapper,
        )
        if sequence_data_parallel_group is not None:
            if data_parallel_group is not None:
                raise ValueError(
                    "zero.Init: give data_parallel_group or sequence_data_parallel_group, not both"
                )
            data_parallel_group = sequence_data_parallel_group
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"zero.Init(dtype={dtype}): use torch.float16, torch.bfloat16 or torch.float32")
        if config is not None and config_dict_or_path is not None:
            logger.warning("zero.Init: both config and config_dict_or_path were given; using config")
        self.enabled = enabled
        self.dtype = dtype  # cast floating-point parameters to it before partitioning (fp16/bf16 training)
        self.partitioner = partitioner
        # A partitioner per model built by a statement of its own, when the Init makes them (none given).
        self._splits = partitioner is None
        self._new_needed = False  # the model being built needs a partitioner of its own (made on first use)
        self._holds_model = False  # the current partitioner holds a model built by a statement of its own
        self._group = data_parallel_group
        if enabled:
            start_process_group()  # as DeepSpeed: the launchers' group, else one of this process alone
        if enabled and partitioner is None:
            cfg = config if config is not None else config_dict_or_path
            # the batch sizes of a training config are checked against the data-parallel world size
            world = (
                mpu.get_data_parallel_world_size() if mpu is not None else dist_info(data_parallel_group)[1]
            )
            cfg = load_stage3_config(cfg, world)
            if remote_device is not None or pin_memory is not None:
                cfg = _override_offload(cfg, remote_device, pin_memory)
            self.partitioner = Stage3Partitioner(cfg, device=device, group=data_parallel_group)
            self.partitioner.family = self
        self.partitioners: List[Stage3Partitioner] = (
            [self.partitioner] if self.partitioner is not None else []
        )
        if enabled and dtype is None and self.partitioner is not None:
            # As DeepSpeed: the config's fp16 / bf16 section decides the dtype the engine will train in.
            loaded = self.partitioner.config
            if loaded.fp16.enabled:
                self.dtype = torch.float16
            elif loaded.bf16.enabled:
                self.dtype = torch.bfloat16
        self._depth: Dict[int, int] = {}
        self._seq = 0
        if enabled and module is not None:
            self._partition_tree(module)

    # ------------------------------------------------------------------------------------------- patching
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not hasattr(_state, "stack"):
            _state.stack = []
        _state.stack.append(self)
        with Init._lock:
            if Init._patch_depth == 0:
                _patch()
            Init._patch_depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        _state.stack.pop()
        with Init._lock:
            Init._patch_depth -= 1
            if Init._patch_depth == 0:
                _unpatch()

    def _model_starts(self, args: Any, kwargs: Dict[str, Any]) -> None:
        """A module starts being built while none of this Init's is: a new model. It gets a partitioner of
        its own (made when its first parameter is partitioned) unless the current one holds nothing yet, or
        it is built from modules this Init partitioned (`Head(backbone)`: the backbone's partitioner)."""
        if not self._splits or self.partitioner is None:
            return
        given = [a for a in [*args, *kwargs.values()] if isinstance(a, nn.Module)]
        for m in given:
            for p in m.parameters():
                unit = getattr(p, "ds_unit", None)
                if unit is not None and unit.owner in self.partitioners:
                    self.partitioner, self._new_needed = unit.owner, False
                    self._holds_model = False  # whatever it holds, the module being built joins it
                    return
        self._new_needed = self._holds_model

    def _model_built(self, module: nn.Module) -> None:
        """A module built by a statement of its own is complete. One with submodules is taken for a model:
        the next one gets a partitioner of its own. Lone layers (`nn.Sequential(*(nn.Linear(d, d) for _ in
        range(8)))` builds eight first) stay in the current one with what is built next."""
        if self._splits and next(module.children(), None) is not None:
            self._holds_model = self._holds_model or any(
                getattr(p, "ds_unit", None) is not None and p.ds_unit.owner is self.partitioner
                for p in module.parameters()
            )

    def _next_partitioner(self) -> Stage3Partitioner:
        """A partitioner for the model being built: same config, device, group and pinned pool as the
        first, its own store and swap space."""
        first = self.partitioners[0]
        part = Stage3Partitioner(first.config, device=first.device, group=self._group, pool=first.store.pool)
        part.family = self
        self.partitioners.append(part)
        return part

    def _partition_tree(self, module: nn.Module) -> None:
        assert self.partitioner is not None
        for sub in module.modules():
            has_new = any(p is not None and not is_partitioned(p) for p in sub._parameters.values())
            if not has_new:
                continue
            if self._new_needed:
                self.partitioner, self._new_needed = self._next_partitioner(), False
                self._holds_model = False
            if self.dtype is not None:
                for p in sub._parameters.values():
                    if p is not None and not is_partitioned(p) and p.is_floating_point():
                        p.data = p.data.to(self.dtype)
            name = f"init{self._seq:05d}-{type(sub).__name__}"
            self._seq += 1
            unit = self.partitioner.partition_module(sub, name)
            if unit is not None:
                # Qualified names are learned when the model is attached; until then, construction order.
                unit.param_names = [f"<init>{name}.{n.rsplit('.', 1)[-1]}" for n in unit.param_names]
                for p, n in zip(unit.params, unit.param_names):
                    p.ds_name = n


def _refuse_unsupported(hpz_group: Any, quantized: bool, quantized_frozen: bool, swapper: Any) -> None:
    """DeepSpeed Init arguments that would change what is stored or how: refused, not silently ignored."""
    if hpz_group is not None:
        raise NotImplementedError(
            "zero.Init(zero_param_parallel_group=...): hpZ secondary partitions are not supported; each "
            "parameter is partitioned once over data_parallel_group"
        )
    if quantized or quantized_frozen:
        raise NotImplementedError(
            "zero.Init(zero_quantized_weights / zero_quantized_nontrainable_weights=True): quantized "
            "weights are not supported; partitions are kept in the model dtype"
        )
    if swapper is not None:
        raise NotImplementedError(
            "zero.Init(param_swapper=...): DeepSpeed's parameter swapper is not used; NVMe partitions go "
            "through the partitioner's own store (zero_optimization.offload_param)"
        )


def _override_offload(loaded: Any, remote_device: Optional[str], pin_memory: Optional[bool]) -> Any:
    """Init(remote_device=, pin_memory=) win over the loaded config's offload_param."""
    import dataclasses

    from offload.config.zero import OffloadParamConfig

    z = loaded.zero_optimization
    off = z.offload_param or OffloadParamConfig()
    changes: Dict[str, Any] = {}
    if remote_device is not None:
        if remote_device not in ("none", "cpu", "nvme"):
            raise ValueError(
                f"Init(remote_device=...) must be 'none', 'cpu' or 'nvme', got {remote_device!r}"
            )
        if remote_device == "nvme" and not off.nvme_path:
            raise ValueError("Init(remote_device='nvme') needs zero_optimization.offload_param.nvme_path")
        changes["device"] = remote_device
    if pin_memory is not None:
        changes["pin_memory"] = bool(pin_memory)
    z = dataclasses.replace(z, offload_param=dataclasses.replace(off, **changes))
    return dataclasses.replace(loaded, zero_optimization=z)


def _wrap_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        ctx = _active()
        if ctx is None:
            orig(module, *args, **kwargs)
            return
        key = id(module)
        if not ctx._depth:  # no module of this Init is being built: `module` starts a new one
            ctx._model_starts(args, kwargs)
        depth = ctx._depth.get(key, 0)
        ctx._depth[key] = depth + 1
        try:
            orig(module, *args, **kwargs)
        finally:
            if depth == 0:
                ctx._depth.pop(key, None)
            else:
                ctx._depth[key] = depth
        if depth == 0:  # the most-derived __init__ returned: the module is complete
            ctx._partition_tree(module)
            if not ctx._depth:
                ctx._model_built(module)

    wrapper._zo_original = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_class(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_zo_original", None) is not None or cls in Init._originals:
        return
    Init._originals[cls] = init
    cls.__init__ = _wrap_init(init)  # type: ignore[misc]


def _gathered_apply(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    for child in self.children():
        child.apply(fn)
    own = [p for p in self._parameters.values() if p is not None]
    with GatheredParameters(own, modifier_rank=0):
        fn(self)
    return self


def _gathered_smart_apply(module: nn.Module, fn: Callable[..., None], is_custom_code: bool) -> nn.Module:
    """transformers' `smart_apply` (each sub-model with its own `_initialize_weights`), gathering each
    module's own parameters around `fn` like `_gathered_apply`."""
    for child in module.children():
        sub_model = hasattr(child, "_initialize_weights") and hasattr(child, "config")  # a PreTrainedModel
        _gathered_smart_apply(child, child._initialize_weights if sub_model else fn, is_custom_code)
    # its own parameters and those of its leaf children: model families re-initialise a child's weight from
    # the parent (GPT-2 scales every `c_proj.weight` from its attention and MLP modules); a leaf is one layer,
    # so what is whole at once stays a few layers
    params = [p for p in module._parameters.values() if p is not None]
    for child in module.children():
        if next(child.children(), None) is None:
            params += [p for p in child._parameters.values() if p is not None]
    with GatheredParameters(params, modifier_rank=0):
        fn(module, is_custom_code)
    return module


def _patch() -> None:
    for cls in _all_subclasses(nn.Module):
        _wrap_class(cls)
    orig_sub = nn.Module.__dict__.get("__init_subclass__")
    Init._orig_init_subclass = orig_sub

    def init_subclass(cls: type, **kwargs: Any) -> None:
        super(nn.Module, cls).__init_subclass__(**kwargs)
        _wrap_class(cls)

    nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
    Init._orig_apply = nn.Module.apply
    nn.Module.apply = _gathered_apply  # type: ignore[method-assign]
    Init._orig_smart_apply = nn.Module.__dict__.get("smart_apply")  # transformers installs it on first use
    nn.Module.smart_apply = _gathered_smart_apply  # type: ignore[attr-defined]


def _unpatch() -> None:
    for cls, init in Init._originals.items():
        cls.__init__ = init  # type: ignore[misc]
    Init._originals = {}
    if Init._orig_init_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = Init._orig_init_subclass  # type: ignore[assignment]
    nn.Module.apply = Init._orig_apply  # type: ignore[method-assign]
    if Init._orig_smart_apply is None:
        del nn.Module.smart_apply
    else:
        nn.Module.smart_apply = Init._orig_smart_apply  # type: ignore[attr-defined]
