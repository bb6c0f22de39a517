// Shared declarations of the CPU optimizer kernels: argument blocks, dtype codes, per-ISA entry points.
//
// The kernels know nothing of torch or Python: they take raw pointers, element counts and dtype codes.
// Each ISA (scalar, AVX2, AVX-512) is compiled in its own translation unit under a target pragma, so one
// binary built with baseline flags carries all of them; dispatch.cpp picks one at run time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zo_optim {

// Element types of the arrays. kNone marks an absent optional array (the 16-bit param copy). kU8: 8-bit
// block-quantized states (one code per element, one fp32 absmax per kQuantBlock elements). kBF16SR exists
// only inside the kernels: bf16 states stored with stochastic rounding (Arrays::stochastic).
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3, kU8 = 4, kBF16SR = 5 };

// Elements per quantization block of kU8 states; blocks start at element 0 of the arrays.
constexpr size_t kQuantBlock = 2048;
// Largest binary exponent field of the 8-bit magnitude codes (value 2^0): signed codes are a sign bit and
// an E4M3 magnitude, unsigned codes an E5M3 magnitude. See offload/ops/quant.py.
constexpr int kEmaxSigned = 15;
constexpr int kEmaxUnsigned = 31;

enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Which stores of a step go out as non-temporal (streaming) stores, for full vectors whose destination is
// aligned to the vector width. kStreamCopy (the default) streams only the write-only 16-bit param copy;
// kStreamAll also the read-modify-write arrays (param, states); kStreamNone streams nothing. The last two
// exist to measure the first against.
enum StreamPolicy : int { kStreamNone = 0, kStreamCopy = 1, kStreamAll = 2 };

// The policy in force (set through set_stream_policy in dispatch.h); read once per kernel range.
int stream_policy();

// Pointers shared by all three optimizers. `state_a`/`state_b` are exp_avg/exp_avg_sq (Adam), sum (Adagrad,
// state_b unused) or exp_avg (Lion, state_b unused). All arrays have the same element count.
struct Arrays {
    void* param = nullptr;
    const void* grad = nullptr;
    void* state_a = nullptr;
    void* state_b = nullptr;
    void* copy = nullptr;
    int param_dtype = kF32;
    int grad_dtype = kF32;
    int state_dtype = kF32;
    int copy_dtype = kNone;
    // kU8 states: the per-block absmax of state_a / state_b (read, then rewritten).
    float* absmax_a = nullptr;
    float* absmax_b = nullptr;
    // bf16 states with stochastic rounding: the call's two 32-bit hash keys (from seed and step).
    bool stochastic = false;
    uint32_t sr_k0 = 0;
    uint32_t sr_k1 = 0;
    // The caller's element index of element 0 of these arrays: nonzero only for the kernels' own views
    // into a range (stochastic rounding hashes the caller's index).
    uint64_t first_index = 0;
};

// Per-element constants, already rounded to fp32 the way torch rounds its Python scalars (see adam.py's
// _single_tensor_adam: every Python float meets an fp32 tensor as an fp32 scalar).
struct AdamConsts {
    float grad_scale;       // grads are divided by this when `unscale`
    bool unscale;           // grad_scale != 1
    int decay_mode;         // 0: none, 1: decoupled (param *= decay_mul), 2: L2 (grad += wd * param)
    float decay_mul;        // 1 - lr * wd
    float weight_decay;     // wd (L2 mode)
    float lerp_weight;      // 1 - beta1, torch's exp_avg.lerp_(grad, 1 - beta1)
    bool lerp_small;        // |1 - beta1| < 0.5 selects torch's lerp formula
    float beta2;            // exp_avg_sq.mul_(beta2)
    float one_minus_beta2;  // .addcmul_(grad, grad, value=1 - beta2)
    float bc2_sqrt;         // sqrt(1 - beta2^step), or 1 without bias correction
    float eps;
    float neg_step_size;  // -lr / (1 - beta1^step), or -lr without bias correction
};

struct AdagradConsts {
    float grad_scale;
    bool unscale;
    bool l2;  // grad += wd * param
    float weight_decay;
    float eps;
    float neg_lr;
};

struct LionConsts {
    float grad_scale;
    bool unscale;
    bool decay;       // param *= decay_mul
    float decay_mul;  // 1 - lr * wd
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float neg_lr;
};

// Each returns false when a grad element in [begin, end) was not finite (the update is still written).
// Arrays are indexed from element 0; the kernels touch only [begin, end).
#define ZO_DECLARE_ISA(isa)                                                                \
    bool adam_##isa(const Arrays& a, const AdamConsts& c, size_t begin, size_t end);       \
    bool adagrad_##isa(const Arrays& a, const AdagradConsts& c, size_t begin, size_t end); \
    bool lion_##isa(const Arrays& a, const LionConsts& c, size_t begin, size_t end);       \
    bool all_finite_##isa(const void* data, int dtype, size_t begin, size_t end);

ZO_DECLARE_ISA(scalar)
// ZO_FORCE_PORTABLE builds the non-x86 configuration on x86 (used to check that it compiles and runs).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZO_FORCE_PORTABLE)
#define ZO_X86 1
ZO_DECLARE_ISA(avx2)
ZO_DECLARE_ISA(avx512)
#endif

#undef ZO_DECLARE_ISA

}  // namespace zo_optim
