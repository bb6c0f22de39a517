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
// GCC 12's own _mm512_cvtps_ph/_mm512_cvtepi32_epi16 start from _mm512_undefined_*(): a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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
};

}  // namespace
}  // namespace zo_optim

#include "kernels_impl.h"

ZO_DEFINE_ISA_ENTRY_POINTS(avx512, Avx512Isa)

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif  // ZO_X86
