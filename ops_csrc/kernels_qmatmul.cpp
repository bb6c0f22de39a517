// Kernels of qmatmul.h: a portable scalar version of each, and an AVX2 + FMA + F16C version compiled for
// that target by pragma (qmatmul.cpp only calls it when the CPU reports all three).
#include <cmath>
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

// The weight code as the signed factor of the int8-activation product, and the offset that goes with it:
// int4 codes 0..15 stay as they are (offset, or -8 * scale symmetric); int8 codes become code - 128
// (offset + 128 * scale, or none symmetric), so that |code| <= 128 fits the AVX2 byte products.
inline int signed_code(const QuantMatrix& w, size_t i) {
    const int c = static_cast<int>(code_at(w, i));
    return w.bits == 8 ? c - 128 : c;
}

// `o`: the group's stored offset (ignored when the weights are symmetric), `s`: its scale. The scalar and
// AVX2 kernels load o and s their own way and share this rule.
inline float signed_code_offset(const QuantMatrix& w, float o, float s) {
    if (w.bits == 8) return w.offset != nullptr ? o + 128.0f * s : 0.0f;
    return w.offset != nullptr ? o : -8.0f * s;
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

void quantize_acts_scalar(const float* x, size_t cols, size_t group, bool paired, size_t m0, size_t m1,
                          int8_t* codes, float* scale, float* sum) {
    const size_t groups = cols / group;
    for (size_t m = m0; m < m1; ++m) {
        for (size_t gi = 0; gi < groups; ++gi) {
            const float* v = x + m * cols + gi * group;
            float amax = 0.0f;
            for (size_t k = 0; k < group; ++k) amax = std::fmax(amax, std::fabs(v[k]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const float sx = amax / 127.0f;
            int8_t* q = codes + m * cols + gi * group;
            int64_t total = 0;
            for (size_t k = 0; k < group; ++k) {
                const float c = std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(v[k] * inv)));
                // paired: within each run of 64, element 2i at i and element 2i + 1 at 32 + i
                const size_t at = paired ? (k & ~size_t{63}) + (k & 1) * 32 + (k & 63) / 2 : k;
                q[at] = static_cast<int8_t>(c);
                total += static_cast<int64_t>(c);
            }
            scale[m * groups + gi] = sx;
            sum[m * groups + gi] = sx * static_cast<float>(total);
        }
    }
}

void qmatmul_i8_rows_scalar(const QuantMatrix& w, size_t rows, const QuantActs& x, size_t batch, float* y,
                            size_t r0, size_t r1) {
    const size_t cols = x.cols, groups = x.groups;
    for (size_t r = r0; r < r1; ++r) {
        for (size_t m = 0; m < batch; ++m) {
            const int8_t* xq = x.codes + m * cols;
            float acc = 0.0f;
            for (size_t gi = 0; gi < groups; ++gi) {
                const size_t g = r * groups + gi, k0 = gi * w.group;
                const float s = f16_to_f32(w.scale[g]);
                int64_t isum = 0;  // a group may hold 2^24 products of up to 128 * 127
                for (size_t k = k0; k < k0 + w.group; ++k) isum += signed_code(w, r * cols + k) * xq[k];
                const float o = w.offset != nullptr ? f16_to_f32(w.offset[g]) : 0.0f;
                acc += s * x.scale[m * groups + gi] * static_cast<float>(isum) +
                       signed_code_offset(w, o, s) * x.sum[m * groups + gi];
            }
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

constexpr size_t kRowBlockBytes = 192 << 10;  // weight codes per block of rows: within a 512 KiB L2

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

// The scales of a tile of up to 8 rows of int8 activations, group-major: [group][8] (rows past the tile
// hold 0), so that one group's eight values are one load.
struct TileScales {
    std::vector<float> scale, sum;
    void fill(const QuantActs& x, size_t b) {
        scale.assign(x.groups * 8, 0.0f);
        sum.assign(x.groups * 8, 0.0f);
        for (size_t g = 0; g < x.groups; ++g) {
            for (size_t j = 0; j < b; ++j) {
                scale[g * 8 + j] = x.scale[j * x.groups + g];
                sum[g * 8 + j] = x.sum[j * x.groups + g];
            }
        }
    }
};

// Up to 8 rows of int8 activations against one weight row (QuantActs, `paired` for int4): per 32 byte
// products, vpmaddubsw (unsigned weight bytes times signed activation bytes, pairs summed to int16) and
// vpmaddwd into 8 int32 lanes, converted and scaled into fp32 accumulators once per 64 (int4) or 32 (int8)
// elements. The int16 sums stay within 2 * 2 * 15 * 127 (int4: two byte-pair sums added) and 2 * 128 * 127
// (int8, as |code - 128| times the activation with the weight's sign), so nothing saturates.
template <int B>
void row_tile_i8(const QuantMatrix& w, const QuantActs& x, const TileScales& ts, size_t r, float* out) {
    const size_t cols = x.cols, groups = x.groups;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256 acc[B];
    for (int j = 0; j < B; ++j) acc[j] = _mm256_setzero_ps();
    __m256 off = _mm256_setzero_ps();
    alignas(32) float sc[8];
    for (size_t gi = 0; gi < groups; ++gi) {
        const size_t g = r * groups + gi, k0 = gi * w.group;
        const float s = f16_at(w.scale + g);
        const float o = signed_code_offset(w, w.offset != nullptr ? f16_at(w.offset + g) : 0.0f, s);
        _mm256_store_ps(sc, _mm256_mul_ps(_mm256_set1_ps(s), _mm256_loadu_ps(&ts.scale[gi * 8])));
        off = _mm256_add_ps(off, _mm256_mul_ps(_mm256_set1_ps(o), _mm256_loadu_ps(&ts.sum[gi * 8])));
        if (w.bits == 4) {
            const uint8_t* p = w.codes + (r * cols + k0) / 2;
            for (size_t k = k0; k < k0 + w.group; k += 64, p += 32) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // even elements
                const __m256i lo = _mm256_and_si256(v, low4);                        // odd elements
                for (int j = 0; j < B; ++j) {
                    const __m256i* xj = reinterpret_cast<const __m256i*>(x.codes + j * cols + k);
                    const __m256i pe = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xj));
                    const __m256i po = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xj + 1));
                    const __m256i sum = _mm256_madd_epi16(_mm256_add_epi16(pe, po), ones);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(sc + j), acc[j]);
                }
            }
        } else {
            const uint8_t* p = w.codes + r * cols + k0;
            for (size_t k = k0; k < k0 + w.group; k += 32, p += 32) {
                const __m256i c =
                    _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip);
                const __m256i mag = _mm256_abs_epi8(c);  // code - 128 as int8; |-128| reads as 128 unsigned
                for (int j = 0; j < B; ++j) {
                    const __m256i xv =
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + j * cols + k));
                    const __m256i sum =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(xv, c)), ones);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(sc + j), acc[j]);
                }
            }
        }
    }
    alignas(32) float offs[8];
    _mm256_store_ps(offs, off);
    for (int j = 0; j < B; ++j) out[j] = hsum(acc[j]) + offs[j];
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

void quantize_acts_avx2(const float* x, size_t cols, size_t group, bool paired, size_t m0, size_t m1,
                        int8_t* codes, float* scale, float* sum) {
    const size_t groups = cols / group;
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f), neg = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (size_t m = m0; m < m1; ++m) {
        for (size_t gi = 0; gi < groups; ++gi) {
            const float* v = x + m * cols + gi * group;
            __m256 amax = _mm256_setzero_ps();
            for (size_t k = 0; k < group; k += 8)
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
            const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
            int8_t* q = codes + m * cols + gi * group;
            __m256i total = _mm256_setzero_si256();
            // 32 values a step: four vectors of 8, in the stored order (paired: the even-indexed values of
            // 64, then the odd-indexed ones)
            for (size_t k = 0; k < group; k += 32) {
                __m256 f[4];
                if (paired) {
                    const size_t base = (k & ~size_t{63}), odd = (k & 63) ? 1 : 0;
                    for (int i = 0; i < 4; ++i) {
                        const __m256 a = _mm256_loadu_ps(v + base + 16 * i),
                                     b = _mm256_loadu_ps(v + base + 16 * i + 8);
                        const __m256 pick = odd ? _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))
                                                : _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
                        f[i] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(pick), 0xD8));
                    }
                } else {
                    for (int i = 0; i < 4; ++i) f[i] = _mm256_loadu_ps(v + k + 8 * i);
                }
                __m256i c[4];
                for (int i = 0; i < 4; ++i) {
                    const __m256 r = _mm256_round_ps(_mm256_mul_ps(f[i], inv),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    c[i] = _mm256_cvtps_epi32(_mm256_min_ps(lim, _mm256_max_ps(neg, r)));
                    total = _mm256_add_epi32(total, c[i]);
                }
                const __m256i packed =
                    _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                                    _mm256_permutevar8x32_epi32(packed, order));
            }
            const __m128i t4 =
                _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            const __m128i t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
            const int t = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32(t2, 1)));
            const float sx = top / 127.0f;
            scale[m * groups + gi] = sx;
            sum[m * groups + gi] = sx * static_cast<float>(t);
        }
    }
}

void qmatmul_i8_rows_avx2(const QuantMatrix& w, size_t rows, const QuantActs& x, size_t batch, float* y,
                          size_t r0, size_t r1) {
    constexpr size_t kTile = 8;
    using TileFn = void (*)(const QuantMatrix&, const QuantActs&, const TileScales&, size_t, float*);
    static constexpr TileFn kTiles[kTile + 1] = {nullptr,        row_tile_i8<1>, row_tile_i8<2>,
                                                 row_tile_i8<3>, row_tile_i8<4>, row_tile_i8<5>,
                                                 row_tile_i8<6>, row_tile_i8<7>, row_tile_i8<8>};
    // Blocks of weight rows whose codes stay in the L2 cache while every tile of input rows passes over them.
    const size_t row_bytes = x.cols * static_cast<size_t>(w.bits) / 8;
    const size_t block = row_bytes >= kRowBlockBytes ? 1 : kRowBlockBytes / row_bytes;
    float out[kTile];
    std::vector<TileScales> tiles((batch + kTile - 1) / kTile);
    for (size_t m = 0; m < batch; m += kTile) {
        QuantActs xt = x;
        xt.scale += m * x.groups;
        xt.sum += m * x.groups;
        tiles[m / kTile].fill(xt, batch - m < kTile ? batch - m : kTile);
    }
    for (size_t rb = r0; rb < r1; rb += block) {
        const size_t re = r1 - rb < block ? r1 : rb + block;
        for (size_t m = 0; m < batch; m += kTile) {
            const size_t b = batch - m < kTile ? batch - m : kTile;
            QuantActs xt = x;
            xt.codes += m * x.cols;
            for (size_t r = rb; r < re; ++r) {
                kTiles[b](w, xt, tiles[m / kTile], r, out);
                for (size_t j = 0; j < b; ++j) y[(m + j) * rows + r] = out[j];
            }
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
