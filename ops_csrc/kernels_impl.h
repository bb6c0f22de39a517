// The optimizer kernels, written once against a small SIMD interface `I` and compiled once per ISA.
//
// Include this header only through kernels_dispatch.h from an isa_<isa>.h file, after its target
// pragma and after the ISA struct is defined. Everything here lives in an anonymous namespace so that each
// translation unit keeps its own copy compiled for its own target: inline functions shared by name across
// units could otherwise be merged by the linker into one compiled for the wrong CPU.
//
// Interface required of I: type V (fp32 lanes), constant W (lane count), and static functions zero, set1,
// add, sub, mul, div, sqrt, fmadd (a * b + c, one rounding), sign (torch.sign: +1, -1, +0 for zeros and
// NaN), load_f32/load_bf16/load_f16, store_f32/store_bf16/store_f16, none_nan (no NaN lane), and for
// non-temporal stores kCanStream (false: never stream), stream_f32, stream_bf16, stream_f16 (aligned to
// the vector width) and stream_fence. For 8-bit states and stochastic rounding: type VI (uint32 lanes;
// masks are all-ones lanes) with iset1, iota (base + lane), iload, iadd, isub, iand, ior, ixor, imul (low
// 32 bits), isrl<S>/isll<S> (logical shifts), bits/from_bits (reinterpret), cvt_i2f, cvt_f2i (nearest
// even), ilt (signed), fge/flt/fnan (masks), iselect(mask, a, b), fabs, fmax, hmax, load_u8 (W bytes),
// store_u8/store_u16 (low byte / low 16 bits of each lane).
//
// Floating-point order mirrors torch's eager CPU ops for fp32 tensors (checked bit for bit in the tests):
// a torch op that torch vectorizes with an FMA (lerp, add with alpha, addcmul) is one fmadd here, every
// other op is rounded separately. The including file turns off FP contraction so the compiler cannot fuse
// a multiply and an add that torch rounds twice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_optim.h"

// The per-element helpers below run once per vector (per element in the scalar build, where GCC would
// otherwise leave the optimizer math as a call with its outputs in memory): always inlined.
#if defined(__GNUC__) || defined(__clang__)
#define ZO_INLINE __attribute__((always_inline)) inline
#else
#define ZO_INLINE inline
#endif

namespace zo_optim {
namespace {

template <int D>
constexpr size_t elem_size() {
    return D == kF32 ? 4 : (D == kU8 ? 1 : 2);
}

template <class I, int D>
inline typename I::V load(const void* base, size_t i) {
    if constexpr (D == kF32) {
        return I::load_f32(static_cast<const float*>(base) + i);
    } else if constexpr (D == kBF16 || D == kBF16SR) {
        return I::load_bf16(static_cast<const uint16_t*>(base) + i);
    } else {
        return I::load_f16(static_cast<const uint16_t*>(base) + i);
    }
}

// Stores one vector of dtype D at element i; kNone (no copy) stores nothing. Stream selects a
// non-temporal store, which the caller only picks for a destination aligned to the vector width.
template <class I, int D, bool Stream>
inline void store(void* base, size_t i, typename I::V v) {
    if constexpr (D == kF32 && Stream) {
        I::stream_f32(static_cast<float*>(base) + i, v);
    } else if constexpr (D == kF32) {
        I::store_f32(static_cast<float*>(base) + i, v);
    } else if constexpr (D == kBF16 && Stream) {
        I::stream_bf16(static_cast<uint16_t*>(base) + i, v);
    } else if constexpr (D == kBF16) {
        I::store_bf16(static_cast<uint16_t*>(base) + i, v);
    } else if constexpr (D == kF16 && Stream) {
        I::stream_f16(static_cast<uint16_t*>(base) + i, v);
    } else if constexpr (D == kF16) {
        I::store_f16(static_cast<uint16_t*>(base) + i, v);
    }
}

// Whether element `begin` of an array of dtype D starts a vector-width-aligned block. The loop advances
// by W elements, so an aligned start keeps every full vector's store aligned.
template <class I, int D>
inline bool vector_aligned(const void* base, size_t begin) {
    constexpr size_t bytes = I::W * elem_size<D>();
    return (reinterpret_cast<uintptr_t>(base) + begin * elem_size<D>()) % bytes == 0;
}

// Below this many elements a range streams nothing: a short copy is likely still in cache when it is
// read next, and the fence at the end of a streamed range is not free.
constexpr size_t kMinStreamElems = 4096;

// Tracks non-finite grads: g - g is +0 for a finite g and NaN for +-inf or NaN.
template <class I>
inline typename I::V track_nonfinite(typename I::V bad, typename I::V g) {
    return I::add(bad, I::sub(g, g));
}

inline void copy_bytes(void* dst, const void* src, size_t n) {
    if (n != 0) std::memcpy(dst, src, n);
}

// Runs body over [begin, end) in full vectors. The remainder (< W elements) is staged through zero-padded
// local buffers and run through the same vector body, so a tail element gets exactly the operations of an
// element in the middle of the array; only the real elements are copied back. body(arrays, i, gi, ...)
// gets the index i into `arrays` and the element index gi of its first lane in the caller's arrays (they
// differ for the staged tail): stochastic rounding hashes gi.
template <class I, int PT, int GT, int ST, int CT, class Body>
bool run_range(const Arrays& arrays, size_t begin, size_t end, const Body& body_in) {
    // Local copies of the pointers and of the body's captured constants: extensions build with
    // -fno-strict-aliasing, under which every store through a data pointer could change anything
    // reachable through a reference, so the loop would reload each pointer and constant per vector.
    // Locals whose address does not escape stay in registers.
    const Arrays a = arrays;
    const Body body = body_in;
    using V = typename I::V;
    constexpr size_t W = I::W;
    V bad = I::zero();
    size_t i = begin;
    // The 16-bit param copy is write-only in this pass (read next by a GPU copy or a file write), so
    // streaming it saves the read-for-ownership of its lines and keeps it from evicting the arrays still
    // being read. Param and states are read first, so streaming them saves no traffic (kStreamAll is
    // there to measure that).
    int policy = kStreamNone;
    if constexpr (I::kCanStream) {
        if (end - begin >= kMinStreamElems) policy = stream_policy();
    }
    const bool stream_copy = CT != kNone && policy != kStreamNone && vector_aligned<I, CT>(a.copy, begin);
    const bool stream_rmw = policy == kStreamAll && vector_aligned<I, PT>(a.param, begin) &&
                            vector_aligned<I, ST>(a.state_a, begin) &&
                            (a.state_b == nullptr || vector_aligned<I, ST>(a.state_b, begin)) &&
                            (CT == kNone || stream_copy);
    if (stream_rmw) {
        for (; i + W <= end; i += W) body(a, i, i, bad, std::true_type{}, std::true_type{});
    } else if (stream_copy) {
        for (; i + W <= end; i += W) body(a, i, i, bad, std::false_type{}, std::true_type{});
    } else {
        for (; i + W <= end; i += W) body(a, i, i, bad, std::false_type{}, std::false_type{});
    }
    // Orders the non-temporal stores before the pool reports the step done.
    if (stream_rmw || stream_copy) I::stream_fence();
    if (i < end) {
        const size_t n = end - i;
        alignas(64) unsigned char pbuf[W * 4] = {};
        alignas(64) unsigned char gbuf[W * 4] = {};
        alignas(64) unsigned char abuf[W * 4] = {};
        alignas(64) unsigned char bbuf[W * 4] = {};
        alignas(64) unsigned char cbuf[W * 4] = {};
        Arrays t = a;
        const size_t ps = elem_size<PT>(), gs = elem_size<GT>(), ss = elem_size<ST>(), cs = elem_size<CT>();
        copy_bytes(pbuf, static_cast<const char*>(a.param) + i * ps, n * ps);
        copy_bytes(gbuf, static_cast<const char*>(a.grad) + i * gs, n * gs);
        copy_bytes(abuf, static_cast<const char*>(a.state_a) + i * ss, n * ss);
        t.param = pbuf;
        t.grad = gbuf;
        t.state_a = abuf;
        if (a.state_b != nullptr) {
            copy_bytes(bbuf, static_cast<const char*>(a.state_b) + i * ss, n * ss);
            t.state_b = bbuf;
        }
        if (CT != kNone) t.copy = cbuf;
        body(t, 0, i, bad, std::false_type{}, std::false_type{});
        copy_bytes(static_cast<char*>(a.param) + i * ps, pbuf, n * ps);
        copy_bytes(static_cast<char*>(a.state_a) + i * ss, abuf, n * ss);
        if (a.state_b != nullptr) copy_bytes(static_cast<char*>(a.state_b) + i * ss, bbuf, n * ss);
        if (CT != kNone) copy_bytes(static_cast<char*>(a.copy) + i * cs, cbuf, n * cs);
    }
    return I::none_nan(bad);
}

// ---- stochastic rounding of bf16 states --------------------------------------------------------------

// Chris Wellons' lowbias32 integer hash (a bijection of uint32).
inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

// The per-element hash input's key: k0, folded with the high 32 bits of the element index when not 0.
inline uint32_t sr_key(const Arrays& a, uint32_t hi) {
    return a.sr_k0 ^ (hi == 0 ? 0u : lowbias32(hi ^ a.sr_k1));
}

// 32 random bits for each lane: lowbias32(lo32(gi + lane) ^ sr_key(hi32(gi + lane))). They depend only on
// the keys and the element index, never on the thread or ISA that computes them.
template <class I>
ZO_INLINE typename I::VI sr_random(const Arrays& a, size_t gi) {
    using VI = typename I::VI;
    const uint64_t first = a.first_index + gi, last = first + I::W - 1;
    VI x;
    if ((first >> 32) == (last >> 32)) {
        x = I::ixor(I::iota(static_cast<uint32_t>(first)),
                    I::iset1(sr_key(a, static_cast<uint32_t>(first >> 32))));
    } else {  // the vector straddles a multiple of 2^32 elements
        alignas(64) uint32_t in[I::W];
        for (size_t l = 0; l < I::W; ++l) {
            const uint64_t e = first + l;
            in[l] = static_cast<uint32_t>(e) ^ sr_key(a, static_cast<uint32_t>(e >> 32));
        }
        x = I::iload(in);
    }
    x = I::ixor(x, I::template isrl<16>(x));
    x = I::imul(x, I::iset1(0x7FEB352Du));
    x = I::ixor(x, I::template isrl<15>(x));
    x = I::imul(x, I::iset1(0x846CA68Bu));
    return I::ixor(x, I::template isrl<16>(x));
}

// Random bits for a state of dtype ST (only kBF16SR uses them; the others get a constant the compiler
// drops).
template <class I, int ST>
ZO_INLINE typename I::VI state_random(const Arrays& a, size_t gi) {
    if constexpr (ST == kBF16SR) {
        return sr_random<I>(a, gi);
    } else {
        return I::iset1(0);
    }
}

// Stores a state vector: kBF16SR adds 16 random bits (the high half of rnd when Hi, else the low half)
// below bf16's last kept bit and truncates, so a value rounds up in magnitude with probability equal to
// the dropped fraction. NaN stores 0xFFFF as in the nearest-even path. Other dtypes: the plain store.
template <class I, int ST, bool Stream, bool Hi>
ZO_INLINE void store_state(void* base, size_t i, typename I::V v, typename I::VI rnd) {
    if constexpr (ST == kBF16SR) {
        using VI = typename I::VI;
        const VI r16 = Hi ? I::template isrl<16>(rnd) : I::iand(rnd, I::iset1(0xFFFF));
        VI out = I::template isrl<16>(I::iadd(I::bits(v), r16));
        out = I::iselect(I::fnan(v), I::iset1(0xFFFF), out);
        I::store_u16(static_cast<uint16_t*>(base) + i, out);
    } else {
        store<I, ST, Stream>(base, i, v);
    }
}

// ---- 8-bit block-quantized states ----------------------------------------------------------------------

// fp32 values in [-1, 1] of W codes (offload/ops/quant.py's format): a normal magnitude code c = e<<3 | m
// is the fp32 with exponent e - emax and mantissa m (bits (c << 20) + ((127 - emax) << 23)), a subnormal
// one (e = 0) is m * 2^(-emax-2). Signed codes carry the sign in bit 7.
template <class I, bool Signed>
ZO_INLINE typename I::V decode8(const uint8_t* p) {
    using VI = typename I::VI;
    constexpr int emax = Signed ? kEmaxSigned : kEmaxUnsigned;
    const VI c = I::load_u8(p);
    const VI mag = Signed ? I::iand(c, I::iset1(0x7F)) : c;
    const typename I::V normal =
        I::from_bits(I::iadd(I::template isll<20>(mag), I::iset1(static_cast<uint32_t>(127 - emax) << 23)));
    const typename I::V sub =
        I::mul(I::cvt_i2f(I::iand(mag, I::iset1(7))), I::set1(std::ldexp(1.0f, -emax - 2)));
    VI val = I::iselect(I::ilt(mag, I::iset1(8)), I::bits(sub), I::bits(normal));
    if constexpr (Signed) val = I::ixor(val, I::template isll<24>(I::iand(c, I::iset1(0x80))));
    return I::from_bits(val);
}

// Codes of W values x given the block's scale: r = |x| * inv (or |x| / absmax when use_div), rounded to
// the nearest code, ties to even: round-to-nearest-even of r's fp32 bits to 3 mantissa bits for
// r >= 2^(1-emax), else the nearest multiple of 2^(-emax-2). A negative x with a nonzero code gets bit 7.
template <class I, bool Signed>
ZO_INLINE void encode8(uint8_t* p, typename I::V x, typename I::V inv, typename I::V absmax, bool use_div) {
    using V = typename I::V;
    using VI = typename I::VI;
    constexpr int emax = Signed ? kEmaxSigned : kEmaxUnsigned;
    const V ax = I::fabs(x);
    const V r = use_div ? I::div(ax, absmax) : I::mul(ax, inv);
    const VI u = I::bits(r);
    const VI odd = I::iand(I::template isrl<20>(u), I::iset1(1));
    const VI normal = I::isub(I::template isrl<20>(I::iadd(u, I::iadd(I::iset1(0x7FFFF), odd))),
                              I::iset1(static_cast<uint32_t>(127 - emax) << 3));
    const VI sub = I::cvt_f2i(I::mul(r, I::set1(std::ldexp(1.0f, emax + 2))));
    VI code = I::iselect(I::fge(r, I::set1(std::ldexp(1.0f, 1 - emax))), normal, sub);
    if constexpr (Signed) {
        const VI neg = I::iand(I::flt(x, I::zero()), I::ilt(I::iset1(0), code));
        code = I::ior(code, I::iand(neg, I::iset1(0x80)));
    }
    I::store_u8(p, code);
}

// Re-quantizes one block's updated fp32 values `buf` (len real values, zero padding up to a multiple of
// W) into codes at q and writes the new absmax. `bad` is NaN in a lane that saw inf or NaN: such a block
// stores absmax NaN and all codes 0 (it dequantizes to NaN). An all-zero block stores absmax 0.
template <class I, bool Signed>
inline void requantize_block(const float* buf, size_t len, typename I::V vmax, typename I::V bad, uint8_t* q,
                             float* absmax_out) {
    using V = typename I::V;
    constexpr size_t W = I::W;
    if (!I::none_nan(bad)) {
        std::memset(q, 0, len);
        *absmax_out = std::numeric_limits<float>::quiet_NaN();
        return;
    }
    const float am = I::hmax(vmax);
    const float inv_s = am == 0.0f ? 0.0f : 1.0f / am;
    // A subnormal absmax has a reciprocal beyond fp32: that block divides instead.
    const bool use_div = am != 0.0f && !(inv_s <= std::numeric_limits<float>::max());
    const V inv = I::set1(inv_s), absmax = I::set1(am);
    size_t j = 0;
    for (; j + W <= len; j += W) encode8<I, Signed>(q + j, I::load_f32(buf + j), inv, absmax, use_div);
    if (j < len) {
        alignas(64) uint8_t tmp[W];
        encode8<I, Signed>(tmp, I::load_f32(buf + j), inv, absmax, use_div);
        copy_bytes(q + j, tmp, len - j);
    }
    *absmax_out = am;
}

// Runs an optimizer over [begin, end) (multiples of kQuantBlock, or end = n) with kU8 states: for each
// block, dequantize state_a (signed or unsigned map) and state_b (unsigned, when TwoStates), apply
// math(g, p, m, v) in fp32, write param and copy, keep the new states in fp32 block buffers, then
// re-quantize them with the block's new absmax. The last partial vector of a block is staged through
// zero-padded buffers like run_range's tail (its padding lanes compute 0 from 0 inputs, which cannot
// raise the absmax).
template <class I, int PT, int GT, int CT, bool SignedA, bool TwoStates, class Math>
bool run_blocks_u8(const Arrays& arrays, size_t begin, size_t end, const Math& math_in) {
    using V = typename I::V;
    constexpr size_t W = I::W;
    constexpr size_t B = kQuantBlock;
    const Arrays a = arrays;
    const Math math = math_in;
    V bad = I::zero();
    alignas(64) float buf_a[B];
    alignas(64) float buf_b[TwoStates ? B : W];
    const auto body = [&](void* p_at, const void* g_at, const uint8_t* qa, const uint8_t* qb, void* c_at,
                          size_t j, V scale_a, V scale_b, V& max_a, V& max_b, V& bad_a, V& bad_b) {
        V g = load<I, GT>(g_at, 0);
        bad = track_nonfinite<I>(bad, g);
        V p = load<I, PT>(p_at, 0);
        V m = I::mul(decode8<I, SignedA>(qa), scale_a);
        V v = I::zero();
        if constexpr (TwoStates) v = I::mul(decode8<I, false>(qb), scale_b);
        math(g, p, m, v);
        store<I, PT, false>(p_at, 0, p);
        store<I, CT, false>(c_at, 0, p);
        I::store_f32(buf_a + j, m);
        max_a = I::fmax(I::fabs(m), max_a);
        bad_a = track_nonfinite<I>(bad_a, m);
        if constexpr (TwoStates) {
            I::store_f32(buf_b + j, v);
            max_b = I::fmax(I::fabs(v), max_b);
            bad_b = track_nonfinite<I>(bad_b, v);
        }
    };
    const size_t ps = elem_size<PT>(), gs = elem_size<GT>(), cs = elem_size<CT>();
    for (size_t bb = begin; bb < end; bb += B) {
        const size_t len = std::min(B, end - bb), blk = bb / B;
        const V scale_a = I::set1(a.absmax_a[blk]);
        const V scale_b = TwoStates ? I::set1(a.absmax_b[blk]) : I::zero();
        V max_a = I::zero(), max_b = I::zero(), bad_a = I::zero(), bad_b = I::zero();
        auto* qa = static_cast<uint8_t*>(a.state_a) + bb;
        auto* qb = TwoStates ? static_cast<uint8_t*>(a.state_b) + bb : nullptr;
        char* pp = static_cast<char*>(a.param) + bb * ps;
        const char* gp = static_cast<const char*>(a.grad) + bb * gs;
        char* cp = CT == kNone ? nullptr : static_cast<char*>(a.copy) + bb * cs;
        size_t j = 0;
        for (; j + W <= len; j += W) {
            body(pp + j * ps, gp + j * gs, qa + j, TwoStates ? qb + j : nullptr,
                 CT == kNone ? nullptr : cp + j * cs, j, scale_a, scale_b, max_a, max_b, bad_a, bad_b);
        }
        if (j < len) {
            const size_t r = len - j;
            alignas(64) unsigned char pbuf[W * 4] = {}, gbuf[W * 4] = {}, cbuf[W * 4] = {};
            alignas(64) uint8_t qabuf[W] = {}, qbbuf[W] = {};
            copy_bytes(pbuf, pp + j * ps, r * ps);
            copy_bytes(gbuf, gp + j * gs, r * gs);
            copy_bytes(qabuf, qa + j, r);
            if (TwoStates) copy_bytes(qbbuf, qb + j, r);
            body(pbuf, gbuf, qabuf, qbbuf, cbuf, j, scale_a, scale_b, max_a, max_b, bad_a, bad_b);
            copy_bytes(pp + j * ps, pbuf, r * ps);
            if (CT != kNone) copy_bytes(cp + j * cs, cbuf, r * cs);
        }
        requantize_block<I, SignedA>(buf_a, len, max_a, bad_a, qa, a.absmax_a + blk);
        if constexpr (TwoStates) requantize_block<I, false>(buf_b, len, max_b, bad_b, qb, a.absmax_b + blk);
    }
    return I::none_nan(bad);
}

// ---- the optimizers' element math, shared by the fp32/bf16 and the 8-bit paths --------------------

// torch: param.mul_(1 - lr*wd) | grad = grad.add(param, alpha=wd); exp_avg.lerp_(grad, 1 - beta1);
// exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
// denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, value=-step_size)
template <class I>
struct AdamMath {
    using V = typename I::V;
    V grad_scale, decay_mul, wd, lerp_w, lerp_w_m1, beta2, omb2, bc2, eps, neg_step;
    bool unscale, lerp_small;
    int decay_mode;
    explicit AdamMath(const AdamConsts& c)
        : grad_scale(I::set1(c.grad_scale)),
          decay_mul(I::set1(c.decay_mul)),
          wd(I::set1(c.weight_decay)),
          lerp_w(I::set1(c.lerp_weight)),
          lerp_w_m1(I::sub(I::set1(c.lerp_weight), I::set1(1.0f))),  // torch's large-weight lerp formula
          beta2(I::set1(c.beta2)),
          omb2(I::set1(c.one_minus_beta2)),
          bc2(I::set1(c.bc2_sqrt)),
          eps(I::set1(c.eps)),
          neg_step(I::set1(c.neg_step_size)),
          unscale(c.unscale),
          lerp_small(c.lerp_small),
          decay_mode(c.decay_mode) {}
    ZO_INLINE void operator()(V g, V& p, V& m, V& v) const {
        if (unscale) g = I::div(g, grad_scale);
        if (decay_mode == 1) {
            p = I::mul(p, decay_mul);
        } else if (decay_mode == 2) {
            g = I::fmadd(p, wd, g);
        }
        const V diff = I::sub(g, m);
        m = lerp_small ? I::fmadd(lerp_w, diff, m) : I::fmadd(lerp_w_m1, diff, g);
        v = I::mul(v, beta2);
        v = I::fmadd(I::mul(omb2, g), g, v);
        const V denom = I::add(I::div(I::sqrt(v), bc2), eps);
        p = I::add(p, I::div(I::mul(neg_step, m), denom));
    }
};

// torch: grad = grad.add(param, alpha=wd); state_sum.addcmul_(grad, grad, value=1);
// std = state_sum.sqrt().add_(eps); param.addcdiv_(grad, std, value=-clr)
template <class I>
struct AdagradMath {
    using V = typename I::V;
    V grad_scale, wd, eps, neg_lr;
    bool unscale, l2;
    explicit AdagradMath(const AdagradConsts& c)
        : grad_scale(I::set1(c.grad_scale)),
          wd(I::set1(c.weight_decay)),
          eps(I::set1(c.eps)),
          neg_lr(I::set1(c.neg_lr)),
          unscale(c.unscale),
          l2(c.l2) {}
    ZO_INLINE void operator()(V g, V& p, V& s, V&) const {
        if (unscale) g = I::div(g, grad_scale);
        if (l2) g = I::fmadd(p, wd, g);
        s = I::fmadd(g, g, s);
        const V std_dev = I::add(I::sqrt(s), eps);
        p = I::add(p, I::div(I::mul(neg_lr, g), std_dev));
    }
};

// Lion (Chen et al. 2023, decoupled decay as in lucidrains/lion-pytorch), in torch ops:
// param.mul_(1 - lr*wd); update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_();
// param.add_(update, alpha=-lr); exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
template <class I>
struct LionMath {
    using V = typename I::V;
    V grad_scale, decay_mul, beta1, omb1, beta2, omb2, neg_lr;
    bool unscale, decay;
    explicit LionMath(const LionConsts& c)
        : grad_scale(I::set1(c.grad_scale)),
          decay_mul(I::set1(c.decay_mul)),
          beta1(I::set1(c.beta1)),
          omb1(I::set1(c.one_minus_beta1)),
          beta2(I::set1(c.beta2)),
          omb2(I::set1(c.one_minus_beta2)),
          neg_lr(I::set1(c.neg_lr)),
          unscale(c.unscale),
          decay(c.decay) {}
    ZO_INLINE void operator()(V g, V& p, V& m, V&) const {
        if (unscale) g = I::div(g, grad_scale);
        if (decay) p = I::mul(p, decay_mul);
        const V update = I::sign(I::fmadd(g, omb1, I::mul(m, beta1)));
        p = I::fmadd(update, neg_lr, p);
        m = I::fmadd(g, omb2, I::mul(m, beta2));
    }
};

// One pass over [begin, end) for fp32 / bf16 / stochastically rounded bf16 states (ST), or the 8-bit
// block driver for kU8.
template <class I, int PT, int GT, int ST, int CT, bool SignedA, bool TwoStates, class Math>
bool run_optimizer(const Arrays& arrays, const Math& math, size_t begin, size_t end) {
    using V = typename I::V;
    if constexpr (ST == kU8) {
        return run_blocks_u8<I, PT, GT, CT, SignedA, TwoStates>(arrays, begin, end, math);
    } else {
        auto body = [=](const Arrays& a, size_t i, size_t gi, V& bad, auto rmw, auto cp) {
            constexpr bool kRmw = decltype(rmw)::value;
            V g = load<I, GT>(a.grad, i);
            bad = track_nonfinite<I>(bad, g);
            V p = load<I, PT>(a.param, i);
            V m = load<I, ST>(a.state_a, i);
            V v = I::zero();
            if constexpr (TwoStates) v = load<I, ST>(a.state_b, i);
            math(g, p, m, v);
            const auto rnd = state_random<I, ST>(a, gi);
            store<I, PT, kRmw>(a.param, i, p);
            store_state<I, ST, kRmw, true>(a.state_a, i, m, rnd);
            if constexpr (TwoStates) store_state<I, ST, kRmw, false>(a.state_b, i, v, rnd);
            store<I, CT, decltype(cp)::value>(a.copy, i, p);
        };
        return run_range<I, PT, GT, ST, CT>(arrays, begin, end, body);
    }
}

template <class I, int PT, int GT, int ST, int CT>
bool adam_impl(const Arrays& a, const AdamConsts& c, size_t begin, size_t end) {
    return run_optimizer<I, PT, GT, ST, CT, true, true>(a, AdamMath<I>(c), begin, end);
}

template <class I, int PT, int GT, int ST, int CT>
bool adagrad_impl(const Arrays& a, const AdagradConsts& c, size_t begin, size_t end) {
    return run_optimizer<I, PT, GT, ST, CT, false, false>(a, AdagradMath<I>(c), begin, end);
}

template <class I, int PT, int GT, int ST, int CT>
bool lion_impl(const Arrays& a, const LionConsts& c, size_t begin, size_t end) {
    return run_optimizer<I, PT, GT, ST, CT, true, false>(a, LionMath<I>(c), begin, end);
}

template <class I, int D>
bool all_finite_impl(const void* data, size_t begin, size_t end) {
    using V = typename I::V;
    constexpr size_t W = I::W;
    V bad = I::zero();
    size_t i = begin;
    for (; i + W <= end; i += W) bad = track_nonfinite<I>(bad, load<I, D>(data, i));
    if (i < end) {
        alignas(64) unsigned char buf[W * 4] = {};
        copy_bytes(buf, static_cast<const char*>(data) + i * elem_size<D>(), (end - i) * elem_size<D>());
        bad = track_nonfinite<I>(bad, load<I, D>(buf, 0));
    }
    return I::none_nan(bad);
}

}  // namespace
}  // namespace zo_optim
