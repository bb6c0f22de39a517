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

// The same product with the activations quantized too: each group of `w.group` values of a row of x is
// rounded to int8 codes q_x with scale s_x = max|x| / 127 (half to even, as torch.round), the weight
// codes are multiplied with them in integer arithmetic, and each group's integer sum is scaled once:
//   y[m, r] = sum_g (s_w * s_x) * sum_k q_w[k] * q_x[k]  +  o_w * s_x * sum_k q_x[k]
// (q_w, o_w: the weight codes as the kernel multiplies them and the offset that goes with them, e.g. int4
// symmetric q_w = code, o_w = -8 * s_w). That is the product of the decoded weights with the rounded
// activations s_x * q_x, so its error is sum_k w[k] * (rounding of x[k]). w.round_to is not used;
// non-finite activations give non-finite outputs.
void quantized_matmul_int8_activations(const QuantMatrix& w, size_t rows, size_t cols, const float* x,
                                       size_t batch, float* y);

// Activations quantized per row and group for the product above. `paired` (int4 AVX2 kernels): each run
// of 64 values is stored as its 32 even-indexed codes, then its 32 odd-indexed ones, the order of the high
// and low nibbles of 32 weight bytes.
struct QuantActs {
    const int8_t* codes = nullptr;  // batch x cols
    const float* scale = nullptr;   // batch x groups: max|x| / 127 over the group
    const float* sum = nullptr;     // batch x groups: s_x * the sum of the group's codes
    size_t cols = 0, groups = 0;
};

// Per-ISA kernels over a range: groups [g0, g1) of a decode (elements beyond n are not written), rows
// [r0, r1) of a product. The AVX2 ones need group % 16 == 0 (4 bits) or % 8 == 0 (8 bits).
void dequant_groups_scalar(const QuantMatrix& w, size_t n, size_t g0, size_t g1, float* out);
void qmatmul_rows_scalar(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch,
                         float* y, size_t r0, size_t r1);
void qmatmul_i8_rows_scalar(const QuantMatrix& w, size_t rows, const QuantActs& x, size_t batch, float* y,
                            size_t r0, size_t r1);
// Rows [m0, m1) of x (batch x cols) into QuantActs' buffers: codes, scale and sum (`paired`: the int4
// order above).
void quantize_acts_scalar(const float* x, size_t cols, size_t group, bool paired, size_t m0, size_t m1,
                          int8_t* codes, float* scale, float* sum);
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
void dequant_groups_avx2(const QuantMatrix& w, size_t n, size_t g0, size_t g1, float* out);
void qmatmul_rows_avx2(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch, float* y,
                       size_t r0, size_t r1);
// Need group % 64 == 0 (4 bits; activations `paired`) or % 32 == 0 (8 bits); the same values as the
// scalar versions.
void quantize_acts_avx2(const float* x, size_t cols, size_t group, bool paired, size_t m0, size_t m1,
                        int8_t* codes, float* scale, float* sum);
void qmatmul_i8_rows_avx2(const QuantMatrix& w, size_t rows, const QuantActs& x, size_t batch, float* y,
                          size_t r0, size_t r1);
#endif

}  // namespace zo_optim
