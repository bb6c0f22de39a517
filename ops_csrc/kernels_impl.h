// The optimizer kernels, written once against a small SIMD interface `I` and compiled once per ISA.
//
// Include this header only from a kernels_<isa>.cpp file, after its target pragma and after the ISA
// struct is defined. Everything here lives in an anonymous namespace so that each translation unit keeps
// its own copy compiled for its own target: inline functions shared by name across units could otherwise
// be merged by the linker into one compiled for the wrong CPU.
//
// Interface required of I: type V (fp32 lanes), constant W (lane count), and static functions zero, set1,
// add, sub, mul, div, sqrt, fmadd (a * b + c, one rounding), sign (torch.sign: +1, -1, +0 for zeros and
// NaN), load_f32/load_bf16/load_f16, store_f32/store_bf16/store_f16, none_nan (no NaN lane), and for
// non-temporal stores kCanStream (false: never stream), stream_f32, stream_bf16, stream_f16 (aligned to
// the vector width) and stream_fence.
//
// Floating-point order mirrors torch's eager CPU ops for fp32 tensors (checked bit for bit in the tests):
// a torch op that torch vectorizes with an FMA (lerp, add with alpha, addcmul) is one fmadd here, every
// other op is rounded separately. The including file turns off FP contraction so the compiler cannot fuse
// a multiply and an add that torch rounds twice.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_optim.h"

namespace zo_optim {
namespace {

template <int D>
constexpr size_t elem_size() {
    return D == kF32 ? 4 : 2;
}

template <class I, int D>
inline typename I::V load(const void* base, size_t i) {
    if constexpr (D == kF32) {
        return I::load_f32(static_cast<const float*>(base) + i);
    } else if constexpr (D == kBF16) {
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
// element in the middle of the array; only the real elements are copied back.
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
        for (; i + W <= end; i += W) body(a, i, bad, std::true_type{}, std::true_type{});
    } else if (stream_copy) {
        for (; i + W <= end; i += W) body(a, i, bad, std::false_type{}, std::true_type{});
    } else {
        for (; i + W <= end; i += W) body(a, i, bad, std::false_type{}, std::false_type{});
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
        body(t, 0, bad, std::false_type{}, std::false_type{});
        copy_bytes(static_cast<char*>(a.param) + i * ps, pbuf, n * ps);
        copy_bytes(static_cast<char*>(a.state_a) + i * ss, abuf, n * ss);
        if (a.state_b != nullptr) copy_bytes(static_cast<char*>(a.state_b) + i * ss, bbuf, n * ss);
        if (CT != kNone) copy_bytes(static_cast<char*>(a.copy) + i * cs, cbuf, n * cs);
    }
    return I::none_nan(bad);
}

// torch: param.mul_(1 - lr*wd) | grad = grad.add(param, alpha=wd); exp_avg.lerp_(grad, 1 - beta1);
// exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
// denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, value=-step_size)
template <class I, int PT, int GT, int ST, int CT>
bool adam_impl(const Arrays& arrays, const AdamConsts& c, size_t begin, size_t end) {
    using V = typename I::V;
    const V grad_scale = I::set1(c.grad_scale), decay_mul = I::set1(c.decay_mul);
    const V wd = I::set1(c.weight_decay), lerp_w = I::set1(c.lerp_weight);
    const V lerp_w_m1 =
        I::sub(lerp_w, I::set1(1.0f));  // torch's large-weight lerp: end + (w - 1) * (end - start)
    const V beta2 = I::set1(c.beta2), omb2 = I::set1(c.one_minus_beta2), bc2 = I::set1(c.bc2_sqrt);
    const V eps = I::set1(c.eps), neg_step = I::set1(c.neg_step_size);
    auto body = [=](const Arrays& a, size_t i, V& bad, auto rmw, auto cp) {
        V g = load<I, GT>(a.grad, i);
        bad = track_nonfinite<I>(bad, g);
        if (c.unscale) g = I::div(g, grad_scale);
        V p = load<I, PT>(a.param, i);
        if (c.decay_mode == 1) {
            p = I::mul(p, decay_mul);
        } else if (c.decay_mode == 2) {
            g = I::fmadd(p, wd, g);
        }
        V m = load<I, ST>(a.state_a, i);
        V v = load<I, ST>(a.state_b, i);
        const V diff = I::sub(g, m);
        m = c.lerp_small ? I::fmadd(lerp_w, diff, m) : I::fmadd(lerp_w_m1, diff, g);
        v = I::mul(v, beta2);
        v = I::fmadd(I::mul(omb2, g), g, v);
        const V denom = I::add(I::div(I::sqrt(v), bc2), eps);
        p = I::add(p, I::div(I::mul(neg_step, m), denom));
        store<I, PT, decltype(rmw)::value>(a.param, i, p);
        store<I, ST, decltype(rmw)::value>(a.state_a, i, m);
        store<I, ST, decltype(rmw)::value>(a.state_b, i, v);
        store<I, CT, decltype(cp)::value>(a.copy, i, p);
    };
    return run_range<I, PT, GT, ST, CT>(arrays, begin, end, body);
}

// torch: grad = grad.add(param, alpha=wd); state_sum.addcmul_(grad, grad, value=1);
// std = state_sum.sqrt().add_(eps); param.addcdiv_(grad, std, value=-clr)
template <class I, int PT, int GT, int ST, int CT>
bool adagrad_impl(const Arrays& arrays, const AdagradConsts& c, size_t begin, size_t end) {
    using V = typename I::V;
    const V grad_scale = I::set1(c.grad_scale), wd = I::set1(c.weight_decay);
    const V eps = I::set1(c.eps), neg_lr = I::set1(c.neg_lr);
    auto body = [=](const Arrays& a, size_t i, V& bad, auto rmw, auto cp) {
        V g = load<I, GT>(a.grad, i);
        bad = track_nonfinite<I>(bad, g);
        if (c.unscale) g = I::div(g, grad_scale);
        V p = load<I, PT>(a.param, i);
        if (c.l2) g = I::fmadd(p, wd, g);
        V s = load<I, ST>(a.state_a, i);
        s = I::fmadd(g, g, s);
        const V std_dev = I::add(I::sqrt(s), eps);
        p = I::add(p, I::div(I::mul(neg_lr, g), std_dev));
        store<I, PT, decltype(rmw)::value>(a.param, i, p);
        store<I, ST, decltype(rmw)::value>(a.state_a, i, s);
        store<I, CT, decltype(cp)::value>(a.copy, i, p);
    };
    return run_range<I, PT, GT, ST, CT>(arrays, begin, end, body);
}

// Lion (Chen et al. 2023, decoupled decay as in lucidrains/lion-pytorch), in torch ops:
// param.mul_(1 - lr*wd); update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_();
// param.add_(update, alpha=-lr); exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
template <class I, int PT, int GT, int ST, int CT>
bool lion_impl(const Arrays& arrays, const LionConsts& c, size_t begin, size_t end) {
    using V = typename I::V;
    const V grad_scale = I::set1(c.grad_scale), decay_mul = I::set1(c.decay_mul);
    const V beta1 = I::set1(c.beta1), omb1 = I::set1(c.one_minus_beta1);
    const V beta2 = I::set1(c.beta2), omb2 = I::set1(c.one_minus_beta2), neg_lr = I::set1(c.neg_lr);
    auto body = [=](const Arrays& a, size_t i, V& bad, auto rmw, auto cp) {
        V g = load<I, GT>(a.grad, i);
        bad = track_nonfinite<I>(bad, g);
        if (c.unscale) g = I::div(g, grad_scale);
        V p = load<I, PT>(a.param, i);
        if (c.decay) p = I::mul(p, decay_mul);
        V m = load<I, ST>(a.state_a, i);
        const V update = I::sign(I::fmadd(g, omb1, I::mul(m, beta1)));
        p = I::fmadd(update, neg_lr, p);
        m = I::fmadd(g, omb2, I::mul(m, beta2));
        store<I, PT, decltype(rmw)::value>(a.param, i, p);
        store<I, ST, decltype(rmw)::value>(a.state_a, i, m);
        store<I, CT, decltype(cp)::value>(a.copy, i, p);
    };
    return run_range<I, PT, GT, ST, CT>(arrays, begin, end, body);
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

// Turns the run-time dtype codes into template arguments. Only the combinations the Python layer
// accepts are instantiated: param and grad any of fp32/bf16/fp16, states fp32/bf16, copy none/bf16/fp16.
template <class F>
bool with_value_dtype(int d, const F& f) {
    switch (d) {
        case kF32:
            return f(std::integral_constant<int, kF32>{});
        case kBF16:
            return f(std::integral_constant<int, kBF16>{});
        default:
            return f(std::integral_constant<int, kF16>{});
    }
}

template <class F>
bool with_state_dtype(int d, const F& f) {
    if (d == kBF16) return f(std::integral_constant<int, kBF16>{});
    return f(std::integral_constant<int, kF32>{});
}

template <class F>
bool with_copy_dtype(int d, const F& f) {
    switch (d) {
        case kBF16:
            return f(std::integral_constant<int, kBF16>{});
        case kF16:
            return f(std::integral_constant<int, kF16>{});
        default:
            return f(std::integral_constant<int, kNone>{});
    }
}

// Calls Impl<PT, GT, ST, CT>::run for the dtypes in `a`.
template <template <int, int, int, int> class Impl, class Consts>
bool dispatch_dtypes(const Arrays& a, const Consts& c, size_t begin, size_t end) {
    return with_value_dtype(a.param_dtype, [&](auto pt) {
        return with_value_dtype(a.grad_dtype, [&](auto gt) {
            return with_state_dtype(a.state_dtype, [&](auto st) {
                return with_copy_dtype(a.copy_dtype, [&](auto ct) {
                    return Impl<decltype(pt)::value, decltype(gt)::value, decltype(st)::value,
                                decltype(ct)::value>::run(a, c, begin, end);
                });
            });
        });
    });
}

}  // namespace
}  // namespace zo_optim

// Defines the four entry points of one ISA; `I` is the ISA struct of the including file.
#define ZO_DEFINE_ISA_ENTRY_POINTS(isa, I)                                                                   \
    namespace zo_optim {                                                                                     \
    namespace {                                                                                              \
    template <int PT, int GT, int ST, int CT>                                                                \
    struct AdamRun_##isa {                                                                                   \
        static bool run(const Arrays& a, const AdamConsts& c, size_t b, size_t e) {                          \
            return adam_impl<I, PT, GT, ST, CT>(a, c, b, e);                                                 \
        }                                                                                                    \
    };                                                                                                       \
    template <int PT, int GT, int ST, int CT>                                                                \
    struct AdagradRun_##isa {                                                                                \
        static bool run(const Arrays& a, const AdagradConsts& c, size_t b, size_t e) {                       \
            return adagrad_impl<I, PT, GT, ST, CT>(a, c, b, e);                                              \
        }                                                                                                    \
    };                                                                                                       \
    template <int PT, int GT, int ST, int CT>                                                                \
    struct LionRun_##isa {                                                                                   \
        static bool run(const Arrays& a, const LionConsts& c, size_t b, size_t e) {                          \
            return lion_impl<I, PT, GT, ST, CT>(a, c, b, e);                                                 \
        }                                                                                                    \
    };                                                                                                       \
    }                                                                                                        \
    bool adam_##isa(const Arrays& a, const AdamConsts& c, size_t b, size_t e) {                              \
        return dispatch_dtypes<AdamRun_##isa>(a, c, b, e);                                                   \
    }                                                                                                        \
    bool adagrad_##isa(const Arrays& a, const AdagradConsts& c, size_t b, size_t e) {                        \
        return dispatch_dtypes<AdagradRun_##isa>(a, c, b, e);                                                \
    }                                                                                                        \
    bool lion_##isa(const Arrays& a, const LionConsts& c, size_t b, size_t e) {                              \
        return dispatch_dtypes<LionRun_##isa>(a, c, b, e);                                                   \
    }                                                                                                        \
    bool all_finite_##isa(const void* data, int dtype, size_t b, size_t e) {                                 \
        return with_value_dtype(dtype,                                                                       \
                                [&](auto d) { return all_finite_impl<I, decltype(d)::value>(data, b, e); }); \
    }                                                                                                        \
    }
