"""Quantized Linear, Conv1D and Embedding forwards that read the codes: no decoded weight in a CPU inference
forward.

With `weight_quantization`, a gather normally decodes a unit's codes into a model-dtype buffer and the
module runs on it. For an `nn.Linear`, transformers `Conv1D` or `nn.Embedding` whose weight is quantized
whole with rows of whole groups (one rank), an inference forward on the CPU (grad mode off) skips that:
the unit is gathered *encoded* - its stored bytes stay where they landed (the memory partition, or the
NVMe staging slot, lent to the unit until it is released), only its raw parameters (the bias) are
decoded - and the module's forward reads the codes:

* nn.Linear: `offload.ops.qmatmul.quantized_linear`, `x @ W^T + b` from the codes. A forward with a few
  rows (a decoding step) reads 1/8 (int4) or 1/4 (int8) of the bytes of an fp32 weight and writes none,
  where decode-then-matmul wrote and read the whole fp32 weight. A forward with many rows (a prefill)
  decodes the weight a cache-sized block of rows at a time for torch's GEMM. With
  `zero_offload.int8_activations` the input rows are rounded to int8 per group as well and multiplied in
  integer arithmetic.
* transformers' Conv1D (GPT-2; weight [in, out], groups along the outputs):
  `offload.ops.qmatmul.quantized_conv1d`, cache-sized blocks of weight rows decoded for torch's GEMM at
  any row count, fp32 activations.
* nn.Embedding: only the looked-up rows are decoded (the same values a whole decode gives), not the
  vocabulary.

A weight shared by several such modules (a tied head) is read from the codes by each of them. The weight
parameter of an encoded unit is left released (its `ds_status` says so): anything else that reads it
during the forward - a parent module using `child.weight`, a GatheredParameters block - fetches the unit
the usual way, which decodes the weight in place (`Stage3Partitioner.fetch`), and the modules then run
their own forwards. Training, backward and CUDA never take this path.

How: `QuantizedForwards` replaces the `forward` of each eligible module instance (the way accelerate's hooks
wrap a module's forward) with one that calls the original forward whenever its unit is not gathered
encoded. `remove()` puts the original forwards back.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from offload.ops.qmatmul import decodes_in_blocks, dequantize_into, quantized_conv1d, quantized_linear
from zero.stage3.forward_patch import ForwardPatches
from zero.stage3.quant import is_conv1d
from zero.stage3.store import PartitionStore
from zero.stage3.unit import Unit

__all__ = ["EncodedWeight", "QuantizedForwards"]


@dataclass
class EncodedWeight:
    """A gathered-encoded unit's quantized weight [rows, cols]: views of its stored bytes."""

    stored: torch.Tensor  # the unit's whole stored partition (raw values and codes)
    codes: torch.Tensor
    scale: torch.Tensor
    offset: Optional[torch.Tensor]
    bits: int
    group: int
    rows: int
    cols: int
    weight: int  # index of the weight among the unit's parameters


class _Forward:
    """The forward of one eligible module: from the codes when its unit is gathered encoded."""

    def __init__(self, owner: QuantizedForwards, module: nn.Module, unit: Unit, kernel: Callable) -> None:
        self.owner, self.module, self.unit, self.kernel = owner, module, unit, kernel
        self.original = module.forward

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # torch's name: `module(input=x)` works
        x = input
        enc: Optional[EncodedWeight] = self.unit.encoded
        if enc is None or x.device.type != "cpu" or torch.is_grad_enabled():
            return self.original(x)
        self.owner.forwards += 1
        rows = x.numel() // max(1, x.shape[-1])
        if self.kernel is _conv1d or (
            self.kernel is _linear and decodes_in_blocks(rows, self.owner.int8_activations)
        ):
            self.owner.block_forwards += 1
        return self.kernel(self.module, enc, self.unit.dtype, x, self.owner.int8_activations)


def _linear(
    module: nn.Module, enc: EncodedWeight, dtype: torch.dtype, x: torch.Tensor, int8_activations: bool
) -> torch.Tensor:
    return quantized_linear(
        x,
        enc.codes,
        enc.scale,
        enc.offset,
        enc.bits,
        enc.group,
        enc.rows,
        module.bias,
        dtype,
        int8_activations,
    )


def _conv1d(
    module: nn.Module, enc: EncodedWeight, dtype: torch.dtype, x: torch.Tensor, int8_activations: bool
) -> torch.Tensor:
    """Conv1D's `x @ W + b` (W [in, out]: its groups run along the outputs, so fp32 activations always)."""
    return quantized_conv1d(
        x, enc.codes, enc.scale, enc.offset, enc.bits, enc.group, enc.cols, module.bias, dtype
    )


def _embedding(
    module: nn.Module, enc: EncodedWeight, dtype: torch.dtype, ids: torch.Tensor, int8_activations: bool
) -> torch.Tensor:
    """F.embedding(ids, W) decoding only the rows looked up (ids out of range: IndexError, as torch's)."""
    flat = ids.reshape(-1)
    lo, hi = flat.aminmax() if flat.numel() else (None, None)
    if lo is not None and (int(lo) < 0 or int(hi) >= enc.rows):
        raise IndexError(f"index out of range in self: ids must lie in [0, {enc.rows})")
    per_row = enc.cols // enc.group
    codes = enc.codes.view(enc.rows, -1)[flat].reshape(-1)
    scale = enc.scale.view(enc.rows, per_row)[flat].reshape(-1)
    offset = enc.offset.view(enc.rows, per_row)[flat].reshape(-1) if enc.offset is not None else None
    out = torch.empty(flat.numel() * enc.cols, dtype=torch.float32)
    dequantize_into(out, codes, scale, offset, enc.bits, enc.group)
    return out.view(*ids.shape, enc.cols).to(dtype)


def _eligible(m: nn.Module) -> Optional[Tuple[Callable, int]]:
    """(kernel, row length) of a module whose forward may read codes: exactly nn.Linear, transformers'
    Conv1D, or nn.Embedding without max_norm (it renormalizes the weight in place); a subclass may compute
    differently."""
    if not ForwardPatches.free(m):
        return None
    if type(m) is nn.Linear:
        return _linear, m.in_features
    if is_conv1d(m):
        return _conv1d, m.nf
    if type(m) is nn.Embedding and m.max_norm is None:
        return _embedding, m.embedding_dim
    return None


class QuantizedForwards:
    """Finds a partitioner's eligible modules in `model` and wraps their forwards (above)."""

    def __init__(
        self,
        model: nn.Module,
        store: PartitionStore,
        owner: object,
        world_size: int,
        device: torch.device,
        int8_activations: bool,
    ) -> None:
        """Wraps every eligible module (`_eligible`) whose weight's unit belongs to `owner` (the
        partitioner) and is quantized in `store` with the weight whole and rows of whole groups, one rank.
        `int8_activations`: zero_offload.int8_activations."""
        self.forwards = 0  # forwards computed from the codes (read by the I/O report)
        self.block_forwards = 0  # of those, Linear/Conv1D forwards that decoded the weight block by block
        self._store = store
        # zero_offload.int8_activations: Linears round their input rows to int8 too (quantized_linear)
        self.int8_activations = int8_activations
        if self.int8_activations and (world_size != 1 or device.type != "cpu"):
            warnings.warn(
                "zero_offload.int8_activations is ignored: quantized Linears compute from their codes only "
                f"on the CPU with one rank (this engine: {device.type}, "
                f"{world_size} rank(s)); their weights are decoded instead",
                stacklevel=2,
            )
        self._patches = ForwardPatches()
        # unit index -> {module whose forward reads its codes: its weight's index in the unit}; kept so that
        # nothing here reads `module.weight`, which would count as a use of it (hooks._FetchOnAccess)
        self._owners: Dict[int, Dict[nn.Module, int]] = {}
        if world_size != 1:
            return
        for m in model.modules():
            kind = _eligible(m)
            weight = m._parameters.get("weight") if kind is not None else None
            unit = getattr(weight, "ds_unit", None)
            codec = store.codec(unit) if unit is not None and unit.owner is owner else None
            if codec is None:
                continue
            i = weight.ds_index
            if not codec.covers(i, unit.part_offsets[i], unit.numels[i], kind[1]):
                continue
            self._patches.set(m, _Forward(self, m, unit, kind[0]))
            self._owners.setdefault(unit.index, {})[m] = i

    def owns(self, module: nn.Module, unit: Unit) -> bool:
        """Whether `module`'s forward reads `unit`'s codes (so its fetch may gather it encoded)."""
        return module in self._owners.get(unit.index, ())

    def encoded_weight(self, unit: Unit, stored: torch.Tensor) -> EncodedWeight:
        """The EncodedWeight of an owned unit over its stored bytes `stored`."""
        i = next(iter(self._owners[unit.index].values()))
        codec = self._store.codec(unit)
        assert codec is not None
        codes, scale, offset = codec.operands(stored, i)
        rows, cols = unit.shapes[i]
        spec = codec.spec
        return EncodedWeight(stored, codes, scale, offset, spec.num_bits, spec.group_size, rows, cols, i)

    def remove(self) -> None:
        """Give every wrapped module its own forward back."""
        self._patches.remove()
        self._owners.clear()
