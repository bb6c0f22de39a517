"""`apply(model)`: checkpoint a model's repeated blocks without changing its code or its state dict.

Like FSDP's `apply_activation_checkpointing`, but the modules stay where they are (no wrapper module, so
parameter names and checkpoints are unchanged): each chosen block's `forward` is replaced, on the instance, by
one that runs the original through `zero.checkpointing.checkpoint`. The recompute calls the block through
`__call__`, so the block's own hooks (stage 3 gathers its parameters there) run for it as they do for the
forward, exactly once each time. A Hugging Face model is switched with its own gradient checkpointing (which
also turns the KV cache off in training) with `zero.checkpointing.checkpoint` as the checkpoint function.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Type, Union

from torch import nn

from zero.activations.checkpointer import checkpoint

__all__ = ["apply", "applied_blocks", "find_blocks", "why_nothing_checkpointed"]

_REPLAY = threading.local()


def find_blocks(model: nn.Module, block_types: Optional[Sequence[Type[nn.Module]]] = None) -> List[str]:
    """Qualified names of the blocks `apply` would wrap: instances of `block_types` (outermost only), or by
    default the children of the longest `nn.ModuleList` whose children are all of one class."""
    if block_types is not None:
        types_ = tuple(block_types)
        if not types_ or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types_):
            raise TypeError(f"block_types must be nn.Module subclasses, got {block_types!r}")
        names: List[str] = []
        for name, module in model.named_modules():
            if isinstance(module, types_) and module is not model:
                if not any(name.startswith(outer + ".") for outer in names):
                    names.append(name)
        if not names:
            raise ValueError(
                f"{type(model).__name__} has no submodule of type {[t.__name__ for t in types_]}"
            )
        return names
    best: Tuple[int, str] = (0, "")
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > best[0]:
            kinds = {type(child) for child in module}
            if len(kinds) == 1:
                best = (len(module), name)
    if best[0] == 0:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks of one class; pass block_types= naming"
            " the block class(es) to checkpoint"
        )
    prefix = best[1] + "." if best[1] else ""
    return [f"{prefix}{i}" for i in range(best[0])]


def _is_hf(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and hasattr(
        model, "_set_gradient_checkpointing"
    )


def _hf_block(module: nn.Module) -> bool:
    """A Hugging Face block with gradient checkpointing on (not a model that carries the flag too)."""
    return getattr(module, "gradient_checkpointing", False) is True and not hasattr(
        module, "supports_gradient_checkpointing"
    )


def _hf_enable(model: nn.Module) -> List[str]:
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})  # HF's switch: flags, KV cache off in training, input grads
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)
    return [name for name, m in model.named_modules() if _hf_block(m)]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = self.__dict__.get("_zero_checkpoint_inner") or type(self).forward.__get__(self)
    replaying = getattr(_REPLAY, "modules", ())
    if self in replaying:  # the recompute's __call__ reached us: run the block itself
        return inner(*args, **kwargs)
    first = [True]

    def run(*a: Any, **k: Any) -> Any:
        if first[0]:  # the forward: __call__ and its hooks are already around us
            first[0] = False
            return inner(*a, **k)
        _REPLAY.modules = getattr(_REPLAY, "modules", ()) + (self,)
        try:
            return self(*a, **k)  # the recompute: through __call__, so the block's hooks run again
        finally:
            _REPLAY.modules = _REPLAY.modules[:-1]

    return checkpoint(run, *args, **kwargs)


def _wrap(module: nn.Module) -> bool:
    if _is_wrapped(module):
        return False  # already wrapped
    forward = module.__dict__.get("forward")
    if forward is not None:
        module._zero_checkpoint_inner = forward  # an instance-level forward someone set before us
    module.forward = types.MethodType(_checkpointed_forward, module)
    return True


def apply(
    model: nn.Module, block_types: Optional[Union[Type[nn.Module], Iterable[Type[nn.Module]]]] = None
) -> List[str]:
    """Checkpoint `model`'s repeated blocks with `zero.checkpointing.checkpoint`; returns their names.

    `block_types`: the block class(es) to wrap (every outermost instance); default: the children of the
    longest `nn.ModuleList` of one class (a transformer's layers). A Hugging Face model without `block_types`
    uses its own gradient checkpointing switch with this module's checkpoint function. Calling it again
    changes nothing.
    """
    if isinstance(block_types, type):
        block_types = (block_types,)
    if block_types is None and _is_hf(model):
        return _hf_enable(model)
    names = find_blocks(model, None if block_types is None else tuple(block_types))
    modules = dict(model.named_modules())
    for name in names:
        _wrap(modules[name])
    return names


def _is_wrapped(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_forward


def applied_blocks(model: nn.Module) -> List[str]:
    """Qualified names of `model`'s blocks set to be checkpointed: wrapped by `apply`, or Hugging Face blocks
    with gradient checkpointing on."""
    return [name for name, m in model.named_modules() if _is_wrapped(m) or _hf_block(m)]


def why_nothing_checkpointed(model: nn.Module) -> str:
    """Why a training step of `model` checkpointed no block, and what to do about it."""
    blocks = applied_blocks(model)
    if not blocks:
        return (
            "no block of the model is set to be checkpointed: call zero.checkpointing.apply(model) (or"
            " checkpoint blocks with zero.checkpointing.checkpoint)"
        )
    modules = dict(model.named_modules())
    if not all(modules[name].training for name in blocks):
        return (
            f"{len(blocks)} blocks are set to be checkpointed, but the model is in eval mode, where Hugging"
            " Face blocks are not checkpointed (from_pretrained returns the model in eval mode): call"
            " model.train() (or engine.train()) before training"
        )
    return (
        f"{len(blocks)} blocks are set to be checkpointed, but none ran with gradients enabled (under"
        " torch.no_grad nothing is checkpointed)"
    )
