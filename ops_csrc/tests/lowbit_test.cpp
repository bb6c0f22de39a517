// Runs the 8-bit and stochastically rounded state paths of every optimizer over exactly sized heap arrays
// (so AddressSanitizer sees any access past an array or a block), with an fp32 param and grad or a bf16
// param and fp16 grad (the chunked conversion path), at every SIMD level this CPU has and with 1 and 3
// threads, and checks that all of them write the same bytes as the scalar path on one thread.
// Built with -fsanitize=address,undefined by tests/test_cpu_optim_lowbit.py; prints "ALL OK".
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_optim.h"
#include "dispatch.h"

using namespace zo_optim;

namespace {

struct Buffers {
    // Each array is its own allocation of exactly the size the call may touch.
    std::vector<float> param, grad, absmax_a, absmax_b;
    std::vector<uint8_t> qa, qb;
    std::vector<uint16_t> ha, hb, copy;
    std::vector<uint16_t> hparam, hgrad;  // bf16 param, fp16 grad
};

Buffers make(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    Buffers b;
    const size_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
    b.param.resize(n);
    b.grad.resize(n);
    b.qa.resize(n);
    b.qb.resize(n);
    b.ha.resize(n);
    b.hb.resize(n);
    b.copy.resize(n);
    b.hparam.resize(n);
    b.hgrad.resize(n);
    b.absmax_a.resize(blocks);
    b.absmax_b.resize(blocks);
    for (size_t i = 0; i < n; ++i) {
        b.param[i] = normal(rng);
        b.grad[i] = normal(rng) * 1e-2f;
        b.qa[i] = static_cast<uint8_t>(rng() & 0xF7);  // signed codes up to magnitude 119 or 247
        b.qb[i] = static_cast<uint8_t>(rng() % 249);
        b.ha[i] = static_cast<uint16_t>(0x3C00 + (rng() & 0x3FF));
        b.hb[i] = static_cast<uint16_t>(0x3800 + (rng() & 0x3FF));
        uint32_t bits;
        std::memcpy(&bits, &b.param[i], sizeof bits);
        b.hparam[i] = static_cast<uint16_t>(bits >> 16);
        b.hgrad[i] = static_cast<uint16_t>((rng() & 0x8000) | (0x1C00 + (rng() & 0x7FF)));  // +-2^-8..2^-6
    }
    for (size_t k = 0; k < blocks; ++k) {
        b.absmax_a[k] = 0.01f * static_cast<float>(k + 1);
        b.absmax_b[k] = 1e-4f * static_cast<float>(k + 1);
    }
    return b;
}

// Runs optimizer `opt` (0 Adam, 1 Lion, 2 Adagrad) with 8-bit (u8) or stochastically rounded bf16 states,
// on the fp32 param and grad or (half) the bf16 param and fp16 grad.
void run(Buffers& b, size_t n, int opt, bool u8, bool half) {
    Arrays a;
    a.param = half ? static_cast<void*>(b.hparam.data()) : static_cast<void*>(b.param.data());
    a.grad = half ? static_cast<const void*>(b.hgrad.data()) : static_cast<const void*>(b.grad.data());
    a.param_dtype = half ? kBF16 : kF32;
    a.grad_dtype = half ? kF16 : kF32;
    a.state_a = u8 ? static_cast<void*>(b.qa.data()) : static_cast<void*>(b.ha.data());
    a.state_b = opt == 0 ? (u8 ? static_cast<void*>(b.qb.data()) : static_cast<void*>(b.hb.data())) : nullptr;
    a.copy = b.copy.data();
    a.copy_dtype = kBF16;
    a.state_dtype = u8 ? kU8 : kBF16;
    if (u8) {
        a.absmax_a = opt == 2 ? b.absmax_b.data() : b.absmax_a.data();
        a.absmax_b = opt == 0 ? b.absmax_b.data() : nullptr;
        if (opt == 2) a.state_a = b.qb.data();
    } else {
        a.stochastic = true;
        a.sr_k0 = 0x12345678u;
        a.sr_k1 = 0x9ABCDEF0u;
    }
    if (opt == 0) {
        adam_step(a, n, AdamHyper{3, 1e-3, 0.9, 0.999, 1e-8, 0.01, true, true}, 1.0, false);
    } else if (opt == 1) {
        lion_step(a, n, LionHyper{1e-4, 0.9, 0.99, 0.1}, 2.0, false);
    } else {
        adagrad_step(a, n, AdagradHyper{1e-2, 1e-10, 0.0}, 1.0, false);
    }
}

template <class T>
bool same(const std::vector<T>& x, const std::vector<T>& y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

bool same(const Buffers& x, const Buffers& y) {
    return same(x.param, y.param) && same(x.hparam, y.hparam) && same(x.qa, y.qa) && same(x.qb, y.qb) &&
           same(x.ha, y.ha) && same(x.hb, y.hb) && same(x.copy, y.copy) && same(x.absmax_a, y.absmax_a) &&
           same(x.absmax_b, y.absmax_b);
}

}  // namespace

int main() {
    const std::vector<size_t> sizes = {0, 1, 7, 15, 17, 2047, 2048, 2049, 3 * 2048 + 17, 70001};
    std::vector<std::string> levels = {"scalar"};
    if (best_simd_level() >= SimdLevel::kAvx2) levels.push_back("avx2");
    if (best_simd_level() >= SimdLevel::kAvx512) levels.push_back("avx512");
    int failures = 0;
    for (size_t n : sizes) {
        for (int opt = 0; opt < 3; ++opt) {
            for (bool u8 : {true, false}) {
                for (bool half : {false, true}) {
                    set_simd_level("scalar");
                    set_num_threads(1);
                    Buffers ref = make(n, static_cast<uint32_t>(n * 7 + opt));
                    run(ref, n, opt, u8, half);
                    for (const std::string& level : levels) {
                        for (int threads : {1, 3}) {
                            set_simd_level(level);
                            set_num_threads(threads);
                            Buffers b = make(n, static_cast<uint32_t>(n * 7 + opt));
                            run(b, n, opt, u8, half);
                            if (!same(b, ref)) {
                                std::printf("MISMATCH n=%zu opt=%d u8=%d half=%d level=%s threads=%d\n", n,
                                            opt, u8 ? 1 : 0, half ? 1 : 0, level.c_str(), threads);
                                ++failures;
                            }
                        }
                    }
                }
            }
        }
    }
    std::printf("levels:");
    for (const std::string& level : levels) std::printf(" %s", level.c_str());
    std::printf("\n");
    if (failures == 0) std::printf("ALL OK\n");
    return failures == 0 ? 0 : 1;
}
