// Group-wise quantized weights (the stage-3 partitions of `weight_quantization`, zero/stage3/quant.py):
// decoding them to fp32, and a matrix product that reads the codes directly, for inference on the CPU.
// No torch, no Python: raw pointers and sizes. The per-ISA kernels live in kernels_qmatmul.cpp; the
// entry points below check their arguments, pick the ISA and split the work over the optimizer pool.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zo_optim {

// `n` consecutive weight elements in groups of `group`: `bits` 8 (one code per byte) or 4 (two per byte,
// the first element in the high nibble), one fp16 scale and, asymmetric, one fp16 offset per group.
// Value = offset + code * scale (asymmetric) or (code - 2^(bits-1)) * scale (symmetric, offset null).
struct QuantMatrix {
    const uint8_t* codes = nullptr;
    const uint16_t* scale = nullptr;
    const uint16_t* offset = nullptr;
    int bits = 8;
    size_t group = 64;
    // The product only: each decoded weight is first rounded to this model dtype (kF32: not rounded;
    // kBF16, kF16: dtype codes of cpu_optim.h), as a decode into a buffer of that dtype would round it.
    int round_to = 0;
};

// out[i] = value of element i, i < n, in fp32. The product is rounded before the offset is added, as
// torch's `q * scale + offset` in two steps does, so the result is bit-identical to that decoder.
// Throws std::invalid_argument for bits other than 4/8, group 0 (or odd with 4 bits), null pointers.
void dequantize_f32(const QuantMatrix& w, size_t n, float* out);

// y[m * rows + r] = sum_k x[m * cols + k] * W[r * cols + k] for m < batch, r < rows: a Linear's x @ W^T
// with W (rows x cols, row-major) quantized. cols must be a multiple of group (each row holds whole
// groups). The sum runs in fp32 in an order of the kernel's own, so it matches a decode followed by a
// matmul to fp32 rounding, not bit for bit.
void quantized_matmul_f32(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch,
                          float* y);

// Per-ISA kernels over a range: groups [g0, g1) of a decode (elements beyond n are not written), rows
// [r0, r1) of a product. The AVX2 ones need group % 16 == 0 (4 bits) or % 8 == 0 (8 bits).
void dequant_groups_scalar(const QuantMatrix& w, size_t n, size_t g0, size_t g1, float* out);
void qmatmul_rows_scalar(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch,
                         float* y, size_t r0, size_t r1);
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
void dequant_groups_avx2(const QuantMatrix& w, size_t n, size_t g0, size_t g1, float* out);
void qmatmul_rows_avx2(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch, float* y,
                       size_t r0, size_t r1);
#endif

}  // namespace zo_optim
