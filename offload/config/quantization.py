"""The ``"weight_quantization"`` section: DeepSpeed's ZeRO-Inference group-wise weight quantization.

DeepSpeed's two spellings, of which a config gives at most one:

* ``quantized_initialization``: one set of settings for the weight of every ``nn.Linear``, ``nn.Embedding``
  and transformers ``Conv1D`` module;
* ``post_init_quant``: ``{module-name substring: settings}``, only the modules whose qualified name contains
  one of the keys (a name matching two keys is an error when the model is wrapped).

Settings (DeepSpeed's names): ``num_bits`` (8 or 4), ``group_size`` (elements sharing one scale and offset),
``group_dim`` (1: groups run along the last, contiguous dimension of the 2-D weight; the only one supported)
and ``symmetric`` (false: scale and offset per group, codes 0..2^bits-1; true: scale only, codes
-(2^(bits-1)-1)..2^(bits-1)-1). An empty section, or ``{"quantized_initialization": null}``, leaves
quantization off. Whether the engine can apply it (stage 3, no optimizer) is the engine's decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ._reader import Context, Section

__all__ = ["WeightQuantSpec", "WeightQuantizationConfig", "parse_weight_quantization"]

_SPEC_KEYS = ("num_bits", "group_size", "group_dim", "symmetric")


@dataclass(frozen=True)
class WeightQuantSpec:
    """How one module's weight is quantized: bits per value, group size, group dimension, symmetry."""

    num_bits: int = 8
    group_size: int = 64
    group_dim: int = 1
    symmetric: bool = False


@dataclass(frozen=True)
class WeightQuantizationConfig:
    """At most one of the two is set; neither: quantization is off."""

    quantized_initialization: Optional[WeightQuantSpec] = None
    post_init_quant: Optional[Dict[str, WeightQuantSpec]] = None

    @property
    def enabled(self) -> bool:
        """Whether any weight is to be quantized."""
        return self.quantized_initialization is not None or self.post_init_quant is not None


def _spec(raw: Any, path: str, ctx: Context) -> WeightQuantSpec:
    s = Section(raw, path, ctx, _SPEC_KEYS)
    d = WeightQuantSpec
    bits = s.int("num_bits", d.num_bits)
    if bits not in (4, 8):
        raise s.fail("num_bits", f"must be 8 or 4 (int8 or int4 codes), got {bits}")
    group = s.int("group_size", d.group_size, min=1, max=1 << 24)
    if bits == 4 and group % 2:
        raise s.fail("group_size", f"must be even with num_bits 4 (two codes per byte), got {group}")
    dim = s.int("group_dim", d.group_dim)
    if dim != 1:
        raise s.not_supported(
            "group_dim",
            f"group_dim {dim} (groups run along dimension 1, the last and contiguous one of a 2-D weight)",
        )
    sym = s.bool("symmetric", d.symmetric)
    assert bits is not None and group is not None and sym is not None
    return WeightQuantSpec(num_bits=bits, group_size=group, group_dim=dim, symmetric=sym)


def parse_weight_quantization(raw: Any, ctx: Context) -> WeightQuantizationConfig:
    """Validate the `weight_quantization` section into a WeightQuantizationConfig."""
    s = Section(raw, "weight_quantization", ctx, ("quantized_initialization", "post_init_quant"))
    init = s.get("quantized_initialization")
    post = s.get("post_init_quant")
    if init is not None and post is not None:
        raise s.fail(
            "post_init_quant",
            "give either quantized_initialization (every Linear/Embedding weight) or post_init_quant "
            "(modules by name), not both",
        )
    if init is not None:
        return WeightQuantizationConfig(
            quantized_initialization=_spec(init, "weight_quantization.quantized_initialization", ctx)
        )
    if post is None:
        return WeightQuantizationConfig()
    by_name = s.mapping("post_init_quant")
    if not by_name:
        raise s.fail(
            "post_init_quant",
            'must map at least one module-name substring to its settings, e.g. {"mlp": {"num_bits": 4}}',
        )
    specs = {}
    for key, value in by_name.items():
        if not key:
            raise s.fail("post_init_quant", "an empty module-name key would match every module")
        specs[key] = _spec(value, f"weight_quantization.post_init_quant.{key}", ctx)
    return WeightQuantizationConfig(post_init_quant=specs)
