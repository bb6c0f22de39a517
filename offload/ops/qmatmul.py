"""Group-wise quantized weights on the CPU: decode to fp32, and x @ W^T (x @ W) straight from the codes.

The layout is the stage-3 one (zero/stage3/quant.py): codes of `bits` 8 (one per byte) or 4 (two per
byte, the first element in the high nibble), one float16 scale and, asymmetric, one float16 offset per
`group` consecutive elements; value = offset + code * scale, or (code - 2^(bits-1)) * scale symmetric.

`dequantize_into` is bit-identical to zero.stage3.quant.dequantize (both round the product before adding
the offset). `quantized_linear` computes a product one of two ways, both from the codes:

* Few input rows (fewer than `BLOCK_DECODE_MIN_ROWS`: decoding tokens): the weight is never materialized.
  Each group's codes are decoded in registers and used against every input row at once, so the forward
  reads `bits / 32` of the bytes an fp32 weight would. Its sums run in an order of its own: results match
  decode + matmul to fp32 rounding, not bit for bit.
* Many rows (a prefill), where that kernel is compute-bound and slower than an fp32 GEMM: the weight is
  decoded a block of rows at a time into a buffer of about `BLOCK_BYTES` (a few MiB, so it stays in the
  CPU's cache) and multiplied as `W_block @ x^T` by torch's GEMM, the orientation MKL runs fastest with
  few columns (zero/stage3/linear_layout.py). Measured 1.1-1.7x faster than the register kernel at 64
  rows of the 7B shapes (docs/inference.md); the values are decode + matmul's.

`quantized_conv1d` is the product of transformers' Conv1D (`x @ W` with W stored [in, out]): its groups
run along the outputs rather than along the sums, so it always takes the block-wise form, each block of
W's rows adding `x[:, block] @ W_block` into the result.

With `int8_activations` the input rows are rounded to int8 per group and multiplied with the codes in
integer arithmetic (vpmaddubsw), one fp32 scaling per group, at every row count (benchmarks/bench_qmatmul.py:
1.9-2.5x faster than the register kernel below 32 rows, 1.0-1.3x faster than the block-wise form from 32
rows on), with the activations' rounding error.
The kernels run on the C++ thread pool (offload.ops' `set_num_threads`), AVX2 where the CPU has it and
the group size is a multiple of 16 (int4) or 8 (int8), and 64 / 32 for int8 activations.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from offload import _cpu_optim

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_DECODE_MIN_ROWS",
    "decodes_in_blocks",
    "dequantize_into",
    "quantized_conv1d",
    "quantized_linear",
]

# Input rows from which an fp32-activation product decodes the weight block by block for torch's GEMM
# (the crossover measured with benchmarks/bench_qmatmul.py on AVX2: the register kernel wins at 16 rows)
BLOCK_DECODE_MIN_ROWS = 32
# fp32 bytes of weight decoded per block: small enough to stay in cache between the decode and the GEMM
BLOCK_BYTES = 8 << 20

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


def decodes_in_blocks(input_rows: int, int8_activations: bool = False) -> bool:
    """Whether `quantized_linear` with `input_rows` rows (the product of x's leading dimensions) decodes
    the weight block by block for torch's GEMM rather than computing in registers from the codes."""
    return not int8_activations and input_rows >= BLOCK_DECODE_MIN_ROWS


def _check_product_args(x: torch.Tensor, weight_dtype: torch.dtype) -> None:
    if weight_dtype not in _ROUND_TO:
        raise ValueError(f"weight_dtype must be one of {sorted(map(str, _ROUND_TO))}, got {weight_dtype}")
    if x.device.type != "cpu" or not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point CPU tensor, got {x.dtype} on {x.device}")


def _finish(
    y: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor, out_features: int
) -> torch.Tensor:
    """The fp32 product [rows, out_features] plus `bias`, in x's dtype and leading dimensions."""
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _decoded_blocks(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    bits: int,
    group: int,
    rows: int,
    cols: int,
    weight_dtype: torch.dtype,
) -> Iterator[Tuple[int, int, torch.Tensor]]:
    """(r0, r1, W[r0:r1]) over the row-major [rows, cols] weight, each block of about BLOCK_BYTES decoded
    as `dequantize_into` decodes it and rounded to `weight_dtype`, into one buffer that every block
    reuses (use a block before taking the next). `cols` is a whole number of groups."""
    step = max(1, min(rows, BLOCK_BYTES // (cols * 4)))
    per_row = cols // group  # groups (scales, offsets) per weight row
    row_bytes = cols * bits // 8
    buf = torch.empty(step * cols, dtype=torch.float32)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        block = buf[: (r1 - r0) * cols]
        dequantize_into(
            block,
            codes[r0 * row_bytes : r1 * row_bytes],
            scale[r0 * per_row : r1 * per_row],
            offset[r0 * per_row : r1 * per_row] if offset is not None else None,
            bits,
            group,
        )
        if weight_dtype != torch.float32:
            block.copy_(block.to(weight_dtype))  # the value a decode into a model-dtype buffer holds
        yield r0, r1, block.view(r1 - r0, cols)


def _decoded_blocks_product(
    flat: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    bits: int,
    group: int,
    out_features: int,
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """`flat @ W^T` [rows, out_features] (contiguous fp32) for W [out_features, in_features]: each decoded
    block of W's rows multiplied as `W_block @ flat^T`."""
    out_t = torch.empty(out_features, flat.shape[0], dtype=torch.float32)
    flat_t = flat.t()
    blocks = _decoded_blocks(codes, scale, offset, bits, group, out_features, flat.shape[1], weight_dtype)
    for r0, r1, block in blocks:
        torch.mm(block, flat_t, out=out_t[r0:r1])
    return out_t.t().contiguous()


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
    result has x's dtype. From `BLOCK_DECODE_MIN_ROWS` input rows on, the weight is decoded a block of
    rows at a time and multiplied by torch's GEMM (`decodes_in_blocks`; module docstring).

    `int8_activations`: each group of `group` values of a row of x is rounded to int8 (scale max|x| / 127,
    half to even) and multiplied with the weight codes in integer arithmetic, one fp32 scaling per group:
    the product of the decoded weights with the rounded activations. Faster (AVX2: groups of a multiple
    of 64 with int4, 32 with int8), at the cost of the activations' rounding error; `weight_dtype` is not
    used."""
    _check_product_args(x, weight_dtype)
    cols = x.shape[-1]
    if cols % group:
        raise ValueError(f"in_features {cols} is not a whole number of groups of {group}")
    _check_consts(codes, scale, offset, bits, group, out_features * cols)
    flat = x.reshape(-1, cols).to(torch.float32).contiguous()
    if decodes_in_blocks(flat.shape[0], int8_activations):
        y = _decoded_blocks_product(flat, codes, scale, offset, bits, group, out_features, weight_dtype)
        return _finish(y, bias, x, out_features)
    y = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
    args = (_addr(codes), _addr(scale), _addr(offset), bits, group, out_features, cols)
    if int8_activations:
        _cpu_optim.quantized_matmul_int8_activations(*args, _addr(flat), flat.shape[0], _addr(y))
    else:
        _cpu_optim.quantized_matmul_f32(*args, _addr(flat), flat.shape[0], _addr(y), _ROUND_TO[weight_dtype])
    return _finish(y, bias, x, out_features)


def quantized_conv1d(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: Optional[torch.Tensor],
    bits: int,
    group: int,
    out_features: int,
    bias: Optional[torch.Tensor] = None,
    weight_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`x @ W + bias` for the row-major [in_features, out_features] weight W of transformers' Conv1D
    (GPT-2) stored as (codes, scale, offset); in_features is x's last dimension, and out_features must be
    a multiple of `group` (each weight row whole groups). The groups run along the output features, not
    along the sums, so the register kernels do not apply: at any row count, blocks of W's rows are decoded
    (as `dequantize_into`, rounded to `weight_dtype`) and torch's GEMM adds up `x[:, block] @ W_block`.
    Sums in fp32, in block order: the result matches decode + matmul to fp32 rounding. It has x's dtype."""
    _check_product_args(x, weight_dtype)
    if out_features % group:
        raise ValueError(f"out_features {out_features} is not a whole number of groups of {group}")
    in_features = x.shape[-1]
    _check_consts(codes, scale, offset, bits, group, in_features * out_features)
    flat = x.reshape(-1, in_features).to(torch.float32)
    y = torch.zeros(flat.shape[0], out_features, dtype=torch.float32)
    for r0, r1, block in _decoded_blocks(
        codes, scale, offset, bits, group, in_features, out_features, weight_dtype
    ):
        y.addmm_(flat[:, r0:r1], block)
    return _finish(y, bias, x, out_features)
