"""The model a checkpoint is loaded into, built without weights, and the plan matching its tensors to it.

`parameters_on_meta` builds the model with every parameter on the meta device (buffers real); `renamer`
maps checkpoint keys to the model's as transformers does; `plan_weights` matches every tensor to its
parameter or buffer and checks shapes and dtype kinds, before any tensor data is read.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from torch import nn

from zero.inference.checkpoint_files import SHOWN, CheckpointTensor, PretrainedCheckpointError, listed

__all__ = ["FLOAT_TENSORS", "WeightPlan", "parameters_on_meta", "plan_weights", "renamer"]

logger = logging.getLogger("zero")

# safetensors dtype names of the tensors cast to the compute dtype as they are loaded
FLOAT_TENSORS = ("F64", "F32", "F16", "BF16")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device (buffers stay real)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def renamer(model: nn.Module, key_mapping: Optional[Dict[str, str]]) -> Callable[[str], str]:
    """Checkpoint key -> model key, as transformers renames them (its conversion mapping for the model, the
    legacy renames, key_mapping=, base_model_prefix added or stripped). Conversions that merge or split
    tensors are refused."""
    state = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # an older transformers: only the base-model prefix
        get_model_conversion_mapping = None
    if get_model_conversion_mapping is None:

        def plain(key: str) -> str:
            if prefix and key not in state and f"{prefix}.{key}" in state:
                return f"{prefix}.{key}"
            short = key[len(prefix) + 1 :] if prefix and key.startswith(prefix + ".") else None
            if short is not None and key not in state and short in state:
                return short
            return key

        return plain
    mapping = get_model_conversion_mapping(model, key_mapping=key_mapping)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]

    def rename(key: str) -> str:
        new, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if new not in state and key in state:
            new, pattern = rename_source_key(key, [], [], prefix, state)
        if pattern is not None:
            raise PretrainedCheckpointError(
                f"checkpoint tensor {key!r} needs transformers' conversion {pattern!r} (tensors merged or "
                "split on load), which zero.from_pretrained does not apply: save the model with transformers "
                "first (from_pretrained, then save_pretrained) and load that"
            )
        return new

    return rename


def _ignored(name: str, patterns: Any) -> bool:
    return any(re.search(p, name) for p in (patterns or ()))


@dataclass
class WeightPlan:
    """Which checkpoint tensor loads which parameter or persistent buffer."""

    params: Dict[str, Tuple[str, str]]  # checkpoint key -> (file, parameter's first name)
    buffers: Dict[str, Tuple[str, str]]  # checkpoint key -> (file, buffer name)


def plan_weights(
    model: nn.Module, tensors: Dict[str, CheckpointTensor], rename: Callable[[str], str]
) -> WeightPlan:
    """Match checkpoint tensors to parameters and persistent buffers; check shapes and dtypes; refuse
    parameters without a tensor (tied aliases and the model's ignore patterns excepted); warn about
    tensors the model does not have."""
    state = model.state_dict(keep_vars=True)
    first: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    plan = WeightPlan({}, {})
    loaded: set = set()
    unexpected, wrong = [], []
    for key in sorted(tensors):
        t = tensors[key]
        name = rename(key)
        target = state.get(name)
        if target is None:
            if not _ignored(key, getattr(model, "_keys_to_ignore_on_load_unexpected", None)):
                unexpected.append(key)
            continue
        is_param = isinstance(target, nn.Parameter)
        what = f"parameter {name!r}" if is_param else f"buffer {name!r}"
        if tuple(target.shape) != t.shape:
            wrong.append(
                f"{t.file}: tensor {key!r} has shape {list(t.shape)} ({t.dtype}) but the model's {what} has "
                f"shape {list(target.shape)}"
            )
            continue
        if (t.dtype in FLOAT_TENSORS) != target.is_floating_point():
            wrong.append(
                f"{t.file}: tensor {key!r} is {t.dtype} but the model's {what} is {target.dtype} "
                "(floating-point tensors are cast to the compute dtype; other dtypes must match in kind)"
            )
            continue
        if not is_param:
            plan.buffers[key] = (t.file, name)
        elif id(target) not in loaded:  # a tied parameter: its first tensor in the checkpoint
            loaded.add(id(target))
            plan.params[key] = (t.file, first[id(target)])
    if wrong:
        raise PretrainedCheckpointError(
            f"{len(wrong)} checkpoint tensor(s) do not fit the model: " + "; ".join(wrong[:SHOWN])
        )
    ignorable = getattr(model, "_keys_to_ignore_on_load_missing", None)
    missing = [n for i, n in first.items() if i not in loaded]
    refused = [n for n in missing if not _ignored(n, ignorable)]
    if refused:
        raise PretrainedCheckpointError(
            f"the checkpoint has no tensor for {len(refused)} parameter(s) of "
            f"{type(model).__name__}: {listed(refused)} (checked {len(tensors)} tensors in "
            f"{len({t.file for t in tensors.values()})} file(s)); zero.from_pretrained does not initialise "
            "missing weights at random"
        )
    if missing:
        logger.warning(
            "zero.from_pretrained: %s not in the checkpoint (ignorable): left at zero", listed(missing)
        )
    if unexpected:
        logger.warning(
            "zero.from_pretrained: %d checkpoint tensor(s) the model %s does not have were not loaded: %s",
            len(unexpected),
            type(model).__name__,
            listed(unexpected),
        )
    return plan
