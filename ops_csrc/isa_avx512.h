// Included by kernels_avx512.cpp, which first defines ZO_ISA_ENTRY_POINTS(isa, I) to the
// ZO_DEFINE_*_ENTRY_POINT macros (kernels_dispatch.h) of every optimizer: each is instantiated for every
// dtype combination (fused or in fp32 chunks, see dispatch_dtypes). One translation unit per ISA parses the
// intrinsics headers once. No include guard: the translation unit includes this once.
// AVX-512 (F, BW, VL, DQ) kernels, 16 fp32 lanes. Compiled for that target by pragma so the rest of the
// extension keeps baseline x86-64 flags; dispatch.cpp only calls in here when the CPU reports all four.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_optim.h"

#if defined(ZO_X86)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#pragma GCC optimize("fp-contract=off")
// GCC 12's own _mm512_cvtps_ph/_mm512_cvtepi32_epi16/_mm512_srli_epi32 start from _mm512_undefined_*():
// a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace zo_optim {
namespace {

struct Avx512Isa {
    using V = __m512;
    static constexpr size_t W = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V div(V a, V b) { return _mm512_div_ps(a, b); }
    static V sqrt(V a) { return _mm512_sqrt_ps(a); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V sign(V a) {
        const V one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        const V pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), one);
        const V neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), one);
        return _mm512_sub_ps(pos, neg);
    }
    static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
    static V load_bf16(const uint16_t* p) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    static V load_f16(const uint16_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static void store_f32(float* p, V v) { _mm512_storeu_ps(p, v); }
    static __m256i to_bf16(V v) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
        return _mm512_cvtepi32_epi16(r);
    }
    static __m256i to_f16(V v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static void store_bf16(uint16_t* p, V v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
    }
    static void store_f16(uint16_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(v)); }
    static constexpr bool kCanStream = true;
    static void stream_f32(float* p, V v) { _mm512_stream_ps(p, v); }
    static void stream_bf16(uint16_t* p, V v) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
    }
    static void stream_f16(uint16_t* p, V v) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(v));
    }
    static void stream_fence() { _mm_sfence(); }
    static bool none_nan(V v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) == 0; }
    // Integer lanes and the few ops the 8-bit codes and stochastic rounding need (kernels_impl.h).
    // Masks are kept as all-ones lanes like AVX2's, converted with the DQ movm/movepi32 instructions.
    using VI = __m512i;
    static VI iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
    static VI iota(uint32_t base) {
        return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base)),
                                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    }
    static VI iload(const uint32_t* p) { return _mm512_loadu_si512(p); }
    static VI iadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
    static VI isub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
    static VI iand(VI a, VI b) { return _mm512_and_si512(a, b); }
    static VI ior(VI a, VI b) { return _mm512_or_si512(a, b); }
    static VI ixor(VI a, VI b) { return _mm512_xor_si512(a, b); }
    static VI imul(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
    template <int S>
    static VI isrl(VI a) {
        return _mm512_srli_epi32(a, S);
    }
    template <int S>
    static VI isll(VI a) {
        return _mm512_slli_epi32(a, S);
    }
    static VI bits(V v) { return _mm512_castps_si512(v); }
    static V from_bits(VI i) { return _mm512_castsi512_ps(i); }
    static V cvt_i2f(VI i) { return _mm512_cvtepi32_ps(i); }
    static VI cvt_f2i(V v) { return _mm512_cvtps_epi32(v); }  // MXCSR's mode: nearest even
    static VI ilt(VI a, VI b) { return _mm512_movm_epi32(_mm512_cmplt_epi32_mask(a, b)); }
    static VI fge(V a, V b) { return _mm512_movm_epi32(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)); }
    static VI flt(V a, V b) { return _mm512_movm_epi32(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)); }
    static VI fnan(V a) { return _mm512_movm_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)); }
    static VI iselect(VI mask, VI a, VI b) {
        return _mm512_mask_blend_epi32(_mm512_movepi32_mask(mask), b, a);
    }
    static V fabs(V a) { return _mm512_abs_ps(a); }
    static V fmax(V a, V b) { return _mm512_max_ps(a, b); }
    static float hmax(V v) {
        const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        return _mm_cvtss_f32(m);
    }
    static VI load_u8(const uint8_t* p) {
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    // Stores the low byte / low 16 bits of each lane (lanes hold 0..255 / 0..65535).
    static void store_u8(uint8_t* p, VI v) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
    }
    static void store_u16(uint16_t* p, VI v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
    }
};

}  // namespace
}  // namespace zo_optim

#include "kernels_dispatch.h"

ZO_ISA_ENTRY_POINTS(avx512, Avx512Isa)

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif  // ZO_X86
