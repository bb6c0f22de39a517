// Run-time side of the CPU optimizers: ISA choice, thread count, and the step entry points that split
// an array over the thread pool and call the chosen ISA's kernel on each chunk. No Python here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cpu_optim.h"

namespace zo_optim {

SimdLevel best_simd_level();
SimdLevel simd_level();
// Throws std::invalid_argument for an unknown name or a level this CPU cannot run.
void set_simd_level(const std::string& name);  // "auto", "scalar", "avx2" or "avx512"
const char* simd_level_name(SimdLevel level);

// Throws std::invalid_argument for a name other than "none", "copy" or "all" (see StreamPolicy).
void set_stream_policy(const std::string& name);
const char* stream_policy_name();

int num_threads();
void set_num_threads(int threads);  // throws std::invalid_argument when threads < 1

struct AdamHyper {
    int64_t step;  // after incrementing: 1 for the first update
    double lr, beta1, beta2, eps, weight_decay;
    bool adamw_mode, bias_correction;
};

struct AdagradHyper {
    double lr, eps, weight_decay;
};

struct LionHyper {
    double lr, beta1, beta2, weight_decay;
};

// Each validates the dtype codes (std::invalid_argument), then returns false without touching anything
// when check_finite is set and a grad is not finite; otherwise updates and returns whether all grads
// were finite. n == 0 is a no-op returning true.
bool adam_step(const Arrays& a, size_t n, const AdamHyper& h, double grad_scale, bool check_finite);
bool adagrad_step(const Arrays& a, size_t n, const AdagradHyper& h, double grad_scale, bool check_finite);
bool lion_step(const Arrays& a, size_t n, const LionHyper& h, double grad_scale, bool check_finite);
bool all_finite(const void* data, int dtype, size_t n);

// Runs fn(begin, end) over blocks tiling [0, n) on the pool, at least `min_per_thread` items per thread
// used, block bounds on multiples of `align`. Serialized with the steps; rethrows a block's exception.
void parallel_ranges(size_t n, size_t min_per_thread, size_t align,
                     const std::function<void(size_t, size_t)>& fn);

// Memory-bandwidth reference for the benchmark, on the same pool: "read" sums a (returns the sum),
// "scale" writes dst = 0.5 * a, "triad" dst = a + 0.5 * b. n floats each; throws for another kind.
double bandwidth_probe(const std::string& kind, float* dst, const float* a, const float* b, size_t n);

// Many tensors in one parallel pass: an optimizer step over a param group wakes the pool once and splits
// the concatenated elements evenly over the threads. Each segment carries its own step number (Adam's
// bias correction) and learning rate (Adagrad's decayed lr); the hyperparameters' own step/lr are ignored.
struct Segment {
    Arrays arrays;
    size_t n;
    int64_t step;
    double lr;
};
bool adam_step_multi(const std::vector<Segment>& segments, const AdamHyper& h);
bool adagrad_step_multi(const std::vector<Segment>& segments, const AdagradHyper& h);
bool lion_step_multi(const std::vector<Segment>& segments, const LionHyper& h);

}  // namespace zo_optim
