#include "dispatch.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace zo_optim {
namespace {

SimdLevel detect_best() {
#if defined(ZO_X86) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    // libgcc/compiler-rt also check that the OS saves the wider registers (XCR0), not only CPUID.
    const bool fma_f16c = __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (fma_f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
        return SimdLevel::kAvx512;
    }
    if (fma_f16c && __builtin_cpu_supports("avx2")) return SimdLevel::kAvx2;
#endif
    return SimdLevel::kScalar;
}

const SimdLevel g_best = detect_best();
std::atomic<int> g_level{static_cast<int>(g_best)};
// Plain stores by default: streaming the copy measured no faster here (1.04-1.18x vs 1.18-1.21x over
// torch's two passes in a quiet run), see docs/cpu_optimizers.md.
std::atomic<int> g_stream{kStreamNone};

// Guards the pool: one parallel step at a time (steps called from several Python threads queue here),
// and no pool replacement while a step runs.
std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool = std::make_unique<ThreadPool>(1);
// The process that started the pool's threads. A forked child inherits the pool object but not its
// threads: it must build a new pool instead of waiting on workers that do not exist.
long g_pool_pid = static_cast<long>(getpid());

void adopt_pool_after_fork() {
    const long pid = static_cast<long>(getpid());
    if (pid == g_pool_pid) return;
    const int threads = g_pool->size();
    (void)g_pool.release();  // leaked on purpose: its destructor would join threads that are not here
    g_pool = std::make_unique<ThreadPool>(threads);
    g_pool_pid = pid;
}

// Below this many elements per thread, waking workers costs more than it saves.
constexpr size_t kMinPerThread = size_t{1} << 15;
// Blocks per thread for dynamic load balancing: enough to even out a slow thread, few enough that the
// per-block cost (an atomic increment) stays invisible.
constexpr size_t kBlocksPerThread = 8;
// Block boundaries on 64 elements keep every thread's range cache-line aligned (for 2- and 4-byte types,
// given an aligned base) so no two threads write the same line.
constexpr size_t kChunkAlign = 64;

struct alignas(64) PaddedFlag {
    bool ok = true;
};

// Splits [0, n) into blocks handed out through an atomic counter rather than one fixed range per thread:
// on a shared machine a thread that gets descheduled then delays only its current block, not the step.
template <class Fn>
bool parallel_for(size_t n, const Fn& fn, size_t min_per_thread = kMinPerThread, size_t align = kChunkAlign) {
    std::unique_lock<std::mutex> lock(g_pool_mu);
    adopt_pool_after_fork();
    const size_t threads = static_cast<size_t>(g_pool->size());
    const size_t used = std::max<size_t>(1, std::min(threads, n / min_per_thread));
    if (used == 1) {
        lock.unlock();
        return fn(size_t{0}, n);
    }
    size_t block = std::max(min_per_thread, (n + used * kBlocksPerThread - 1) / (used * kBlocksPerThread));
    block = (block + align - 1) / align * align;
    const size_t blocks = (n + block - 1) / block;
    std::atomic<size_t> next{0};
    std::vector<PaddedFlag> flags(used);
    g_pool->run([&](int t) {
        const size_t ti = static_cast<size_t>(t);
        if (ti >= used) return;
        bool ok = true;
        for (size_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
            const size_t begin = b * block, end = std::min(n, begin + block);
            ok = fn(begin, end) && ok;
        }
        flags[ti].ok = ok;
    });
    return std::all_of(flags.begin(), flags.end(), [](const PaddedFlag& f) { return f.ok; });
}

bool is_value_dtype(int d) { return d == kF32 || d == kBF16 || d == kF16; }

void check_arrays(const Arrays& a, size_t n, bool two_states) {
    if (!is_value_dtype(a.param_dtype)) throw std::invalid_argument("param dtype must be fp32, bf16 or fp16");
    if (!is_value_dtype(a.grad_dtype)) throw std::invalid_argument("grad dtype must be fp32, bf16 or fp16");
    if (a.state_dtype != kF32 && a.state_dtype != kBF16 && a.state_dtype != kU8) {
        throw std::invalid_argument("optimizer state dtype must be fp32, bf16 or uint8");
    }
    if (a.stochastic && a.state_dtype != kBF16) {
        throw std::invalid_argument("stochastic rounding applies to bf16 optimizer states only");
    }
    if (a.copy_dtype != kNone && a.copy_dtype != kBF16 && a.copy_dtype != kF16) {
        throw std::invalid_argument("param_copy dtype must be bf16 or fp16");
    }
    if (n == 0) return;
    if (a.param == nullptr || a.grad == nullptr || a.state_a == nullptr ||
        (two_states && a.state_b == nullptr)) {
        throw std::invalid_argument("null data pointer for a non-empty array");
    }
    if (a.copy_dtype != kNone && a.copy == nullptr) throw std::invalid_argument("null param_copy pointer");
    if (a.state_dtype == kU8 && (a.absmax_a == nullptr || (two_states && a.absmax_b == nullptr))) {
        throw std::invalid_argument("8-bit optimizer states need their absmax arrays");
    }
}

using FiniteFn = bool (*)(const void*, int, size_t, size_t);

FiniteFn finite_kernel() {
    switch (static_cast<SimdLevel>(g_level.load())) {
#if defined(ZO_X86)
        case SimdLevel::kAvx512:
            return all_finite_avx512;
        case SimdLevel::kAvx2:
            return all_finite_avx2;
#endif
        default:
            return all_finite_scalar;
    }
}

// Picks the kernel of the current ISA for one optimizer and runs the step over the pool.
template <class Consts>
using StepFn = bool (*)(const Arrays&, const Consts&, size_t, size_t);

template <class Consts>
StepFn<Consts> pick(StepFn<Consts> scalar, StepFn<Consts> avx2, StepFn<Consts> avx512) {
    const auto level = static_cast<SimdLevel>(g_level.load());
    if (level == SimdLevel::kAvx512) return avx512;
    if (level == SimdLevel::kAvx2) return avx2;
    return scalar;
}

template <class Consts>
bool run_step(const Arrays& a, size_t n, const Consts& c, bool check_finite, StepFn<Consts> scalar,
              StepFn<Consts> avx2, StepFn<Consts> avx512) {
    if (n == 0) return true;
    const StepFn<Consts> kernel = pick<Consts>(scalar, avx2, avx512);
    // The read-only pre-pass makes "nothing modified on overflow" a guarantee rather than a rollback.
    if (check_finite && !all_finite(a.grad, a.grad_dtype, n)) return false;
    if (a.state_dtype == kU8) {
        // A quantization block is updated by one thread: the cuts move up to multiples of kQuantBlock
        // (neighbouring blocks move their shared cut alike, so the ranges still tile [0, n)).
        const auto cut = [n](size_t x) {
            return std::min(n, (x + kQuantBlock - 1) / kQuantBlock * kQuantBlock);
        };
        return parallel_for(n, [&](size_t begin, size_t end) {
            const size_t b = cut(begin), e = cut(end);
            return b < e ? kernel(a, c, b, e) : true;
        });
    }
    return parallel_for(n, [&](size_t begin, size_t end) { return kernel(a, c, begin, end); });
}

#if defined(ZO_X86)
#define ZO_KERNELS(name) name##_scalar, name##_avx2, name##_avx512
#else
#define ZO_KERNELS(name) name##_scalar, name##_scalar, name##_scalar
#endif

}  // namespace

SimdLevel best_simd_level() { return g_best; }
SimdLevel simd_level() { return static_cast<SimdLevel>(g_level.load()); }

const char* simd_level_name(SimdLevel level) {
    switch (level) {
        case SimdLevel::kAvx512:
            return "avx512";
        case SimdLevel::kAvx2:
            return "avx2";
        default:
            return "scalar";
    }
}

void set_simd_level(const std::string& name) {
    SimdLevel wanted;
    if (name == "auto") {
        wanted = g_best;
    } else if (name == "scalar") {
        wanted = SimdLevel::kScalar;
    } else if (name == "avx2") {
        wanted = SimdLevel::kAvx2;
    } else if (name == "avx512") {
        wanted = SimdLevel::kAvx512;
    } else {
        throw std::invalid_argument("unknown SIMD level '" + name +
                                    "' (expected auto, scalar, avx2 or avx512)");
    }
    if (static_cast<int>(wanted) > static_cast<int>(g_best)) {
        throw std::invalid_argument(std::string("SIMD level '") + name +
                                    "' is not supported by this CPU (best: " + simd_level_name(g_best) + ")");
    }
    g_level.store(static_cast<int>(wanted));
}

int stream_policy() { return g_stream.load(std::memory_order_relaxed); }

const char* stream_policy_name() {
    switch (stream_policy()) {
        case kStreamNone:
            return "none";
        case kStreamAll:
            return "all";
        default:
            return "copy";
    }
}

void set_stream_policy(const std::string& name) {
    if (name == "none") {
        g_stream.store(kStreamNone);
    } else if (name == "copy") {
        g_stream.store(kStreamCopy);
    } else if (name == "all") {
        g_stream.store(kStreamAll);
    } else {
        throw std::invalid_argument("unknown stream policy '" + name + "' (expected none, copy or all)");
    }
}

int num_threads() {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    return g_pool->size();
}

void set_num_threads(int threads) {
    if (threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(threads));
    std::lock_guard<std::mutex> lock(g_pool_mu);
    adopt_pool_after_fork();
    if (g_pool->size() == threads) return;
    g_pool.reset();  // join the old workers before starting new ones
    g_pool = std::make_unique<ThreadPool>(threads);
}

void parallel_ranges(size_t n, size_t min_per_thread, size_t align,
                     const std::function<void(size_t, size_t)>& fn) {
    if (n == 0) return;
    if (min_per_thread == 0 || align == 0) throw std::invalid_argument("parallel_ranges: zero block size");
    parallel_for(
        n,
        [&](size_t begin, size_t end) {
            fn(begin, end);
            return true;
        },
        min_per_thread, align);
}

bool all_finite(const void* data, int dtype, size_t n) {
    if (n == 0) return true;
    if (!is_value_dtype(dtype)) throw std::invalid_argument("dtype must be fp32, bf16 or fp16");
    const FiniteFn fn = finite_kernel();
    return parallel_for(n, [&](size_t begin, size_t end) { return fn(data, dtype, begin, end); });
}

namespace {

// Every constant is computed in double exactly as torch's Python code does, then rounded to fp32 the way
// an fp32 tensor op rounds a Python scalar.
AdamConsts adam_consts(const AdamHyper& h, double grad_scale) {
    if (h.step < 1) throw std::invalid_argument("step must be >= 1 (the step number after incrementing)");
    AdamConsts c{};
    c.grad_scale = static_cast<float>(grad_scale);
    c.unscale = grad_scale != 1.0;
    c.decay_mode = h.weight_decay == 0.0 ? 0 : (h.adamw_mode ? 1 : 2);
    c.decay_mul = static_cast<float>(1.0 - h.lr * h.weight_decay);
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.lerp_weight = static_cast<float>(1.0 - h.beta1);
    c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    double step_size = h.lr, bc2_sqrt = 1.0;
    if (h.bias_correction) {
        const double step = static_cast<double>(h.step);
        step_size = h.lr / (1.0 - std::pow(h.beta1, step));
        bc2_sqrt = std::pow(1.0 - std::pow(h.beta2, step), 0.5);
    }
    c.bc2_sqrt = static_cast<float>(bc2_sqrt);
    c.eps = static_cast<float>(h.eps);
    c.neg_step_size = static_cast<float>(-step_size);
    return c;
}

AdagradConsts adagrad_consts(const AdagradHyper& h, double grad_scale) {
    AdagradConsts c{};
    c.grad_scale = static_cast<float>(grad_scale);
    c.unscale = grad_scale != 1.0;
    c.l2 = h.weight_decay != 0.0;
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.eps = static_cast<float>(h.eps);
    c.neg_lr = static_cast<float>(-h.lr);
    return c;
}

LionConsts lion_consts(const LionHyper& h, double grad_scale) {
    LionConsts c{};
    c.grad_scale = static_cast<float>(grad_scale);
    c.unscale = grad_scale != 1.0;
    c.decay = h.weight_decay != 0.0;
    c.decay_mul = static_cast<float>(1.0 - h.lr * h.weight_decay);
    c.beta1 = static_cast<float>(h.beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.neg_lr = static_cast<float>(-h.lr);
    return c;
}

// Runs kernel over the concatenation of the segments, split evenly over the pool.
template <class Consts>
bool run_multi(const std::vector<Segment>& segs, const std::vector<Consts>& consts, StepFn<Consts> kernel) {
    std::vector<size_t> offsets(segs.size() + 1, 0);
    for (size_t s = 0; s < segs.size(); ++s) offsets[s + 1] = offsets[s] + segs[s].n;
    if (offsets.back() == 0) return true;
    // parallel_for cuts the concatenation on 64-element boundaries, which fall anywhere inside a
    // segment. Moving each cut up to the next 64-element boundary of the segment it falls in keeps
    // every thread's range aligned within its own arrays (aligned vector loads, streaming stores, no
    // cache line written by two threads). Neighbouring blocks move their shared cut alike, so the
    // ranges still tile [0, total).
    const auto align_cut = [&](size_t x) {
        if (x >= offsets.back()) return offsets.back();
        const size_t s =
            static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), x) - offsets.begin()) - 1;
        const size_t local = (x - offsets[s] + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
        return std::min(offsets[s] + local, offsets[s + 1]);
    };
    return parallel_for(offsets.back(), [&](size_t block_begin, size_t block_end) {
        const size_t begin = align_cut(block_begin), end = align_cut(block_end);
        bool ok = true;
        size_t s =
            static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) -
            1;
        for (; s < segs.size() && offsets[s] < end; ++s) {
            const size_t lo = std::max(begin, offsets[s]) - offsets[s];
            const size_t hi = std::min(end, offsets[s + 1]) - offsets[s];
            if (lo < hi) ok = kernel(segs[s].arrays, consts[s], lo, hi) && ok;
        }
        return ok;
    });
}

}  // namespace

double bandwidth_probe(const std::string& kind, float* dst, const float* a, const float* b, size_t n) {
    // Plain loops over the same pool and block split as the optimizer steps (the compiler vectorizes
    // them), as the reference for how fast this process can move memory. The pointers are copied to
    // locals: under -fno-strict-aliasing (Python's flags) a store through dst could otherwise change a
    // captured pointer, which forces a reload per element and blocks vectorization.
    if (kind == "read") {
        std::vector<double> sums(static_cast<size_t>(num_threads()) * 8, 0.0);
        std::atomic<size_t> slot{0};
        parallel_for(n, [&](size_t begin, size_t end) {
            float acc[8] = {};
            size_t i = begin;
            for (; i + 8 <= end; i += 8) {
                for (int k = 0; k < 8; ++k) acc[k] += a[i + k];
            }
            for (; i < end; ++i) acc[0] += a[i];
            double total = 0.0;
            for (float x : acc) total += x;
            sums[slot.fetch_add(1) % sums.size()] += total;
            return true;
        });
        double total = 0.0;
        for (double x : sums) total += x;
        return total;
    }
    if (kind == "scale") {
        // STREAM's Scale rather than a copy: the compiler would turn a copy loop into memcpy, which
        // switches to non-temporal stores on large sizes.
        parallel_for(n, [dst, a](size_t begin, size_t end) {
            float* const d = dst;
            const float* const x = a;
            for (size_t i = begin; i < end; ++i) d[i] = 0.5f * x[i];
            return true;
        });
        return 0.0;
    }
    if (kind == "triad") {
        parallel_for(n, [dst, a, b](size_t begin, size_t end) {
            float* const d = dst;
            const float *const x = a, *const y = b;
            for (size_t i = begin; i < end; ++i) d[i] = x[i] + 0.5f * y[i];
            return true;
        });
        return 0.0;
    }
    throw std::invalid_argument("unknown bandwidth probe '" + kind + "' (expected read, scale or triad)");
}

bool adam_step(const Arrays& a, size_t n, const AdamHyper& h, double grad_scale, bool check_finite) {
    check_arrays(a, n, true);
    const AdamConsts c = adam_consts(h, grad_scale);
    return run_step<AdamConsts>(a, n, c, check_finite, ZO_KERNELS(adam));
}

bool adagrad_step(const Arrays& a, size_t n, const AdagradHyper& h, double grad_scale, bool check_finite) {
    check_arrays(a, n, false);
    return run_step<AdagradConsts>(a, n, adagrad_consts(h, grad_scale), check_finite, ZO_KERNELS(adagrad));
}

bool lion_step(const Arrays& a, size_t n, const LionHyper& h, double grad_scale, bool check_finite) {
    check_arrays(a, n, false);
    return run_step<LionConsts>(a, n, lion_consts(h, grad_scale), check_finite, ZO_KERNELS(lion));
}

bool adam_step_multi(const std::vector<Segment>& segments, const AdamHyper& h) {
    std::vector<AdamConsts> consts;
    consts.reserve(segments.size());
    for (const Segment& s : segments) {
        check_arrays(s.arrays, s.n, true);
        AdamHyper hs = h;
        hs.step = s.step;
        consts.push_back(adam_consts(hs, 1.0));
    }
    return run_multi<AdamConsts>(segments, consts, pick<AdamConsts>(ZO_KERNELS(adam)));
}

bool adagrad_step_multi(const std::vector<Segment>& segments, const AdagradHyper& h) {
    std::vector<AdagradConsts> consts;
    consts.reserve(segments.size());
    for (const Segment& s : segments) {
        check_arrays(s.arrays, s.n, false);
        AdagradHyper hs = h;
        hs.lr = s.lr;
        consts.push_back(adagrad_consts(hs, 1.0));
    }
    return run_multi<AdagradConsts>(segments, consts, pick<AdagradConsts>(ZO_KERNELS(adagrad)));
}

bool lion_step_multi(const std::vector<Segment>& segments, const LionHyper& h) {
    std::vector<LionConsts> consts;
    consts.reserve(segments.size());
    for (const Segment& s : segments) {
        check_arrays(s.arrays, s.n, false);
        consts.push_back(lion_consts(h, 1.0));
    }
    return run_multi<LionConsts>(segments, consts, pick<LionConsts>(ZO_KERNELS(lion)));
}

}  // namespace zo_optim
