// Entry points of qmatmul.h: argument checks, the ISA choice (the optimizers' SIMD level: AVX2 kernels on
// an AVX2 or AVX-512 level, when the group size suits their steps) and the split over the pool.
#include "qmatmul.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_optim.h"
#include "dispatch.h"

namespace zo_optim {
namespace {

// Groups per parallel block of a decode, and rows per block of a product: enough work per block that
// handing it out costs nothing visible, small enough that two threads share a 4096-row weight evenly.
constexpr size_t kMinGroupsPerThread = 2048;
constexpr size_t kMinRowsPerThread = 32;
constexpr size_t kRowAlign = 16;  // 64 bytes of fp32 outputs: no cache line of y written by two threads

void check(const QuantMatrix& w, const void* data, const void* out) {
    if (w.bits != 4 && w.bits != 8) {
        throw std::invalid_argument("quantized weights: bits must be 4 or 8, got " + std::to_string(w.bits));
    }
    if (w.group == 0 || (w.bits == 4 && w.group % 2 != 0)) {
        throw std::invalid_argument("quantized weights: group size " + std::to_string(w.group) +
                                    " must be positive (and even with 4 bits)");
    }
    if (w.round_to != kF32 && w.round_to != kBF16 && w.round_to != kF16) {
        throw std::invalid_argument("quantized weights: unknown dtype code " + std::to_string(w.round_to));
    }
    if (w.codes == nullptr || w.scale == nullptr || data == nullptr || out == nullptr) {
        throw std::invalid_argument("quantized weights: null data pointer");
    }
}

// Whether the AVX2 kernels run: a SIMD level, and a group size a multiple of their step for these bits.
bool simd_fits(const QuantMatrix& w, size_t int4_step, size_t int8_step) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
    return simd_level() != SimdLevel::kScalar && w.group % (w.bits == 4 ? int4_step : int8_step) == 0;
#else
    (void)w, (void)int4_step, (void)int8_step;
    return false;
#endif
}

void check_product(const QuantMatrix& w, size_t cols) {
    if (cols == 0 || cols % w.group != 0) {
        throw std::invalid_argument("quantized matmul: " + std::to_string(cols) +
                                    " columns are not a whole number of groups of " +
                                    std::to_string(w.group));
    }
}

}  // namespace

void dequantize_f32(const QuantMatrix& w, size_t n, float* out) {
    if (n == 0) return;
    check(w, w.codes, out);
    const size_t groups = (n + w.group - 1) / w.group;
    const bool simd = simd_fits(w, 16, 8);
    (void)simd;  // unused where only the scalar kernels exist
    parallel_ranges(groups, kMinGroupsPerThread, 1, [&](size_t g0, size_t g1) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
        if (simd) return dequant_groups_avx2(w, n, g0, g1, out);
#endif
        dequant_groups_scalar(w, n, g0, g1, out);
    });
}

void quantized_matmul_f32(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch,
                          float* y) {
    if (rows == 0 || batch == 0) return;
    check(w, x, y);
    check_product(w, cols);
    const bool simd = simd_fits(w, 16, 8);
    (void)simd;  // unused where only the scalar kernels exist
    parallel_ranges(rows, kMinRowsPerThread, kRowAlign, [&](size_t r0, size_t r1) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
        if (simd) return qmatmul_rows_avx2(w, rows, cols, x, batch, y, r0, r1);
#endif
        qmatmul_rows_scalar(w, rows, cols, x, batch, y, r0, r1);
    });
}

void quantized_matmul_int8_activations(const QuantMatrix& w, size_t rows, size_t cols, const float* x,
                                       size_t batch, float* y) {
    if (rows == 0 || batch == 0) return;
    check(w, x, y);
    check_product(w, cols);
    const bool simd = simd_fits(w, 64, 32);
    const size_t groups = cols / w.group;
    std::vector<int8_t> codes(batch * cols);
    std::vector<float> scale(batch * groups), sum(batch * groups);
    parallel_ranges(batch, 1, 1, [&](size_t m0, size_t m1) {
        const bool paired = simd && w.bits == 4;
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
        if (simd)
            return quantize_acts_avx2(x, cols, w.group, paired, m0, m1, codes.data(), scale.data(),
                                      sum.data());
#endif
        quantize_acts_scalar(x, cols, w.group, paired, m0, m1, codes.data(), scale.data(), sum.data());
    });
    QuantActs acts;
    acts.codes = codes.data();
    acts.scale = scale.data();
    acts.sum = sum.data();
    acts.cols = cols;
    acts.groups = groups;
    parallel_ranges(rows, kMinRowsPerThread, kRowAlign, [&](size_t r0, size_t r1) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
        if (simd) return qmatmul_i8_rows_avx2(w, rows, acts, batch, y, r0, r1);
#endif
        qmatmul_i8_rows_scalar(w, rows, acts, batch, y, r0, r1);
    });
}

}  // namespace zo_optim
