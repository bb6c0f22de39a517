// A persistent pool of worker threads for the optimizer steps: threads are created once (and again only
// when the thread count changes), never per step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zo_optim {

class ThreadPool {
  public:
    // `threads` counts the calling thread: a pool of 1 has no workers and runs everything inline.
    explicit ThreadPool(int threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return static_cast<int>(workers_.size()) + 1; }

    // Runs task(0) on the calling thread and offers task(t), t in [1, size()), to the workers. A worker
    // that has not started its task by the time task(0) returns is skipped, so a descheduled worker on a
    // busy machine never holds up the step: every task must be able to finish all the work alone (take
    // work from a shared counter until none is left). Returns when every started task has finished;
    // rethrows the first exception a task threw. One run at a time: the caller serializes (dispatch.cpp
    // holds a lock around it).
    void run(const std::function<void(int)>& task);

  private:
    void worker_loop(int index);

    std::mutex mu_;
    std::condition_variable work_cv_;
    std::condition_variable done_cv_;
    const std::function<void(int)>* task_ = nullptr;
    std::atomic<uint64_t> generation_{0};
    // The open run's admission gate: generation in the high bits, an "open" bit, and the number of
    // workers inside the task in the low bits. Tying the generation in makes a worker that woke for an
    // earlier run unable to join a later one with a stale task pointer.
    std::atomic<uint64_t> gate_{0};
    std::atomic<bool> stopping_{false};
    std::exception_ptr error_;
    std::vector<std::thread> workers_;
};

}  // namespace zo_optim
