"""ParamShard: DeepSpeed's `param.ds_tensor`, this rank's share of one stage-3 parameter.

The share's values live in the unit's partition (zero.stage3.unit), wherever its tier keeps it. A ParamShard
is the 1-D tensor user code reads and writes as DeepSpeed's `ds_tensor`, and every way DeepSpeed code writes
one reaches the partition:

* memory tiers: the shard is a view of the partition itself, so reads see the current values and in-place
  operations (`copy_`, `fill_`, `add_`, `t[...] = x`, `torch.nn.init.*_`) change the partition;
* `p.ds_tensor.data = t` copies `t`'s values into the partition (a plain tensor's `.data =` would rebind
  the tensor to `t`'s storage and leave the partition as it was); `p.ds_tensor.data` is a shard again, so
  `p.ds_tensor.data.copy_(t)` is a write as well;
* NVMe (or a partition stored quantized): the shard is an empty placeholder (DeepSpeed's swapped-out
  state), and `.data = t` / `copy_(t)` write `t` into the swap file (the unit's partition is read, this
  share replaced, and written back); any other in-place operation is refused, as it has no values to work
  on.

After each write the partitioner (`write_share`) drops stale copies of the partition (reads ahead) and
brings a gathered copy of the unit up to date: a unit nothing holds is freed, so its next use gathers the
new values; a unit held right now (inside its forward or a GatheredParameters block) gets this rank's
share copied into its full buffer (other ranks see it at the next gather). The optimizer's fp32 master is
not changed, as in DeepSpeed, where the next step overwrites the 16-bit partition from the master: to set
the master, use `zero.utils.safe_set_local_fp32_param` / `safe_set_full_fp32_param`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

import torch

__all__ = ["ParamShard", "ShardOwner", "make_shard", "retire_shard"]

# in-place methods that change no values (they do not write the partition)
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "pin_memory"})


class ShardOwner(Protocol):
    """What a shard needs of its unit's partitioner (zero.stage3.partitioner.Stage3Partitioner)."""

    def write_share(self, unit: Any, index: int, values: Optional[torch.Tensor]) -> None:
        """Parameter `index` of `unit`: write `values` (this rank's share) into the partition, or (None)
        note that its memory-resident share was changed in place; then refresh copies of the partition."""
        ...


class ParamShard(torch.Tensor):
    """A stage-3 parameter's `ds_tensor` (see the module docstring). Attributes, as in DeepSpeed:
    `ds_numel` (elements of this rank's share) and `final_location` ("nvme" or None)."""

    ds_numel: int
    final_location: Optional[str]
    _ds_unit: Optional[weakref.ref]  # the unit (weakly: a shard keeps no cycle through its parameter)
    _ds_index: int
    _ds_resident: bool  # a view of the partition itself (memory tiers), else an empty placeholder

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Tuple[type, ...],
        args: Tuple[Any, ...] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        """Run `func` on plain tensors (results are plain tensors); an in-place write to a shard (its first
        argument) reaches the partition."""
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], ParamShard) else None
        name = getattr(func, "__name__", "")
        writes = target is not None and (name == "__setitem__" or _in_place(name))
        if writes and not target._ds_resident:
            if name == "copy_":
                _write(target, args[1])
                return target
            raise RuntimeError(
                f"ds_tensor.{name}: this parameter's partition is not in memory ({_where(target)}); write "
                "it with `ds_tensor.data = values` or `ds_tensor.copy_(values)`"
            )
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if writes:
            _owner(target).write_share(_unit(target), target._ds_index, None)
            if out is not None and not isinstance(out, ParamShard) and name != "__setitem__":
                out = target  # methods like add_ return their tensor: the shard, as DeepSpeed's
        return out

    @property  # type: ignore[override]
    def data(self) -> ParamShard:
        """The same share (a shard again: writes through it reach the partition)."""
        with torch._C.DisableTorchFunctionSubclass():
            base = torch._C.TensorBase.data.__get__(self)
        return _wrap(base, self)

    @data.setter
    def data(self, values: torch.Tensor) -> None:
        """Copy `values` (this share's element count; cast to the partition's dtype) into the partition."""
        _write(self, values)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        """A plain tensor holding a copy of the share's values (a copied model's `ds_tensor` is DeepSpeed's
        plain tensor: it writes nowhere), with `ds_numel` and `final_location`."""
        copied = _plain(self).clone()
        copied.ds_numel = self.ds_numel
        copied.final_location = self.final_location
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (torch.save) as the plain tensor of its values."""
        return _plain(self).__reduce_ex__(protocol)


def _plain(shard: ParamShard) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return torch._C.TensorBase.data.__get__(shard).as_subclass(torch.Tensor)


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


def _wrap(base: torch.Tensor, like: Any) -> ParamShard:
    t = base.as_subclass(ParamShard)
    t.ds_numel = like.ds_numel
    t.final_location = like.final_location
    t._ds_unit = like._ds_unit
    t._ds_index = like._ds_index
    t._ds_resident = like._ds_resident
    return t


def _unit(shard: ParamShard) -> Any:
    ref = shard._ds_unit
    return ref() if ref is not None else None


def _where(shard: ParamShard) -> str:
    if _unit(shard) is None:
        return "its partitioner is closed"
    return "it lives on NVMe" if shard.final_location == "nvme" else "it is stored quantized"


def _owner(shard: ParamShard) -> ShardOwner:
    unit = _unit(shard)
    if unit is None or unit.owner is None:
        raise RuntimeError("ds_tensor: the partitioner that held this parameter is closed")
    return unit.owner


def _write(shard: ParamShard, values: Any) -> None:
    owner = _owner(shard)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"ds_tensor: expected a tensor to write, got {type(values).__name__}")
    unit, index = _unit(shard), shard._ds_index
    if values.numel() != shard.ds_numel:
        raise ValueError(
            f"ds_tensor of {unit.param_names[index]!r}: this rank's share has {shard.ds_numel} elements, "
            f"got a tensor of {values.numel()} ({tuple(values.shape)})"
        )
    with torch._C.DisableTorchFunctionSubclass():
        flat = values.detach().reshape(-1).to(unit.dtype)
    owner.write_share(unit, index, flat)


def make_shard(
    unit: Any, index: int, view: Optional[torch.Tensor], numel: int, location: Optional[str]
) -> ParamShard:
    """Parameter `index` of `unit`: its `ds_tensor`, `view` (its share inside the memory partition) or,
    None, an empty placeholder of the unit's dtype; `numel` its share's element count; `location`
    DeepSpeed's `final_location`."""
    resident = view is not None
    t = (view if view is not None else torch.empty(0, dtype=unit.dtype)).as_subclass(ParamShard)
    t.ds_numel = numel
    t.final_location = location
    t._ds_unit = weakref.ref(unit)
    t._ds_index = index
    t._ds_resident = resident
    return t


def retire_shard(shard: Any, dtype: torch.dtype) -> None:
    """Its partitioner closed: the shard keeps no view of memory given back to the pool (it becomes an
    empty placeholder, in place) and refuses writes."""
    if not isinstance(shard, ParamShard):
        return
    with torch._C.DisableTorchFunctionSubclass():
        torch._C.TensorBase.data.__set__(shard, torch.empty(0, dtype=dtype))
    shard._ds_unit = None
    shard._ds_resident = False
    shard.final_location = None
