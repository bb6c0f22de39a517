// Which compiled kernel a call runs, and the entry points of one ISA: the run-time dtype codes become
// template arguments for the fused combinations, every other combination runs the fp32 kernel over fp32
// chunks (run_converted), and the ZO_DEFINE_*_ENTRY_POINT macros define one ISA's optimizers.
//
// Include this header only from an isa_<isa>.h file, after its target pragma and after the ISA struct
// is defined; like kernels_impl.h (which it includes) it keeps everything in an anonymous namespace, so
// each translation unit's copy is compiled for its own target.
#pragma once

#include "kernels_impl.h"

namespace zo_optim {
namespace {

// ---- 16-bit params: conversion through fp32 chunks -------------------------------------------------

// Converts n elements starting at element `at` of `src` (dtype D) to fp32 at dst, W at a time through the
// ISA's own loads (the last partial vector staged through a zero-padded buffer).
template <class I, int D>
void to_f32(const void* src, size_t at, float* dst, size_t n) {
    constexpr size_t W = I::W;
    size_t j = 0;
    for (; j + W <= n; j += W) I::store_f32(dst + j, load<I, D>(src, at + j));
    if (j < n) {
        alignas(64) unsigned char in[W * 4] = {};
        alignas(64) float out[W];
        copy_bytes(in, static_cast<const char*>(src) + (at + j) * elem_size<D>(), (n - j) * elem_size<D>());
        I::store_f32(out, load<I, D>(in, 0));
        copy_bytes(dst + j, out, (n - j) * sizeof(float));
    }
}

// Rounds n fp32 values at src into dtype D at element `at` of dst with the ISA's own stores (the kernels'
// rounding: nearest even); kNone writes nothing.
template <class I, int D>
void from_f32(const float* src, void* dst, size_t at, size_t n) {
    if constexpr (D != kNone) {
        constexpr size_t W = I::W;
        size_t j = 0;
        for (; j + W <= n; j += W) store<I, D, false>(dst, at + j, I::load_f32(src + j));
        if (j < n) {
            alignas(64) float in[W] = {};
            alignas(64) unsigned char out[W * 4];
            copy_bytes(in, src + j, (n - j) * sizeof(float));
            store<I, D, false>(out, 0, I::load_f32(in));
            copy_bytes(static_cast<char*>(dst) + (at + j) * elem_size<D>(), out, (n - j) * elem_size<D>());
        }
    }
}

template <class I>
void value_to_f32(int d, const void* src, size_t at, float* dst, size_t n) {
    if (d == kBF16) {
        to_f32<I, kBF16>(src, at, dst, n);
    } else if (d == kF16) {
        to_f32<I, kF16>(src, at, dst, n);
    } else {
        to_f32<I, kF32>(src, at, dst, n);
    }
}

template <class I>
void value_from_f32(int d, const float* src, void* dst, size_t at, size_t n) {
    if (d == kBF16) {
        from_f32<I, kBF16>(src, dst, at, n);
    } else if (d == kF16) {
        from_f32<I, kF16>(src, dst, at, n);
    } else if (d == kF32) {
        from_f32<I, kF32>(src, dst, at, n);
    }
}

inline void* byte_offset(void* p, size_t bytes) {
    return p == nullptr ? nullptr : static_cast<void*>(static_cast<char*>(p) + bytes);
}

// Runs `fp32_kernel` (the fused kernel for an fp32 param and grad, no copy, states of dtype ST) for any
// param, grad and copy dtypes, one chunk at a time: a 16-bit param or grad chunk is converted to fp32 in a
// local buffer (an fp32 one is used in place), the kernel updates param and states, then a 16-bit param is
// rounded back and the copy is written from the fp32 result while the chunk is still in cache. Every
// element gets the operations and roundings of a fused kernel (16-bit values convert to fp32 exactly, and
// the stores round the same fp32 result the same way), so the results are bit-identical. A chunk is one
// quantization block, so 8-bit state blocks stay whole.
template <class I, int ST, class Kernel>
bool run_converted(const Arrays& a, size_t begin, size_t end, const Kernel& fp32_kernel) {
    constexpr size_t C = kQuantBlock;
    alignas(64) float pbuf[C];
    alignas(64) float gbuf[C];
    const bool convert_param = a.param_dtype != kF32, convert_grad = a.grad_dtype != kF32;
    const size_t ss = elem_size<ST>();
    bool ok = true;
    for (size_t c = begin; c < end; c += C) {
        const size_t n = std::min(C, end - c);
        float* const p = convert_param ? pbuf : static_cast<float*>(a.param) + c;
        if (convert_param) value_to_f32<I>(a.param_dtype, a.param, c, pbuf, n);
        if (convert_grad) value_to_f32<I>(a.grad_dtype, a.grad, c, gbuf, n);
        Arrays t = a;
        t.param = p;
        t.grad = convert_grad ? gbuf : static_cast<const float*>(a.grad) + c;
        t.param_dtype = t.grad_dtype = kF32;
        t.copy = nullptr;
        t.copy_dtype = kNone;
        t.state_a = byte_offset(a.state_a, c * ss);
        t.state_b = byte_offset(a.state_b, c * ss);
        if constexpr (ST == kU8) {
            t.absmax_a = a.absmax_a + c / C;
            if (a.absmax_b != nullptr) t.absmax_b = a.absmax_b + c / C;
        }
        t.first_index = a.first_index + c;
        ok = fp32_kernel(t, n) && ok;
        if (convert_param) value_from_f32<I>(a.param_dtype, pbuf, a.param, c, n);
        value_from_f32<I>(a.copy_dtype, p, a.copy, c, n);
    }
    return ok;
}

// Turns the run-time dtype codes into template arguments. The Python layer accepts param and grad any of
// fp32/bf16/fp16, states fp32/bf16 (nearest even or stochastic)/8-bit, copy none/bf16/fp16. Fused kernels
// (one pass, every dtype a template argument) are instantiated for an fp32 param (the master copy) with
// fp32 or bf16 states and any grad and copy dtypes, and for 8-bit and stochastically rounded states with
// an fp32 param and grad and no copy; every other combination runs through run_converted.
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
bool with_state_dtype(int d, bool stochastic, const F& f) {
    if (d == kU8) return f(std::integral_constant<int, kU8>{});
    if (d == kBF16 && stochastic) return f(std::integral_constant<int, kBF16SR>{});
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

// Calls Impl<kF32, GT, ST, CT>::run for the dtypes in `a` when that combination is fused, else runs the
// arrays through Impl<kF32, kF32, ST, kNone> in fp32 chunks (run_converted).
template <class I, template <int, int, int, int> class Impl, class Consts>
bool dispatch_dtypes(const Arrays& a, const Consts& c, size_t begin, size_t end) {
    return with_state_dtype(a.state_dtype, a.stochastic, [&](auto st) {
        constexpr int ST = decltype(st)::value;
        if (a.param_dtype == kF32) {
            if constexpr (ST == kF32 || ST == kBF16) {
                return with_value_dtype(a.grad_dtype, [&](auto gt) {
                    return with_copy_dtype(a.copy_dtype, [&](auto ct) {
                        return Impl<kF32, decltype(gt)::value, ST, decltype(ct)::value>::run(a, c, begin,
                                                                                             end);
                    });
                });
            }
            if (a.grad_dtype == kF32 && a.copy_dtype == kNone) {
                return Impl<kF32, kF32, ST, kNone>::run(a, c, begin, end);
            }
        }
        return run_converted<I, ST>(a, begin, end, [&c](const Arrays& t, size_t n) {
            return Impl<kF32, kF32, ST, kNone>::run(t, c, 0, n);
        });
    });
}

}  // namespace
}  // namespace zo_optim

// Define the entry points of one ISA; `I` is the ISA struct of the including file. One macro per
// optimizer so that an ISA's kernels can be split over translation units (isa_<isa>.h).
#define ZO_DEFINE_OPTIMIZER_ENTRY_POINT(name, Consts, isa, I)                   \
    namespace zo_optim {                                                        \
    namespace {                                                                 \
    template <int PT, int GT, int ST, int CT>                                   \
    struct name##Run_##isa {                                                    \
        static bool run(const Arrays& a, const Consts& c, size_t b, size_t e) { \
            return name##_impl<I, PT, GT, ST, CT>(a, c, b, e);                  \
        }                                                                       \
    };                                                                          \
    }                                                                           \
    bool name##_##isa(const Arrays& a, const Consts& c, size_t b, size_t e) {   \
        return dispatch_dtypes<I, name##Run_##isa>(a, c, b, e);                 \
    }                                                                           \
    }
#define ZO_DEFINE_ADAM_ENTRY_POINT(isa, I) ZO_DEFINE_OPTIMIZER_ENTRY_POINT(adam, AdamConsts, isa, I)
#define ZO_DEFINE_ADAGRAD_ENTRY_POINT(isa, I) ZO_DEFINE_OPTIMIZER_ENTRY_POINT(adagrad, AdagradConsts, isa, I)
#define ZO_DEFINE_LION_ENTRY_POINT(isa, I) ZO_DEFINE_OPTIMIZER_ENTRY_POINT(lion, LionConsts, isa, I)
#define ZO_DEFINE_ALL_FINITE_ENTRY_POINT(isa, I)                                                             \
    namespace zo_optim {                                                                                     \
    bool all_finite_##isa(const void* data, int dtype, size_t b, size_t e) {                                 \
        return with_value_dtype(dtype,                                                                       \
                                [&](auto d) { return all_finite_impl<I, decltype(d)::value>(data, b, e); }); \
    }                                                                                                        \
    }
