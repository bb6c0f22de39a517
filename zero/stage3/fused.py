"""Quantized nn.Linear forwards that read the codes: no decoded weight in an inference forward on the CPU.

With `weight_quantization`, a gather normally decodes a unit's codes into a model-dtype buffer and the
module runs on it. For an `nn.Linear` whose weight is quantized whole (one rank, every row made of whole
groups), an inference forward on the CPU (grad mode off, one rank) skips that: the unit is gathered
*encoded* - its stored bytes stay where they landed (the memory partition, or the NVMe staging slot, lent
to the unit until it is released), only its raw parameters (the bias) are decoded - and the module's
forward computes `x @ W^T + b` with offload.ops.qmatmul.quantized_linear straight from the codes. A
forward with a few rows (a decoding step) then reads 1/8 (int4) or 1/4 (int8) of the bytes of an fp32
weight and writes none, where decode-then-matmul wrote and read the whole fp32 weight.

The weight parameter of an encoded unit is left released (its `ds_status` says so): anything else that
reads it during the forward - a parent module using `child.weight`, a GatheredParameters block - fetches
the unit the usual way, which decodes the weight in place (`Stage3Partitioner.fetch`), and the module then
runs its own forward. Training, backward and CUDA never take this path.

How: `FusedLinears` replaces the `forward` of each eligible module instance with `_Forward` (the way
accelerate's hooks wrap a module's forward), which calls the original forward whenever its unit is not
gathered encoded. `remove()` puts the original forwards back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.ops.qmatmul import quantized_linear
from zero.stage3.unit import Unit

if TYPE_CHECKING:
    from zero.stage3.partitioner import Stage3Partitioner

__all__ = ["EncodedWeight", "FusedLinears"]


@dataclass
class EncodedWeight:
    """A gathered-encoded unit's quantized weight: views of its stored bytes and what the product needs."""

    stored: torch.Tensor  # the unit's whole stored partition (raw values and codes)
    codes: torch.Tensor
    scale: torch.Tensor
    offset: Optional[torch.Tensor]
    bits: int
    group: int
    out_features: int
    weight: int  # index of the weight among the unit's parameters


class _Forward:
    """The forward of one eligible nn.Linear: from the codes when its unit is gathered encoded."""

    def __init__(self, owner: FusedLinears, module: nn.Linear, unit: Unit) -> None:
        self.owner, self.module, self.unit = owner, module, unit
        self.original = module.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        enc: Optional[EncodedWeight] = getattr(self.unit, "encoded", None)
        if enc is None or x.device.type != "cpu":
            return self.original(x)
        self.owner.forwards += 1
        return quantized_linear(
            x,
            enc.codes,
            enc.scale,
            enc.offset,
            enc.bits,
            enc.group,
            enc.out_features,
            self.module.bias,
            self.unit.dtype,
        )


class FusedLinears:
    """Finds the partitioner's eligible nn.Linear modules in `model` and wraps their forwards (above)."""

    def __init__(self, partitioner: Stage3Partitioner, model: nn.Module) -> None:
        """Wraps every eligible module: exactly nn.Linear (a subclass may compute differently), one rank,
        its weight quantized whole in a unit of its own with rows of whole groups."""
        self.forwards = 0  # forwards computed from the codes (read by the I/O report)
        self._wrapped: List[Tuple[nn.Module, _Forward]] = []
        # unit index -> (the module whose forward reads its codes, its weight's index in the unit); kept so
        # that nothing here reads `module.weight`, which would count as a use of it (hooks._FetchOnAccess)
        self._owner: Dict[int, Tuple[nn.Module, int]] = {}
        store = partitioner.store
        if partitioner.world_size != 1:
            return
        for m in model.modules():
            if type(m) is not nn.Linear or "forward" in m.__dict__:
                continue
            unit = getattr(m.weight, "ds_unit", None)
            codec = store.codec(unit) if unit is not None and unit.owner is partitioner else None
            if codec is None:
                continue
            i = m.weight.ds_index
            lo, _ = unit.param_range(i)
            if not codec.covers(i, lo, unit.numels[i], m.in_features):
                continue
            fwd = _Forward(self, m, unit)
            m.forward = fwd
            self._wrapped.append((m, fwd))
            self._owner[unit.index] = (m, i)

    def owns(self, module: nn.Module, unit: Unit) -> bool:
        """Whether `module`'s forward reads `unit`'s codes (so its fetch may gather it encoded)."""
        owner = self._owner.get(unit.index)
        return owner is not None and owner[0] is module

    def encoded_weight(
        self, partitioner: Stage3Partitioner, unit: Unit, stored: torch.Tensor
    ) -> EncodedWeight:
        """The EncodedWeight of an owned unit over its stored bytes `stored`."""
        module, i = self._owner[unit.index]
        codec = partitioner.store.codec(unit)
        assert codec is not None
        codes, scale, offset = codec.operands(stored, i)
        spec = codec.spec
        return EncodedWeight(
            stored, codes, scale, offset, spec.num_bits, spec.group_size, module.out_features, i
        )

    def remove(self) -> None:
        """Give every wrapped module its own forward back."""
        for m, fwd in self._wrapped:
            if m.__dict__.get("forward") is fwd:
                del m.forward
        self._wrapped.clear()
        self._owner.clear()
