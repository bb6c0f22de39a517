"""Parameter groups: torch's `param_groups` (each its own lr, betas, eps, weight decay) over one partition.

The engine's `ZeroOptimizer` keeps torch's groups: `engine.optimizer.param_groups[i]["lr"]` is read and
written as with any torch optimizer, and a scheduler scales each group from its own base lr. The groups come
from the client optimizer's `param_groups`, or from `model_parameters` given as groups (dicts whose keys
override the config's optimizer block, as torch's do), else one group of every trainable parameter.

The optimizer state is one flat partition whatever the groups: a layout reports where each parameter's
elements lie in it (`param_spans`), and `group_spans` turns that into runs of one group, back to back over
the whole partition (padding and frozen elements belong to the run before them). A chunk of the state is
updated run by run, each with its group's hyperparameters (`pieces`): the kernel call is split where a
chunk crosses from one group to the next, so a chunk never mixes two groups' hyperparameters. While every
group holds the same values the chunk is updated in one call, as with a single group.
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from zero.optimizer.torch_step import kernel_implements

__all__ = ["UPDATE_KEYS", "build_groups", "check_quantized_groups", "groups_differ", "group_spans", "pieces"]

# The hyperparameters an update reads from a group (the rule ignores those it has no use for).
UPDATE_KEYS = ("lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
# torch optimizer keys with a value the update rules do not implement: (key, the value they assume).
_UNSUPPORTED = (
    ("amsgrad", False),
    ("maximize", False),
    ("lr_decay", 0),
    ("initial_accumulator_value", 0),
    ("momentum", 0),
    ("nesterov", False),
)

Span = Tuple[int, int, int]  # [start, end) of the partition and the index of its group


def _overrides(spec: Dict[str, Any], translate: bool) -> Dict[str, Any]:
    """A group's own hyperparameters as the update reads them (floats, betas a tuple)."""
    out: Dict[str, Any] = {}
    for key, value in spec.items():
        if key == "params":
            continue
        if key in ("lr", "eps", "weight_decay"):
            out[key] = float(value)
        elif key == "betas":
            out[key] = tuple(float(b) for b in value)
        elif not translate:
            out[key] = value  # a group of model_parameters: every key kept, as torch keeps them
    return out


def _check(spec: Dict[str, Any], where: str) -> None:
    for key, neutral in _UNSUPPORTED:
        if key in spec and spec[key] and spec[key] != neutral:
            raise ValueError(f"{where}: {key}={spec[key]!r} is not supported by the engine's update rules")


def build_groups(
    params: List[nn.Parameter], model_parameters: Optional[Any], client: Optional[torch.optim.Optimizer]
) -> List[Dict[str, Any]]:
    """The ZeroOptimizer's groups over `params` (the trainable parameters, each once): the client
    optimizer's groups (their hyperparameters translated), else `model_parameters`' dict groups (their keys
    kept, tensors outside any dict in a group of their own at the end), else one group. A parameter listed
    twice stays in its first group; a trainable parameter in no group joins the first one."""
    # a client the kernels implement has its hyperparameters translated; one stepped by its own class on
    # the host (zero.optimizer.torch_step) keeps every key, as torch does
    translate = client is not None and kernel_implements(client)
    if client is not None:
        source: List[Dict[str, Any]] = list(client.param_groups)
        where = f"{type(client).__name__} param group"
    elif model_parameters is not None and any(isinstance(i, dict) for i in model_parameters):
        items = list(model_parameters)
        source = [i for i in items if isinstance(i, dict)]
        loose = [i for i in items if not isinstance(i, dict)]
        if loose:
            source.append({"params": loose})
        where = "model_parameters group"
    else:
        return [{"params": list(params)}]
    wanted = {id(p) for p in params}
    seen: set = set()
    groups = []
    for i, spec in enumerate(source):
        if translate or client is None:
            _check(spec, f"{where} {i}")
        ps = spec["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        mine = [p for p in ps if id(p) in wanted and id(p) not in seen]
        seen.update(id(p) for p in mine)
        groups.append({**_overrides(spec, translate), "params": mine})
    groups[0]["params"].extend(p for p in params if id(p) not in seen)
    return groups


def group_spans(
    param_spans: Sequence[Tuple[int, int, nn.Parameter]], groups: Sequence[Dict[str, Any]], numel: int
) -> List[Span]:
    """Runs of one group covering [0, numel) of the partition, from where each parameter's elements lie
    (`param_spans`: [start, end) and the parameter); elements of no parameter join the run before them
    (the first run starts at 0)."""
    index = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    runs: List[List[int]] = []
    for a, z, p in sorted(param_spans, key=lambda s: s[0]):
        gi = index.get(id(p))
        if gi is None or a >= z:
            continue
        if runs and runs[-1][2] == gi:
            runs[-1][1] = z
        elif runs:
            runs[-1][1] = a
            runs.append([a, z, gi])
        else:
            runs.append([0, z, gi])
    if not runs:
        return [(0, numel, 0)]
    runs[-1][1] = numel
    return [(a, z, gi) for a, z, gi in runs]


def groups_differ(groups: Sequence[Dict[str, Any]], used: Optional[Sequence[int]] = None) -> bool:
    """Whether the groups (those indexed by `used`) hold different values of a hyperparameter the update
    reads."""
    chosen = [groups[i] for i in used] if used is not None else list(groups)
    first = [chosen[0].get(k) for k in UPDATE_KEYS]
    return any([g.get(k) for k in UPDATE_KEYS] != first for g in chosen[1:])


def check_quantized_groups(rule: Any, groups: Sequence[Dict[str, Any]], spans: Sequence[Span]) -> None:
    """ValueError for int8 states over param groups with different hyperparameters: a block of elements
    shares one absmax scale, and a block may span two groups."""
    used = sorted({gi for _, _, gi in spans})
    if rule.format.quantized and len(used) > 1 and groups_differ(groups, used):
        raise ValueError(
            "optimizer.params.state_dtype='int8' with param groups of different hyperparameters is not "
            "supported (a block's absmax scale would span two groups); use state_dtype 'bf16' or 'fp32', "
            "or one set of hyperparameters"
        )


def pieces(spans: Sequence[Span], starts: Sequence[int], start: int, n: int) -> Iterator[Span]:
    """The runs' parts inside [start, start + n), as (a, z, group) in partition coordinates (`starts`: the
    runs' first elements)."""
    end = start + n
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(spans) and spans[i][0] < end:
        a, z, gi = spans[i]
        a, z = max(a, start), min(z, end)
        if a < z:
            yield a, z, gi
        i += 1
