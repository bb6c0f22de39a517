// Runs the quantized-weight kernels (qmatmul.h) over exactly sized heap arrays (so AddressSanitizer sees any
// access past the codes, constants, inputs or outputs), at every SIMD level this CPU has and with 1 and 3
// threads: decodes must equal the scalar decode bit for bit, products (fp32 or int8 activations) the scalar
// product to fp32 rounding.
// Built with -fsanitize=address,undefined by tests/test_qmatmul.py; prints "ALL OK".
#include "qmatmul.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_optim.h"
#include "dispatch.h"

using namespace zo_optim;

namespace {

struct Weights {
    std::vector<uint8_t> codes;
    std::vector<uint16_t> scale, offset;
    QuantMatrix view(int bits, size_t group, bool symmetric, int round_to) const {
        QuantMatrix w;
        w.codes = codes.data();
        w.scale = scale.data();
        w.offset = symmetric ? nullptr : offset.data();
        w.bits = bits;
        w.group = group;
        w.round_to = round_to;
        return w;
    }
};

Weights make(size_t n, int bits, size_t group, uint32_t seed) {
    std::mt19937 rng(seed);
    const size_t groups = (n + group - 1) / group;
    Weights w;
    w.codes.resize(groups * group * static_cast<size_t>(bits) / 8);
    for (auto& c : w.codes) c = static_cast<uint8_t>(rng());
    w.scale.resize(groups);
    w.offset.resize(groups);
    // fp16 scales in [2^-10, 2^-6) and offsets in (-2^-4, 2^-4]: positive normal numbers, some negative
    for (size_t g = 0; g < groups; ++g) {
        w.scale[g] = static_cast<uint16_t>(0x1400 + rng() % 0x1000);
        w.offset[g] = static_cast<uint16_t>((rng() % 2 ? 0x8000 : 0) | (0x2800 + rng() % 0x400));
    }
    return w;
}

int failures = 0;

void expect(bool ok, const std::string& what) {
    if (!ok) {
        std::printf("FAIL %s\n", what.c_str());
        ++failures;
    }
}

using Product = void (*)(const QuantMatrix&, size_t, size_t, const float*, size_t, float*);

// `product` of a batch at `level` with `threads` against the scalar one on one thread, to fp32 rounding.
void compare_product(Product product, const QuantMatrix& w, size_t rows, size_t cols, const float* x,
                     size_t batch, const std::string& level, int threads, const std::string& tag) {
    auto y_ref = std::make_unique<float[]>(batch * rows);
    auto y = std::make_unique<float[]>(batch * rows);
    set_num_threads(1);
    set_simd_level("scalar");
    product(w, rows, cols, x, batch, y_ref.get());
    set_simd_level(level);
    set_num_threads(threads);
    product(w, rows, cols, x, batch, y.get());
    for (size_t i = 0; i < batch * rows; ++i) {
        const float tol = 1e-4f * (1.0f + std::fabs(y_ref[i]));
        if (!(std::fabs(y[i] - y_ref[i]) <= tol)) {
            expect(false, tag + " batch " + std::to_string(batch) + " at " + std::to_string(i));
            return;
        }
    }
}

void run_case(int bits, size_t group, bool symmetric, int round_to, const std::string& level, int threads) {
    const size_t rows = 37, cols = group * 5, n = rows * cols - 3;
    const Weights wts = make(rows * cols, bits, group, 7);
    const QuantMatrix w = wts.view(bits, group, symmetric, round_to);
    const std::string tag = "bits=" + std::to_string(bits) + " group=" + std::to_string(group) +
                            " sym=" + std::to_string(symmetric) + " round=" + std::to_string(round_to) + " " +
                            level + " threads=" + std::to_string(threads);
    set_num_threads(1);
    set_simd_level("scalar");
    auto want = std::make_unique<float[]>(n);
    dequantize_f32(w, n, want.get());
    set_simd_level(level);
    set_num_threads(threads);
    auto got = std::make_unique<float[]>(n);
    dequantize_f32(w, n, got.get());
    for (size_t i = 0; i < n; ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            expect(false, "decode " + tag + " at " + std::to_string(i));
            break;
        }
    }
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t batch : {size_t{1}, size_t{5}, size_t{8}, size_t{11}}) {
        auto x = std::make_unique<float[]>(batch * cols);
        for (size_t i = 0; i < batch * cols; ++i) x[i] = normal(rng);
        compare_product(quantized_matmul_f32, w, rows, cols, x.get(), batch, level, threads,
                        "product " + tag);
    }
}

// The int8-activation product at `level` against the scalar one: the same integer sums, so equal to fp32
// rounding of the group scalings.
void run_int8_case(int bits, size_t group, bool symmetric, const std::string& level, int threads) {
    const size_t rows = 37, cols = group * 5;
    const Weights wts = make(rows * cols, bits, group, 11);
    const QuantMatrix w = wts.view(bits, group, symmetric, kF32);
    const std::string tag = "int8 activations bits=" + std::to_string(bits) +
                            " group=" + std::to_string(group) + " sym=" + std::to_string(symmetric) + " " +
                            level + " threads=" + std::to_string(threads);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t batch : {size_t{1}, size_t{4}, size_t{9}, size_t{17}}) {
        auto x = std::make_unique<float[]>(batch * cols);
        for (size_t i = 0; i < batch * cols; ++i) x[i] = normal(rng);
        for (size_t k = 0; k < group; ++k) x[k] = 0.0f;  // a group of zeros: scale 0
        compare_product(quantized_matmul_int8_activations, w, rows, cols, x.get(), batch, level, threads,
                        tag);
    }
}

}  // namespace

int main() {
    std::vector<std::string> levels = {"scalar"};
    if (best_simd_level() != SimdLevel::kScalar) levels.push_back("avx2");
    if (best_simd_level() == SimdLevel::kAvx512) levels.push_back("avx512");
    for (const auto& level : levels) {
        for (int threads : {1, 3}) {
            for (int bits : {4, 8}) {
                for (size_t group : {size_t{64}, size_t{16}, size_t{6}}) {
                    for (bool symmetric : {false, true}) {
                        for (int round_to :
                             {static_cast<int>(kF32), static_cast<int>(kBF16), static_cast<int>(kF16)}) {
                            run_case(bits, group, symmetric, round_to, level, threads);
                        }
                    }
                }
                for (size_t group : {size_t{128}, size_t{64}, size_t{32}, size_t{6}}) {
                    run_int8_case(bits, group, false, level, threads);
                    run_int8_case(bits, group, true, level, threads);
                }
            }
        }
    }
    if (failures == 0) std::printf("ALL OK\n");
    return failures == 0 ? 0 : 1;
}
