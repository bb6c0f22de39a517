"""Group-wise int8/int4 quantization of stage-3 partitions (the config's `weight_quantization`).

A quantized unit stores its partition encoded instead of in the model dtype: the weight of a Linear,
Embedding or transformers Conv1D module as integer codes with one float16 scale (and, asymmetric, one
float16 offset) per `group_size` consecutive elements, two int4 codes per byte; the module's other
parameters (a bias) and any padding as raw model-dtype values. The store reads those bytes from its tier
and `PartitionCodec.decode` turns them into model-dtype values on the compute device (torch ops; into
fp32 on the CPU the C++ kernel of offload.ops.qmatmul, bit-identical), just before the module runs; on
the CPU an inference forward of an nn.Linear or nn.Embedding reads the codes directly instead
(zero/stage3/fused.py). Rank partitions are encoded independently, so a gather with several ranks
all-gathers decoded values.

Stored bytes of a unit's partition (`PartitionCodec.nbytes`, rounded up to 8 so that the next partition
in a memory segment stays aligned): for each quantized slice of n elements, G = ceil(n / group_size)
groups, G * group_size * bits / 8 bytes of codes and 2 * G bytes per constant (scale; offset unless
symmetric); every other element at the model dtype's size.

Encoding (asymmetric): per group, offset m = min rounded to float16, scale s = (max - m) / (2^bits - 1)
rounded up to float16 (at least 2^-14, float16's smallest normal), code = clamp(round((w - m) / s)); value
= m + code * s, so |w - value| <= s / 2 + |min - m|. Symmetric: s = max|w| / (2^(bits-1) - 1) rounded up,
code = round(w / s), |w - value| <= s / 2. A group's padding (the last group of a slice) repeats its last
element. Weights beyond float16's range cannot be described and are refused, naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from offload.config._reader import ConfigError
from offload.config.quantization import WeightQuantizationConfig, WeightQuantSpec
from offload.ops.qmatmul import dequantize_into
from zero.stage3.unit import chunk_range, param_shares

__all__ = [
    "segment_totals",
    "PartitionCodec",
    "QuantTarget",
    "dequantize",
    "quantization_plan",
    "planned_nbytes",
    "quantize",
    "quantized_nbytes",
    "unit_codec",
]

_CHUNK = 1 << 18  # elements encoded or decoded at once: bounds the float32 temporaries (1 MiB each)
_F16_MAX = 65504.0
_MIN_SCALE = 2.0**-14  # float16's smallest normal: the scale never loses precision to subnormals
_ROUND_UP = 1.0 + 2.0**-10  # a float32 scale times this, rounded to float16, is >= the float32 scale


@dataclass(frozen=True)
class QuantTarget:
    """One module whose weight is quantized: its settings, the weight's qualified name, the sizes of the
    parameters its unit will hold (its own, not owned by an earlier module) and the weight's index there."""

    spec: WeightQuantSpec
    param: str  # qualified name of the weight ("model.layers.0.mlp.up_proj.weight")
    numels: Tuple[int, ...]
    index: int


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is transformers' Conv1D (GPT-2): a Linear whose weight is stored transposed,
    [in_features, out_features], computing `x @ W + b` (checked by name: transformers is not imported)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _is_quantizable(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module)


def quantization_plan(model: nn.Module, wq: WeightQuantizationConfig) -> Dict[str, QuantTarget]:
    """Module name -> QuantTarget for every module whose weight `wq` selects: every Linear, Embedding and
    transformers Conv1D (`quantized_initialization`), or those whose qualified name contains a
    `post_init_quant` key (two keys matching one name: ConfigError). Only floating-point 2-D weights.
    A weight shared by several modules (a tied head) belongs to its first module: it is quantized when
    that one is selected."""
    plan: Dict[str, QuantTarget] = {}
    seen: Set[int] = set()
    for name, module in model.named_modules():
        own = [p for p in dict.fromkeys(module._parameters.values()) if p is not None and id(p) not in seen]
        seen.update(id(p) for p in own)
        weight = module._parameters.get("weight") if _is_quantizable(module) else None
        if weight is None or weight.dim() != 2 or not weight.is_floating_point():
            continue
        if not any(p is weight for p in own):
            continue  # owned by an earlier module (a tied head): quantized with that one, if at all
        spec = wq.quantized_initialization
        if wq.post_init_quant is not None:
            keys = [k for k in wq.post_init_quant if k in name]
            if len(keys) > 1:
                raise ConfigError(
                    f"weight_quantization.post_init_quant: module {name!r} matches the keys {keys[0]!r} and "
                    f"{keys[1]!r}; make the keys specific enough that each module matches one"
                )
            spec = wq.post_init_quant[keys[0]] if keys else None
        if spec is not None and spec.group_dim != weight.dim() - 1:  # the parser allows only 1
            raise ConfigError(
                f"weight_quantization: group_dim {spec.group_dim} for {name!r}: groups run along "
                "the last (contiguous) dimension of the weight"
            )
        if spec is not None:
            index = next(i for i, p in enumerate(own) if p is weight)
            numels = tuple(p.numel() for p in own)
            plan[name] = QuantTarget(spec, f"{name}.weight" if name else "weight", numels, index)
    return plan


def _codes_nbytes(groups: int, spec: WeightQuantSpec) -> int:
    return groups * spec.group_size * spec.num_bits // 8


def _consts(spec: WeightQuantSpec) -> int:
    return 1 if spec.symmetric else 2


def quantized_nbytes(numel: int, spec: WeightQuantSpec) -> int:
    """Bytes of `numel` consecutive weight elements quantized with `spec` (codes and constants)."""
    groups = -(-numel // spec.group_size)
    return _codes_nbytes(groups, spec) + 2 * _consts(spec) * groups


# ------------------------------------------------------------------------------------------ the math
def _pad_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` (1-D) as [groups, group], the last group padded with its last element."""
    pad = -x.numel() % group
    if pad:
        x = torch.cat([x, x[-1:].expand(pad)])
    return x.view(-1, group)


def _check_range(values: torch.Tensor, what: str) -> None:
    """`values`: the groups' extremes (amin/amax/abs-max propagate nan, so checking them is enough)."""
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{what}: cannot be quantized: it holds inf or nan")
    if float(values.abs().max()) > _F16_MAX:
        raise ValueError(
            f"{what}: cannot be quantized: it holds values beyond {_F16_MAX:g}, which the float16 scales "
            "and offsets cannot describe"
        )


def quantize(
    x: torch.Tensor, spec: WeightQuantSpec, what: str = "tensor"
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(codes uint8, scales float16, offsets float16 or None when symmetric) of the 1-D tensor `x` in groups
    of `spec.group_size` (the last padded); int4 codes two per byte (the first in the high nibble)."""
    g = _pad_groups(x.detach().reshape(-1).float(), spec.group_size)
    if spec.symmetric:
        qpos = (1 << (spec.num_bits - 1)) - 1
        absmax = g.abs().amax(1)
        _check_range(absmax, what)
        scale = (absmax / qpos * _ROUND_UP).clamp_(min=_MIN_SCALE).half()
        codes = (g / scale.float()[:, None]).round_().clamp_(-qpos, qpos).add_(qpos + 1)
        offset = None
    else:
        qmax = (1 << spec.num_bits) - 1
        lo, hi = g.aminmax(dim=1)
        _check_range(torch.cat([lo, hi]), what)
        offset = lo.half()
        span = hi - offset.float()
        scale = (span / qmax * _ROUND_UP).clamp_(min=_MIN_SCALE).half()
        codes = (g - offset.float()[:, None]).div_(scale.float()[:, None]).round_().clamp_(0, qmax)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{what}: cannot be quantized: a group spans more than float16's range")
    codes = codes.to(torch.uint8).reshape(-1)
    if spec.num_bits == 4:
        codes = (codes[0::2] << 4) | codes[1::2]
    return codes, scale, offset


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    spec: WeightQuantSpec,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The `numel` values (in `dtype`) that `quantize` encoded as (codes, scale, offset)."""
    if spec.num_bits == 4:
        codes = torch.stack([codes >> 4, codes & 0xF], dim=1).reshape(-1)
    q = codes.view(-1, spec.group_size).float()
    if spec.symmetric:
        q.sub_(1 << (spec.num_bits - 1))
        values = q.mul_(scale.float()[:, None])
    else:
        values = q.mul_(scale.float()[:, None]).add_(offset.float()[:, None])  # type: ignore[union-attr]
    return values.reshape(-1)[:numel].to(dtype)


# ------------------------------------------------------------------------------------- the byte layout
@dataclass(frozen=True)
class _Raw:
    lo: int  # elements [lo, hi) of the partition, model dtype, at byte `at`
    hi: int
    at: int


@dataclass(frozen=True)
class _Quant:
    lo: int
    hi: int
    param: int  # index of the parameter in its unit
    groups: int
    scale_at: int
    offset_at: int  # -1: symmetric
    codes_at: int


class PartitionCodec:
    """The byte layout of one unit's stored partition and its encoding/decoding (module docstring)."""

    def __init__(
        self,
        part_numel: int,
        slices: Sequence[Tuple[int, int, int, bool]],
        spec: WeightQuantSpec,
        dtype: torch.dtype,
        name: str = "unit",
    ) -> None:
        """`slices`: (partition lo, hi, parameter index, quantized) of each parameter's share, in any
        order; elements of the partition outside them (padding) are stored raw."""
        self.spec, self.dtype, self.part_numel, self.name = spec, dtype, part_numel, name
        esize = torch.empty((), dtype=dtype).element_size()
        covered = sorted(slices)
        raw_ranges: List[Tuple[int, int]] = []
        quant: List[Tuple[int, int, int]] = []
        at = 0
        for lo, hi, index, quantized in covered:
            if lo > at:
                raw_ranges.append((at, lo))
            if quantized:
                quant.append((lo, hi, index))
            else:
                raw_ranges.append((lo, hi))
            at = max(at, hi)
        if at < part_numel:
            raw_ranges.append((at, part_numel))
        off = 0
        self.raw: List[_Raw] = []
        for lo, hi in raw_ranges:
            self.raw.append(_Raw(lo, hi, off))
            off += (hi - lo) * esize
        consts = []
        for lo, hi, index in quant:  # float16 constants first: 2-byte aligned after the raw values
            groups = -(-(hi - lo) // spec.group_size)
            scale_at = off
            off += 2 * groups
            offset_at = -1
            if not spec.symmetric:
                offset_at = off
                off += 2 * groups
            consts.append((lo, hi, index, groups, scale_at, offset_at))
        self.quant: List[_Quant] = []
        for lo, hi, index, groups, scale_at, offset_at in consts:
            self.quant.append(_Quant(lo, hi, index, groups, scale_at, offset_at, off))
            off += _codes_nbytes(groups, spec)
        self.nbytes = -(-off // 8) * 8
        self.quantized_numel = sum(q.hi - q.lo for q in self.quant)

    @property
    def params(self) -> Set[int]:
        """Indices of the parameters whose share is quantized."""
        return {q.param for q in self.quant}

    def _f16(self, stored: torch.Tensor, at: int, n: int) -> torch.Tensor:
        return stored[at : at + 2 * n].view(torch.float16)

    def encode(self, values: torch.Tensor, stored: torch.Tensor, only: Optional[Set[int]] = None) -> None:
        """Write the partition `values` (part_numel elements, model dtype) encoded into `stored` (uint8,
        `nbytes`, on any device). `only`: the parameters whose quantized share is (re-)encoded; the
        others keep what `stored` holds (raw elements are always written: they round-trip exactly)."""
        values = values.reshape(-1)
        esize = values.element_size()
        for r in self.raw:
            stored[r.at : r.at + (r.hi - r.lo) * esize].view(self.dtype).copy_(values[r.lo : r.hi])
        g = self.spec.group_size
        per = max(1, _CHUNK // g)  # groups per chunk
        for q in self.quant:
            if only is not None and q.param not in only:
                continue
            what = f"{self.name}: parameter {q.param}"
            for first in range(0, q.groups, per):
                n = min(per, q.groups - first)
                lo = q.lo + first * g
                hi = min(q.hi, lo + n * g)
                codes, scale, offset = quantize(values[lo:hi], self.spec, what)
                c0 = q.codes_at + _codes_nbytes(first, self.spec)
                stored[c0 : c0 + codes.numel()].copy_(codes)
                self._f16(stored, q.scale_at + 2 * first, n).copy_(scale)
                if offset is not None:
                    self._f16(stored, q.offset_at + 2 * first, n).copy_(offset)

    def decode(self, stored: torch.Tensor, out: torch.Tensor, quantized: bool = True) -> None:
        """Write the partition's values (model dtype) into `out` (part_numel elements, same device as
        `stored`). `quantized=False`: only the raw elements (a bias); the quantized shares of `out` are left
        as they are (`operands` serves them to a product that reads the codes). Into fp32 on the CPU the codes
        are decoded by the C++ kernel (offload.ops.qmatmul, bit-identical to `dequantize`)."""
        out = out.reshape(-1)
        esize = out.element_size()
        for r in self.raw:
            out[r.lo : r.hi].copy_(stored[r.at : r.at + (r.hi - r.lo) * esize].view(self.dtype))
        if not quantized:
            return
        g = self.spec.group_size
        per = max(1, _CHUNK // g)
        for q in self.quant:
            if out.device.type == "cpu" and out.dtype == torch.float32:
                codes, scale, offset = self._operands(stored, q)
                dequantize_into(out[q.lo : q.hi], codes, scale, offset, self.spec.num_bits, g)
                continue
            for first in range(0, q.groups, per):
                n = min(per, q.groups - first)
                lo = q.lo + first * g
                hi = min(q.hi, lo + n * g)
                c0 = q.codes_at + _codes_nbytes(first, self.spec)
                codes = stored[c0 : c0 + _codes_nbytes(n, self.spec)]
                scale = self._f16(stored, q.scale_at + 2 * first, n)
                offset = None if q.offset_at < 0 else self._f16(stored, q.offset_at + 2 * first, n)
                out[lo:hi].copy_(dequantize(codes, scale, offset, self.spec, hi - lo, out.dtype))

    def _operands(
        self, stored: torch.Tensor, q: _Quant
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        codes = stored[q.codes_at : q.codes_at + _codes_nbytes(q.groups, self.spec)]
        scale = self._f16(stored, q.scale_at, q.groups)
        offset = None if q.offset_at < 0 else self._f16(stored, q.offset_at, q.groups)
        return codes, scale, offset

    def operands(
        self, stored: torch.Tensor, param: int
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(codes, scales, offsets or None) of parameter `param`'s quantized share: views of `stored`."""
        q = next(q for q in self.quant if q.param == param)
        return self._operands(stored, q)

    def covers(self, param: int, lo: int, numel: int, row: int) -> bool:
        """Whether parameter `param` is quantized whole - its `numel` elements from partition element `lo`
        in one share - with every row of `row` elements made of whole groups (what a product straight
        from the codes needs)."""
        return any(
            q.param == param and q.lo == lo and q.hi - q.lo == numel and row % self.spec.group_size == 0
            for q in self.quant
        )


def unit_codec(unit: Any, target: Optional[QuantTarget]) -> Optional[PartitionCodec]:
    """The codec of `unit` (a zero.stage3.unit.Unit) when `target` selects one of its parameters."""
    if target is None or target.param not in unit.param_names:
        return None
    index = unit.param_names.index(target.param)
    slices = [
        (s.part_lo, s.part_hi, i, i == index) for i, s in enumerate(_slices_by_param(unit)) if s is not None
    ]
    return PartitionCodec(unit.part_numel, slices, target.spec, unit.dtype, unit.name)


def _slices_by_param(unit: Any) -> List[Any]:
    by_name = {s.name: s for s in unit.slices()}
    return [by_name.get(n) for n in unit.param_names]


def planned_nbytes(
    numels: Sequence[int], target_index: int, world_size: int, rank: int, spec: WeightQuantSpec, dtype: Any
) -> int:
    """`PartitionCodec.nbytes` of a unit not built yet: parameters of `numels` (the one at `target_index`
    quantized), this rank's partition of them split over `world_size` ranks (zero.stage3.unit)."""
    chunks, starts, part_numel = param_shares(numels, world_size, rank)
    slices = []
    for i, (n, c, at) in enumerate(zip(numels, chunks, starts)):
        lo, hi = chunk_range(n, c, rank)
        if lo < hi:
            slices.append((at, at + hi - lo, i, i == target_index))
    return PartitionCodec(part_numel, slices, spec, dtype).nbytes


def segment_totals(
    units: Sequence[Any], keep: Sequence[bool], plan: Dict[str, QuantTarget], rank: int
) -> Dict[torch.dtype, int]:
    """Elements per storage dtype of the `units` kept in memory (Units or UnitSizes: `name`, `dtype`,
    `part_numel`, `world_size`): a unit `plan` quantizes as its codec's bytes (uint8), any other as its
    partition's elements in its own dtype."""
    totals: Dict[torch.dtype, int] = {}
    for u, k in zip(units, keep):
        if not k:
            continue
        t = plan.get(u.name)
        if t is not None:
            n = planned_nbytes(t.numels, t.index, u.world_size, rank, t.spec, u.dtype)
            totals[torch.uint8] = totals.get(torch.uint8, 0) + n
        else:
            totals[u.dtype] = totals.get(u.dtype, 0) + u.part_numel
    return totals
