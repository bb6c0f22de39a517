// Included by kernels_avx2.cpp, which first defines ZO_ISA_ENTRY_POINTS(isa, I) to the
// ZO_DEFINE_*_ENTRY_POINT macros (kernels_dispatch.h) of every optimizer: each is instantiated for every
// dtype combination (fused or in fp32 chunks, see dispatch_dtypes). One translation unit per ISA parses the
// intrinsics headers once. No include guard: the translation unit includes this once.
// AVX2 + FMA + F16C kernels, 8 fp32 lanes. Compiled for that target by pragma so the rest of the
// extension keeps baseline x86-64 flags; dispatch.cpp only calls in here when the CPU reports all three.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_optim.h"

#if defined(ZO_X86)
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

struct Avx2Isa {
    using V = __m256;
    static constexpr size_t W = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V div(V a, V b) { return _mm256_div_ps(a, b); }
    static V sqrt(V a) { return _mm256_sqrt_ps(a); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V sign(V a) {
        const V one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        const V pos = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one);
        const V neg = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one);
        return _mm256_sub_ps(pos, neg);
    }
    static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
    static V load_bf16(const uint16_t* p) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    static V load_f16(const uint16_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static void store_f32(float* p, V v) { _mm256_storeu_ps(p, v); }
    static __m128i to_bf16(V v) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
        // packus interleaves the two 128-bit lanes; the permute puts the eight results in order.
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        return _mm256_castsi256_si128(packed);
    }
    static __m128i to_f16(V v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }
    static void store_bf16(uint16_t* p, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
    static void store_f16(uint16_t* p, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(v)); }
    static constexpr bool kCanStream = true;
    static void stream_f32(float* p, V v) { _mm256_stream_ps(p, v); }
    static void stream_bf16(uint16_t* p, V v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
    static void stream_f16(uint16_t* p, V v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(v)); }
    static void stream_fence() { _mm_sfence(); }
    static bool none_nan(V v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) == 0; }
    // Integer lanes and the few ops the 8-bit codes and stochastic rounding need (kernels_impl.h).
    using VI = __m256i;
    static VI iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
    static VI iota(uint32_t base) {
        return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    static VI iload(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static VI iadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
    static VI isub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
    static VI iand(VI a, VI b) { return _mm256_and_si256(a, b); }
    static VI ior(VI a, VI b) { return _mm256_or_si256(a, b); }
    static VI ixor(VI a, VI b) { return _mm256_xor_si256(a, b); }
    static VI imul(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
    template <int S>
    static VI isrl(VI a) {
        return _mm256_srli_epi32(a, S);
    }
    template <int S>
    static VI isll(VI a) {
        return _mm256_slli_epi32(a, S);
    }
    static VI bits(V v) { return _mm256_castps_si256(v); }
    static V from_bits(VI i) { return _mm256_castsi256_ps(i); }
    static V cvt_i2f(VI i) { return _mm256_cvtepi32_ps(i); }
    static VI cvt_f2i(V v) { return _mm256_cvtps_epi32(v); }  // MXCSR's mode: nearest even
    static VI ilt(VI a, VI b) { return _mm256_cmpgt_epi32(b, a); }
    static VI fge(V a, V b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
    static VI flt(V a, V b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
    static VI fnan(V a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
    static VI iselect(VI mask, VI a, VI b) { return _mm256_blendv_epi8(b, a, mask); }
    static V fabs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
    static V fmax(V a, V b) { return _mm256_max_ps(a, b); }
    static float hmax(V v) {
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        return _mm_cvtss_f32(m);
    }
    static VI load_u8(const uint8_t* p) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    }
    // Stores the low byte / low 16 bits of each lane (lanes hold 0..255 / 0..65535).
    static void store_u8(uint8_t* p, VI v) {
        const __m256i w = _mm256_packus_epi32(v, v);  // per 128-bit lane: 4 words, repeated
        const __m128i w16 = _mm_unpacklo_epi64(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w16, w16));
    }
    static void store_u16(uint16_t* p, VI v) {
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0xD8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
    }
};

}  // namespace
}  // namespace zo_optim

#include "kernels_dispatch.h"

ZO_ISA_ENTRY_POINTS(avx2, Avx2Isa)

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif  // ZO_X86
