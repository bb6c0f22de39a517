// Kernels of qmatmul.h: a portable scalar version of each, and an AVX2 + FMA + F16C version compiled for
// that target by pragma (qmatmul.cpp only calls it when the CPU reports all three).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu_optim.h"
#include "qmatmul.h"
#include "scalar_convert.h"

namespace zo_optim {
namespace {

inline unsigned code_at(const QuantMatrix& w, size_t i) {
    if (w.bits == 8) return w.codes[i];
    const unsigned byte = w.codes[i / 2];
    return (i & 1) ? (byte & 0x0Fu) : (byte >> 4);
}

inline float half_range(const QuantMatrix& w) { return static_cast<float>(1 << (w.bits - 1)); }

// A decoded weight rounded to the model dtype (QuantMatrix::round_to), back in fp32.
inline float rounded(const QuantMatrix& w, float v) {
    if (w.round_to == kBF16) return bf16_to_f32(f32_to_bf16(v));
    if (w.round_to == kF16) return f16_to_f32(f32_to_f16(v));
    return v;
}

// Elements [lo, hi) of group g decoded into dst[0, hi - lo): the product rounded before the offset is
// added (asymmetric), or (code - half) * scale (symmetric), as torch's decoder computes them.
void decode_group(const QuantMatrix& w, size_t g, size_t lo, size_t hi, float* dst) {
    const float s = f16_to_f32(w.scale[g]);
    if (w.offset != nullptr) {
        const float o = f16_to_f32(w.offset[g]);
        for (size_t i = lo; i < hi; ++i) {
            const float t = static_cast<float>(code_at(w, i)) * s;  // rounded before the add
            dst[i - lo] = t + o;
        }
    } else {
        const float half = half_range(w);
        for (size_t i = lo; i < hi; ++i) dst[i - lo] = (static_cast<float>(code_at(w, i)) - half) * s;
    }
}

}  // namespace

void dequant_groups_scalar(const QuantMatrix& w, size_t n, size_t g0, size_t g1, float* out) {
    for (size_t g = g0; g < g1; ++g) {
        const size_t lo = g * w.group, hi = lo + w.group < n ? lo + w.group : n;
        decode_group(w, g, lo, hi, out + lo);
    }
}

void qmatmul_rows_scalar(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch,
                         float* y, size_t r0, size_t r1) {
    // Each row of weights is decoded (and rounded to the model dtype) once, then used for every input row.
    const size_t groups = cols / w.group;
    std::vector<float> row(cols);
    for (size_t r = r0; r < r1; ++r) {
        for (size_t gi = 0; gi < groups; ++gi) {
            const size_t lo = r * cols + gi * w.group;
            decode_group(w, r * groups + gi, lo, lo + w.group, row.data() + gi * w.group);
        }
        for (float& v : row) v = rounded(w, v);
        for (size_t m = 0; m < batch; ++m) {
            const float* xm = x + m * cols;
            float acc = 0.0f;
            for (size_t k = 0; k < cols; ++k) acc += row[k] * xm[k];
            y[m * rows + r] = acc;
        }
    }
}

}  // namespace zo_optim

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

namespace zo_optim {
namespace {

inline float f16_at(const uint16_t* p) { return _cvtsh_ss(*p); }

// 16 consecutive int4 codes from 8 bytes (high nibble first), as two vectors of 8 fp32 in element order.
inline void unpack16_int4(const uint8_t* p, __m256& lo8, __m256& hi8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i ordered = _mm_unpacklo_epi8(high, low);  // e0 e1 ... e15
    lo8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ordered));
    hi8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8)));
}

// 8 consecutive int8 codes as 8 fp32.
inline __m256 unpack8_int8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Decoded values of one group's 8-element chunk c as fp32 (asymmetric: q * s then + o; symmetric:
// (q - half) * s), the same two roundings as the scalar decoder.
inline __m256 finish(__m256 q, __m256 s, __m256 o, __m256 half, bool sym) {
    return sym ? _mm256_mul_ps(_mm256_sub_ps(q, half), s) : _mm256_add_ps(_mm256_mul_ps(q, s), o);
}

// Round 8 fp32 weights to bf16 (nearest even; weights are finite) or fp16 and back (round_to).
inline __m256 round_vec(__m256 v, int round_to) {
    if (round_to == kBF16) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
        return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    if (round_to == kF16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

// Up to 8 rows of x against one weight row: acc[j] += w . x_j over the row, 16 (int4) or 8 (int8) elements
// a step, the weights decoded once per step for all rows.
template <int B>
void row_tile(const QuantMatrix& w, size_t cols, const float* x, size_t r, float* out) {
    const size_t groups = cols / w.group;
    const bool sym = w.offset == nullptr;
    const __m256 half = _mm256_set1_ps(static_cast<float>(1 << (w.bits - 1)));
    __m256 acc[B];
    for (int j = 0; j < B; ++j) acc[j] = _mm256_setzero_ps();
    for (size_t gi = 0; gi < groups; ++gi) {
        const size_t g = r * groups + gi;
        const __m256 s = _mm256_set1_ps(f16_at(w.scale + g));
        const __m256 o = sym ? _mm256_setzero_ps() : _mm256_set1_ps(f16_at(w.offset + g));
        const size_t k0 = gi * w.group;
        if (w.bits == 4) {
            const uint8_t* p = w.codes + (r * cols + k0) / 2;
            for (size_t k = 0; k < w.group; k += 16, p += 8) {
                __m256 q0, q1;
                unpack16_int4(p, q0, q1);
                const __m256 w0 = round_vec(finish(q0, s, o, half, sym), w.round_to);
                const __m256 w1 = round_vec(finish(q1, s, o, half, sym), w.round_to);
                for (int j = 0; j < B; ++j) {
                    const float* xj = x + j * cols + k0 + k;
                    acc[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xj), acc[j]);
                    acc[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xj + 8), acc[j]);
                }
            }
        } else {
            const uint8_t* p = w.codes + r * cols + k0;
            for (size_t k = 0; k < w.group; k += 8, p += 8) {
                const __m256 w0 = round_vec(finish(unpack8_int8(p), s, o, half, sym), w.round_to);
                for (int j = 0; j < B; ++j) {
                    acc[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * cols + k0 + k), acc[j]);
                }
            }
        }
    }
    for (int j = 0; j < B; ++j) out[j] = hsum(acc[j]);
}

}  // namespace

void dequant_groups_avx2(const QuantMatrix& w, size_t n, size_t g0, size_t g1, float* out) {
    const bool sym = w.offset == nullptr;
    const __m256 half = _mm256_set1_ps(static_cast<float>(1 << (w.bits - 1)));
    const size_t full = n / w.group;  // groups with all their elements below n
    const size_t end = g1 < full ? g1 : full;
    for (size_t g = g0; g < end; ++g) {
        const __m256 s = _mm256_set1_ps(f16_at(w.scale + g));
        const __m256 o = sym ? _mm256_setzero_ps() : _mm256_set1_ps(f16_at(w.offset + g));
        float* dst = out + g * w.group;
        if (w.bits == 4) {
            const uint8_t* p = w.codes + g * w.group / 2;
            for (size_t k = 0; k < w.group; k += 16, p += 8) {
                __m256 q0, q1;
                unpack16_int4(p, q0, q1);
                _mm256_storeu_ps(dst + k, finish(q0, s, o, half, sym));
                _mm256_storeu_ps(dst + k + 8, finish(q1, s, o, half, sym));
            }
        } else {
            const uint8_t* p = w.codes + g * w.group;
            for (size_t k = 0; k < w.group; k += 8)
                _mm256_storeu_ps(dst + k, finish(unpack8_int8(p + k), s, o, half, sym));
        }
    }
    if (g1 > end) dequant_groups_scalar(w, n, end, g1, out);  // the last, partial group
}

void qmatmul_rows_avx2(const QuantMatrix& w, size_t rows, size_t cols, const float* x, size_t batch, float* y,
                       size_t r0, size_t r1) {
    // Tiles of 8 input rows: 8 accumulators, two decoded weight vectors and the constants fit the 16
    // registers, and each decoded weight serves 8 FMAs whose x operand comes straight from memory.
    constexpr size_t kTile = 8;
    using TileFn = void (*)(const QuantMatrix&, size_t, const float*, size_t, float*);
    static constexpr TileFn kTiles[kTile + 1] = {nullptr,     row_tile<1>, row_tile<2>,
                                                 row_tile<3>, row_tile<4>, row_tile<5>,
                                                 row_tile<6>, row_tile<7>, row_tile<8>};
    float out[kTile];
    for (size_t m = 0; m < batch; m += kTile) {
        const size_t b = batch - m < kTile ? batch - m : kTile;
        for (size_t r = r0; r < r1; ++r) {
            kTiles[b](w, cols, x + m * cols, r, out);
            for (size_t j = 0; j < b; ++j) y[(m + j) * rows + r] = out[j];
        }
    }
}

}  // namespace zo_optim

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif  // x86
