"""Group-wise quantized weights on the CPU: decode to fp32, and x @ W^T straight from the codes.

The layout is the stage-3 one (zero/stage3/quant.py): codes of `bits` 8 (one per byte) or 4 (two per
byte, the first element in the high nibble), one float16 scale and, asymmetric, one float16 offset per
`group` consecutive elements; value = offset + code * scale, or (code - 2^(bits-1)) * scale symmetric.

`dequantize_into` is bit-identical to zero.stage3.quant.dequantize (both round the product before adding
the offset). `quantized_linear` never materializes the weight: each group's codes are decoded in registers
and used against every input row at once, so a forward with a few rows (decoding tokens) reads
`bits / 32` of the bytes an fp32 weight would. With many rows (a prefill) it is compute-bound, about 1.3x
the time of torch's fp32 matmul of the decoded weight (a block-wise decode + torch matmul measured no
faster in the engine: benchmarks/RESULTS.md). Its sums run in an order of its own: results match decode +
matmul to fp32 rounding, not bit for bit. With `int8_activations` the input rows are rounded to int8 per
group and multiplied with the codes in integer arithmetic (vpmaddubsw), one fp32 scaling per group:
1.8-2.6x faster in benchmarks/bench_qmatmul.py, with the activations' rounding error.
The kernels run on the C++ thread pool (offload.ops' `set_num_threads`), AVX2 where the CPU has it and
the group size is a multiple of 16 (int4) or 8 (int8), and 64 / 32 for int8 activations.
"""

from __future__ import annotations

from typing import Optional

import torch

from offload import _cpu_optim

__all__ = ["dequantize_into", "quantized_linear"]

# model dtype -> the kernel's dtype code for rounding each decoded weight
_ROUND_TO = {torch.float32: _cpu_optim.F32, torch.bfloat16: _cpu_optim.BF16, torch.float16: _cpu_optim.F16}


def _addr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check_consts(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    bits: int,
    group: int,
    n: int,
) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group <= 0 or bits == 4 and group % 2:
        raise ValueError(f"group size {group} must be positive (and even with 4 bits)")
    groups = -(-n // group)
    for name, t, dtype, need in (
        ("codes", codes, torch.uint8, groups * group * bits // 8),
        ("scale", scale, torch.float16, groups),
        ("offset", offset, torch.float16, groups),
    ):
        if t is None:
            continue
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}")
        if t.numel() < need:
            raise ValueError(f"{name}: {n} elements in groups of {group} need {need} values, got {t.numel()}")


def dequantize_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    bits: int,
    group: int,
) -> torch.Tensor:
    """Decode `out.numel()` elements into `out` (contiguous CPU float32); returns `out`."""
    if out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous CPU float32 tensor, got {out.dtype} on {out.device}")
    _check_consts(codes, scale, offset, bits, group, out.numel())
    _cpu_optim.dequantize_f32(_addr(codes), _addr(scale), _addr(offset), bits, group, out.numel(), _addr(out))
    return out


def quantized_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    bits: int,
    group: int,
    out_features: int,
    bias: Optional[torch.Tensor] = None,
    weight_dtype: torch.dtype = torch.float32,
    int8_activations: bool = False,
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the row-major [out_features, in_features] weight W stored as (codes,
    scale, offset); in_features is x's last dimension and must be a multiple of `group`. Each weight is
    decoded as `dequantize_into` decodes it and rounded to `weight_dtype` (float32, bfloat16 or float16:
    the values a decode into a buffer of the model dtype holds); products and sums run in fp32, and the
    result has x's dtype.

    `int8_activations`: each group of `group` values of a row of x is rounded to int8 (scale max|x| / 127,
    half to even) and multiplied with the weight codes in integer arithmetic, one fp32 scaling per group:
    the product of the decoded weights with the rounded activations. Faster (AVX2: groups of a multiple
    of 64 with int4, 32 with int8), at the cost of the activations' rounding error; `weight_dtype` is not
    used."""
    if weight_dtype not in _ROUND_TO:
        raise ValueError(f"weight_dtype must be one of {sorted(map(str, _ROUND_TO))}, got {weight_dtype}")
    if x.device.type != "cpu" or not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point CPU tensor, got {x.dtype} on {x.device}")
    cols = x.shape[-1]
    if cols % group:
        raise ValueError(f"in_features {cols} is not a whole number of groups of {group}")
    _check_consts(codes, scale, offset, bits, group, out_features * cols)
    flat = x.reshape(-1, cols).to(torch.float32).contiguous()
    y = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
    args = (_addr(codes), _addr(scale), _addr(offset), bits, group, out_features, cols)
    if int8_activations:
        _cpu_optim.quantized_matmul_int8_activations(*args, _addr(flat), flat.shape[0], _addr(y))
    else:
        _cpu_optim.quantized_matmul_f32(*args, _addr(flat), flat.shape[0], _addr(y), _ROUND_TO[weight_dtype])
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)
