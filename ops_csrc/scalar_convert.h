// Portable fp32 <-> bf16/fp16 conversions for the scalar kernels (and any CPU without F16C).
//
// Rounding matches the hardware and torch's tensor casts: round to nearest, ties to even. NaNs: bf16 NaN
// is 0xFFFF (what torch's vectorized float->bfloat16 cast writes), fp16 NaN keeps its sign, sets the quiet
// bit and keeps the top payload bits (what F16C's vcvtps2ph does).
#pragma once

#include <cstdint>
#include <cstring>

namespace zo_optim {
namespace {

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float bits_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0xFFFF;
    const uint32_t u = f32_bits(f);
    const uint32_t rounding_bias = 0x7FFF + ((u >> 16) & 1);
    return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1F;
    const uint32_t mantissa = h & 0x3FF;
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24 is exact in fp32.
        const float magnitude = static_cast<float>(mantissa) * bits_f32(0x33800000);  // 2^-24
        return bits_f32(sign | f32_bits(magnitude));
    }
    if (exponent == 0x1F) {
        const uint32_t quiet = mantissa != 0 ? 0x00400000 : 0;
        return bits_f32(sign | 0x7F800000 | quiet | (mantissa << 13));
    }
    return bits_f32(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
    u &= 0x7FFFFFFF;
    if (u > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00 | ((u >> 13) & 0x3FF));  // NaN
    if (u >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // >= 65520 rounds to inf
    if (u < 0x38800000) {
        // Below 2^-14 the result is subnormal: adding 0.5 aligns the value to a 2^-24 grid (the fp16
        // subnormal step), and the FPU's own round-to-nearest-even does the rounding.
        const float aligned = bits_f32(u) + 0.5f;
        return static_cast<uint16_t>(sign | (f32_bits(aligned) - 0x3F000000));
    }
    const uint32_t odd = (u >> 13) & 1;
    u += 0xC8000FFFu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
    return static_cast<uint16_t>(sign | (u >> 13));
}

}  // namespace
}  // namespace zo_optim
