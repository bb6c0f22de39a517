#include "thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace zo_optim {
namespace {

// An optimizer step over many tensors calls run() back to back; a worker that spins this long before
// sleeping picks up the next call without a futex wake-up (tens of microseconds on a busy machine).
constexpr auto kSpin = std::chrono::microseconds(50);

constexpr uint64_t kCountMask = (uint64_t{1} << 20) - 1;  // workers inside the task
constexpr uint64_t kOpen = uint64_t{1} << 20;             // run still admits workers
constexpr int kGenerationShift = 21;

inline uint64_t gate_generation(uint64_t gate) { return gate >> kGenerationShift; }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

// Spins until pred() or kSpin has passed; returns pred().
template <class Pred>
bool spin_until(const Pred& pred) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (unsigned i = 0;; ++i) {
        if (pred()) return true;
        cpu_relax();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return pred();
    }
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
    const int workers = threads > 1 ? threads - 1 : 0;
    workers_.reserve(static_cast<size_t>(workers));
    try {
        for (int i = 0; i < workers; ++i) workers_.emplace_back([this, i] { worker_loop(i + 1); });
    } catch (...) {
        // Thread creation failed part way (std::system_error): stop the ones already running.
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_.store(true);
        }
        work_cv_.notify_all();
        for (auto& t : workers_) t.join();
        throw;
    }
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_.store(true);
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
}

void ThreadPool::run(const std::function<void(int)>& task) {
    if (workers_.empty()) {
        task(0);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        task_ = &task;
        error_ = nullptr;
        const uint64_t generation = generation_.load() + 1;
        gate_.store((generation << kGenerationShift) | kOpen);
        generation_.store(generation, std::memory_order_release);
    }
    work_cv_.notify_all();
    std::exception_ptr own_error;
    try {
        task(0);
    } catch (...) {
        own_error = std::current_exception();
    }
    // Close the gate, then wait only for the workers that got in.
    gate_.fetch_and(~kOpen, std::memory_order_acq_rel);
    const auto all_out = [this] { return (gate_.load(std::memory_order_acquire) & kCountMask) == 0; };
    if (!spin_until(all_out)) {
        std::unique_lock<std::mutex> lock(mu_);
        done_cv_.wait(lock, all_out);
    }
    std::lock_guard<std::mutex> lock(mu_);
    task_ = nullptr;
    if (own_error) std::rethrow_exception(own_error);
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
        const auto fresh = [&] {
            return stopping_.load() || generation_.load(std::memory_order_acquire) != seen;
        };
        const std::function<void(int)>* task = nullptr;
        spin_until(fresh);
        {
            std::unique_lock<std::mutex> lock(mu_);
            work_cv_.wait(lock, fresh);
            if (stopping_.load()) return;
            seen = generation_.load();
            task = task_;
        }
        // Join the run only while it is open and still the one this task pointer belongs to.
        uint64_t gate = gate_.load(std::memory_order_acquire);
        bool joined = false;
        while ((gate & kOpen) != 0 && gate_generation(gate) == (seen & (~uint64_t{0} >> kGenerationShift))) {
            if (gate_.compare_exchange_weak(gate, gate + 1, std::memory_order_acq_rel)) {
                joined = true;
                break;
            }
        }
        if (!joined) continue;
        std::exception_ptr err;
        try {
            (*task)(index);
        } catch (...) {
            err = std::current_exception();
        }
        if (err) {
            std::lock_guard<std::mutex> lock(mu_);
            if (!error_) error_ = err;
        }
        const uint64_t before = gate_.fetch_sub(1, std::memory_order_acq_rel);
        if ((before & kCountMask) == 1 && (before & kOpen) == 0) {
            // Taking the lock orders this notify after the caller's predicate check: no lost wake-up.
            std::lock_guard<std::mutex> lock(mu_);
            done_cv_.notify_one();
        }
    }
}

}  // namespace zo_optim
