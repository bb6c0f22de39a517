"""Module hooks that make parameters whole exactly when forward or backward needs them.

Forward: a pre-hook fetches the units of the module's own parameters (and of parameters registered as
external to it); a post-hook releases them. Backward: the post-hook routes the module's outputs through
`_PreBackward`, an identity autograd function whose backward runs just before the module's own backward and
gathers the same units again; they are freed when their gradients have been accumulated (the gradient hook
in the partitioner), or at the end of backward. Parameters used outside their module's forward (a tied
embedding weight read by the model's own forward for the output head) are caught without __torch_function__:
each module's `_parameters` becomes a dict that gathers a released parameter when it is read by attribute
during some module's forward, and registers it as external to that module, so it is fetched with it from
then on (in forward and backward). A parameter a module returns itself (`return self.weight`) becomes
external to the module that called it, the same way, and goes out unwrapped: it is whole while the caller uses
it, and the caller's backward gathers it again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero.stage3.fused import QuantizedForwards
from zero.stage3.linear_layout import LinearLayouts
from zero.stage3.unit import PartitionStatus, Unit, is_partitioned

__all__ = ["Stage3Hooks", "register_external_parameter", "unregister_external_parameter"]


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hooks: Stage3Hooks, module: nn.Module, *tensors: torch.Tensor) -> Any:
        ctx.hooks = hooks
        ctx.module = module
        # detach, not the input itself: an input returned as-is becomes a view that in-place ops refuse
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.hooks.pre_backward(ctx.module)
        return (None, None) + grads


_NOT_GATHERED = (PartitionStatus.NOT_AVAILABLE, PartitionStatus.INFLIGHT)


class _FetchOnAccess(OrderedDict):
    """A module's `_parameters`: reading a released parameter during a forward gathers it (see above)."""

    hooks: Optional[Stage3Hooks] = None

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        hooks = self.hooks
        if (
            hooks is not None
            and value is not None
            and hooks.stack
            and getattr(value, "ds_status", None) in _NOT_GATHERED
        ):
            hooks.external_use(value)
        return value


class Stage3Hooks:
    """Installs the fetch/release hooks on every module of `model`; `remove()` takes them all away."""

    def __init__(self, partitioner: Any, model: nn.Module) -> None:
        """`partitioner`: the Stage3Partitioner whose units the hooks gather and release."""
        self.p = partitioner
        self.model = model
        self.stack: List[Tuple[nn.Module, List[Unit]]] = []
        self.externals: Dict[nn.Module, List[Unit]] = {}
        self.module_units: Dict[nn.Module, List[Unit]] = {}
        self._handles: List[Any] = []
        self._patched: List[Tuple[nn.Module, Any]] = []
        for m in model.modules():
            units = partitioner.units_of(p for p in m._parameters.values() if p is not None)
            self.module_units[m] = units
            # every module, with or without parameters: the stack must name the module actually running
            self._handles.append(m.register_forward_pre_hook(self.pre_forward))
            self._handles.append(m.register_forward_hook(self.post_forward, always_call=True))
            if not isinstance(m._parameters, _FetchOnAccess):
                params = _FetchOnAccess(m._parameters)
                params.hooks = self
                self._patched.append((m, m._parameters))
                m._parameters = params
        self.fused = QuantizedForwards(
            model,
            partitioner.store,
            owner=partitioner,
            world_size=partitioner.world_size,
            device=partitioner.device,
            int8_activations=bool(partitioner.config.zero_offload.int8_activations),
        )
        # after the quantized forwards: a Linear that reads its codes keeps that forward
        self.layouts: Optional[LinearLayouts] = (
            LinearLayouts(model) if partitioner.device.type == "cpu" else None
        )

    # -------------------------------------------------------------------------------------------- forward
    def units_for(self, module: nn.Module) -> List[Unit]:
        """The units `module` needs whole: those of its own parameters, then those external to it."""
        ext = self.externals.get(module)
        own = self.module_units.get(module, [])
        return own + [u for u in ext if u not in own] if ext else own

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: fetch the module's units (the root's also starts a pass of the use trace)."""
        if module is self.model:
            if self.stack:  # an earlier forward raised half way: drop what it held
                self.stack.clear()
                self.p.release_all()
            self.p.begin_pass()
        frame = list(self.units_for(module))
        for u in frame:
            self.p.fetch(u, encoded=self.fused.owns(module, u))
        self.stack.append((module, frame))
        if torch.is_grad_enabled():
            frozen = [u for u in frame if not u.trainable]
            if frozen:
                self._free_after_input_grads(frozen, args)

    def _free_after_input_grads(self, units: List[Unit], args: Any) -> None:
        """Units with no trainable parameter get no gradient, so nothing frees them when their module's
        backward ends: free them once the gradients of the module's inputs are computed (its backward, and
        that of every other module reading the same inputs, has then run). A module called again later
        gathers them again in its own backward."""
        leaves, _ = tree_flatten(args)
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return  # no gradient flows through this call: its backward never reads the weights
        pending = [len(inputs)]

        def input_grad_done(grad: torch.Tensor) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                self.p.release_backward_hold(units)

        for t in inputs:
            t.register_hook(input_grad_done)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Forward hook: release the module's units; with grad enabled, route its outputs through
        `_PreBackward` so that its backward gathers them again."""
        if not self.stack or self.stack[-1][0] is not module:
            return output  # an exception unwound past this module; the root's next forward cleans up
        _, frame = self.stack.pop()
        if self.stack:
            self._hand_returned_params(output)
        for u in frame:
            self.p.release(u)
        if torch.is_grad_enabled() and (self.module_units.get(module) or self.externals.get(module)):
            return self._wrap_outputs(module, output)
        return output

    def _returned_units(self, output: Any) -> List[Unit]:
        """Units of this partitioner's parameters that `output` holds as themselves (not computed from)."""
        leaves, _ = tree_flatten(output)
        units: List[Unit] = []
        for t in leaves:
            unit = getattr(t, "ds_unit", None) if isinstance(t, nn.Parameter) else None
            if unit is not None and unit.owner is self.p and unit not in units:
                units.append(unit)
        return units

    def _hand_returned_params(self, output: Any) -> None:
        """A module returned one of the model's parameters itself (DeepSpeed: a "dangling" parameter): the
        caller, the module now on top of the stack, uses it. It becomes external to the caller - gathered
        whenever the caller runs, forward and backward - and stays whole until the caller's forward ends."""
        caller, frame = self.stack[-1]
        for unit in self._returned_units(output):
            ext = self.externals.setdefault(caller, [])
            if unit not in ext and unit not in self.module_units.get(caller, []):
                ext.append(unit)
            self.p.fetch(unit)  # before the returning module's frame lets it go: never freed in between
            frame.append(unit)

    def _wrap_outputs(self, module: nn.Module, output: Any) -> Any:
        leaves, spec = tree_flatten(output)
        # a returned parameter goes out as itself, so that the caller's autograd saves the parameter, which
        # the caller's backward gathers again, and not an alias of storage that is freed when the caller ends
        idx = [
            i
            for i, t in enumerate(leaves)
            if isinstance(t, torch.Tensor) and t.requires_grad and not is_partitioned(t)
        ]
        if not idx:
            return output
        wrapped = _PreBackward.apply(self, module, *(leaves[i] for i in idx))
        for i, t in zip(idx, wrapped):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def external_use(self, param: nn.Parameter) -> None:
        """`param` was read during the forward of the module on top of the stack: gather it for that
        module now and in every later forward and backward."""
        unit: Unit = param.ds_unit
        if unit.owner is not self.p:
            return
        module, frame = self.stack[-1]
        ext = self.externals.setdefault(module, [])
        if unit not in ext and unit not in self.module_units.get(module, []):
            ext.append(unit)
        self.p.fetch(unit)
        frame.append(unit)

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """Gather `param`'s unit whenever `module` runs (see `register_external_parameter`)."""
        if not is_partitioned(param):
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not partitioned by stage 3")
        ext = self.externals.setdefault(module, [])
        if param.ds_unit not in ext:
            ext.append(param.ds_unit)

    # ------------------------------------------------------------------------------------------- backward
    def pre_backward(self, module: nn.Module) -> None:
        """Just before `module`'s backward: hold its units (the first call of a backward also queues the
        partitioner's `end_backward` on the autograd engine)."""
        if not self.p.in_backward:
            self.p.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self.p.end_backward)
        for u in self.units_for(module):
            self.p.hold_for_backward(u)

    def remove(self) -> None:
        """Take every hook away and give the modules plain `_parameters` dicts back."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m, _original in self._patched:
            m._parameters = OrderedDict(m._parameters)  # current contents, without the fetching behaviour
        self._patched = []
        self.fused.remove()
        if self.layouts is not None:
            self.layouts.remove()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's API: gather `parameter` whenever `module` runs (forward and backward). Needed only when
    the parameter is used inside `module` without being read through a module attribute."""
    hooks: Optional[Stage3Hooks] = getattr(
        getattr(getattr(parameter, "ds_unit", None), "owner", None), "hooks", None
    )
    if hooks is None:
        raise RuntimeError(
            "register_external_parameter: the parameter is not managed by an attached Stage3Partitioner "
            "(partition the model and call attach(model) first)"
        )
    if module not in hooks.module_units:
        raise ValueError(
            f"register_external_parameter: {type(module).__name__} is not part of the attached model"
        )
    hooks.register_external(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter(module, parameter)`."""
    hooks = getattr(getattr(getattr(parameter, "ds_unit", None), "owner", None), "hooks", None)
    if hooks is not None and parameter.ds_unit in hooks.externals.get(module, []):
        hooks.externals[module].remove(parameter.ds_unit)
