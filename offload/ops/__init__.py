"""CPU optimizers over C++ SIMD kernels (AVX-512, AVX2+FMA or portable scalar, chosen at import).

Optimizers: CPUAdam / CPUAdamW (DeepSpeedCPUAdam's interface), CPUAdagrad, CPULion.
Functional updates over flat contiguous CPU tensors: adam_update, adagrad_update, lion_update (states
fp32, bf16 with optional stochastic rounding, or 8-bit block-quantized: quantize_blockwise,
dequantize_blockwise, QUANT_BLOCK).
Switches: set_num_threads / get_num_threads, simd_level / force_simd_level (or ZO_SIMD=scalar|avx2|avx512).
"""

from ._runtime import (
    available_simd_levels,
    best_simd_level,
    force_simd_level,
    get_num_threads,
    set_num_threads,
    simd_level,
)
from .adagrad import CPUAdagrad
from .adam import CPUAdam, CPUAdamW
from .functional import adagrad_update, adam_update, grads_finite, lion_update
from .lion import CPULion
from .quant import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise

__all__ = [
    "CPUAdagrad",
    "CPUAdam",
    "CPUAdamW",
    "CPULion",
    "QUANT_BLOCK",
    "adagrad_update",
    "adam_update",
    "available_simd_levels",
    "best_simd_level",
    "dequantize_blockwise",
    "force_simd_level",
    "get_num_threads",
    "grads_finite",
    "lion_update",
    "quantize_blockwise",
    "set_num_threads",
    "simd_level",
]
