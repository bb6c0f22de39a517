"""The ``"data_types"`` section and ``gradient_allreduce_op``: how gradients are accumulated and reduced.

``data_types.grad_accum_dtype`` (DeepSpeed: the dtype gradients are accumulated in over micro-batches) is
honoured where the engine accumulates in that dtype and refused elsewhere, naming the placement that does:

* fp32 models accumulate in fp32;
* fp16/bf16 models at stages 2-3 with ``offload_optimizer.device`` cpu or nvme add each backward's gradients
  into the rank's fp32 gradient partition in host memory: fp32 accumulation (a 16-bit request there is
  accepted with a warning: the sums are kept more precisely than asked);
* fp16/bf16 models elsewhere accumulate in the model dtype.

``param_dtype``, ``buffer_dtype`` and ``keep_in_fp32_modules`` are accepted only unset (the model dtype is
the precision section's; buffers keep theirs).

``gradient_allreduce_op``: "mean" (DeepSpeed's default, what the engine does: gradients are averaged over
ranks); "sum" is the same on one rank and refused with several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ._reader import ConfigError, Context, Section

__all__ = ["DataTypesConfig", "grad_accum_dtype_used", "parse_allreduce_op", "parse_data_types"]

_DTYPE_NAMES = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
}
_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")


@dataclass(frozen=True)
class DataTypesConfig:
    """`grad_accum_dtype`: "fp32", "fp16" or "bf16" as validated (None: not given)."""

    grad_accum_dtype: Optional[str] = None


def grad_accum_dtype_used(model_dtype: str, stage: int, offload_device: str) -> str:
    """The dtype the engine accumulates gradients in for this placement (see the module doc)."""
    if model_dtype == "fp32" or (stage >= 2 and offload_device in ("cpu", "nvme")):
        return "fp32"
    return model_dtype


def _dtype(s: Section, name: str) -> str:
    value = s.get(name)
    if isinstance(value, str):
        for canon, names in _DTYPE_NAMES.items():
            if value.lower() in names:
                return canon
    raise s.fail(name, f"must be one of fp32, fp16, bf16 (or torch's names for them), got {value!r}")


def parse_data_types(
    raw: Any, ctx: Context, model_dtype: str, stage: int, offload_device: str
) -> DataTypesConfig:
    """Validate `data_types` against the placement (model dtype, stage, optimizer tier)."""
    s = Section(raw, "data_types", ctx, _KEYS)
    for name in _KEYS[1:]:
        s.off_only(name, lambda v: v is None, f"{name} (the model dtype is the fp16/bf16 section's)")
    if not s.has("grad_accum_dtype") or s.get("grad_accum_dtype") is None:
        return DataTypesConfig()
    want = _dtype(s, "grad_accum_dtype")
    used = grad_accum_dtype_used(model_dtype, stage, offload_device)
    if want == used:
        return DataTypesConfig(grad_accum_dtype=want)
    if want == "fp32":
        raise s.fail(
            "grad_accum_dtype",
            f"fp32 accumulation of a {model_dtype} model happens at stages 2-3 with"
            f" zero_optimization.offload_optimizer.device cpu or nvme (gradients are summed into an fp32"
            f" partition in host memory); at stage {stage} with offload_optimizer {offload_device!r} they"
            f" accumulate in {used}: change the placement, or remove the key",
        )
    if used == "fp32" and want == model_dtype:
        ctx.warn_once(
            s.key("grad_accum_dtype"),
            f"config key '{s.key('grad_accum_dtype')}' = {want!r}: with offload_optimizer {offload_device!r}"
            f" at stage {stage} gradients accumulate in fp32, more precisely than asked",
        )
        return DataTypesConfig(grad_accum_dtype=used)
    raise s.fail(
        "grad_accum_dtype",
        f"{want} accumulation of a {model_dtype} model is not supported: gradients accumulate in {used} here"
        f" ({model_dtype} or fp32 can be asked for)",
    )


def parse_allreduce_op(value: Any, ctx: Context, world_size: int) -> str:
    """`gradient_allreduce_op`: "mean" or "sum" (case-insensitive, as DeepSpeed); "sum" only on one rank."""
    op = value.lower() if isinstance(value, str) else value
    if op not in ("mean", "sum"):
        raise ConfigError(f"gradient_allreduce_op in {ctx.source}: must be 'mean' or 'sum', got {value!r}")
    if op == "sum" and world_size > 1:
        raise ConfigError(
            f"gradient_allreduce_op 'sum' in {ctx.source}: gradients are averaged over the {world_size} ranks"
            " ('mean'); for summed gradients multiply the loss by the world size and remove the key"
        )
    return op
