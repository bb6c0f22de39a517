// Included by kernels_scalar.cpp, which first defines ZO_ISA_ENTRY_POINTS(isa, I) to the
// ZO_DEFINE_*_ENTRY_POINT macros (kernels_dispatch.h) of every optimizer: each is instantiated for every
// dtype combination (fused or in fp32 chunks, see dispatch_dtypes). One translation unit per ISA parses the
// intrinsics headers once. No include guard: the translation unit includes this once.
// Portable kernels: one element at a time, any CPU, any architecture. Also the reference the SIMD paths
// are tested against: it performs the same operations with the same roundings.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_optim.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "scalar_convert.h"

namespace zo_optim {
namespace {

struct ScalarIsa {
    using V = float;
    static constexpr size_t W = 1;
    static V zero() { return 0.0f; }
    static V set1(float x) { return x; }
    static V add(V a, V b) { return a + b; }
    static V sub(V a, V b) { return a - b; }
    static V mul(V a, V b) { return a * b; }
    static V div(V a, V b) { return a / b; }
    static V sqrt(V a) { return __builtin_sqrtf(a); }
    static V fmadd(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
    static V sign(V a) { return (a > 0.0f ? 1.0f : 0.0f) - (a < 0.0f ? 1.0f : 0.0f); }
    static V load_f32(const float* p) { return *p; }
    static V load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
    static V load_f16(const uint16_t* p) { return f16_to_f32(*p); }
    static void store_f32(float* p, V v) { *p = v; }
    static void store_bf16(uint16_t* p, V v) { *p = f32_to_bf16(v); }
    static void store_f16(uint16_t* p, V v) { *p = f32_to_f16(v); }
    static bool none_nan(V v) { return v == v; }
    // Integer lanes and the few ops the 8-bit codes and stochastic rounding need (kernels_impl.h).
    using VI = uint32_t;
    static VI iset1(uint32_t x) { return x; }
    static VI iota(uint32_t base) { return base; }
    static VI iload(const uint32_t* p) { return *p; }
    static VI iadd(VI a, VI b) { return a + b; }
    static VI isub(VI a, VI b) { return a - b; }
    static VI iand(VI a, VI b) { return a & b; }
    static VI ior(VI a, VI b) { return a | b; }
    static VI ixor(VI a, VI b) { return a ^ b; }
    static VI imul(VI a, VI b) { return a * b; }
    template <int S>
    static VI isrl(VI a) {
        return a >> S;
    }
    template <int S>
    static VI isll(VI a) {
        return a << S;
    }
    static VI bits(V v) { return f32_bits(v); }
    static V from_bits(VI i) { return bits_f32(i); }
    static V cvt_i2f(VI i) { return static_cast<float>(static_cast<int32_t>(i)); }
    // rintf rounds in the current mode (nearest even), like cvtps2dq; the inputs are small.
    static VI cvt_f2i(V v) { return static_cast<uint32_t>(static_cast<int32_t>(__builtin_rintf(v))); }
    static VI ilt(VI a, VI b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? ~0u : 0u; }
    static VI fge(V a, V b) { return a >= b ? ~0u : 0u; }
    static VI flt(V a, V b) { return a < b ? ~0u : 0u; }
    static VI fnan(V a) { return a != a ? ~0u : 0u; }
    static VI iselect(VI mask, VI a, VI b) { return (mask & a) | (~mask & b); }
    static V fabs(V a) { return __builtin_fabsf(a); }
    static V fmax(V a, V b) { return a > b ? a : b; }
    static float hmax(V v) { return v; }
    static VI load_u8(const uint8_t* p) { return *p; }
    static void store_u8(uint8_t* p, VI v) { *p = static_cast<uint8_t>(v); }
    static void store_u16(uint16_t* p, VI v) { *p = static_cast<uint16_t>(v); }
    static constexpr bool kCanStream = false;  // never streams; these exist only to compile
    static void stream_f32(float* p, V v) { store_f32(p, v); }
    static void stream_bf16(uint16_t* p, V v) { store_bf16(p, v); }
    static void stream_f16(uint16_t* p, V v) { store_f16(p, v); }
    static void stream_fence() {}
};

}  // namespace
}  // namespace zo_optim

#include "kernels_dispatch.h"

ZO_ISA_ENTRY_POINTS(scalar, ScalarIsa)
