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
    static constexpr bool kCanStream = false;  // never streams; these exist only to compile
    static void stream_f32(float* p, V v) { store_f32(p, v); }
    static void stream_bf16(uint16_t* p, V v) { store_bf16(p, v); }
    static void stream_f16(uint16_t* p, V v) { store_f16(p, v); }
    static void stream_fence() {}
};

}  // namespace
}  // namespace zo_optim

#include "kernels_impl.h"

ZO_DEFINE_ISA_ENTRY_POINTS(scalar, ScalarIsa)
