// The async I/O handle: worker threads, request splitting, alignment handling. No Python in here.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "aio_error.h"

namespace zo {

enum class DirectMode { kAuto, kOn, kOff };

// Parses "auto" | "on" | "off"; throws UsageError otherwise.
DirectMode parse_direct_mode(const std::string& s);

struct HandleOptions {
    size_t block_size = size_t(1) << 20;
    unsigned queue_depth = 32;
    bool single_submit = false;
    bool overlap_events = true;
    unsigned intra_op_parallelism = 1;
    std::string backend = "auto";  // "auto" | "io_uring" | "aio" | "psync"
    DirectMode direct = DirectMode::kAuto;
};

// What a call found that the user should hear about; the bindings turn it into a warning with the GIL held.
struct CallNotes {
    bool direct_fallback = false;  // O_DIRECT refused on a filesystem not reported before in this process
    std::string fallback_path;
};

// Offsets, lengths and buffers aligned to this are moved without any bounce copy on every filesystem we
// know of (logical blocks of at most 4 KiB).
constexpr size_t kPreferredAlignment = 4096;

class Worker;
struct Request;

class Handle {
  public:
    // Throws UsageError for bad options and BackendUnavailable if a named backend cannot run here.
    explicit Handle(const HandleOptions& opts);
    ~Handle();
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;

    // Moves `nbytes` between `buf` and `path` at `offset`. The file is opened (and, for reads, checked
    // against its size) here, so those errors throw at once; it is closed when the request completes.
    // Sync: returns nbytes or throws IoError. Async: queues and returns 0.
    int64_t submit_path(bool write, void* buf, int64_t nbytes, const std::string& path, int64_t offset,
                        bool async, CallNotes* notes);
    // Same on a caller-owned descriptor, which is never closed here. O_DIRECT is taken from its flags.
    int64_t submit_fd(bool write, void* buf, int64_t nbytes, int fd, int64_t offset, bool async);

    // Blocks until every queued async request finished; returns how many finished since the last wait().
    // If any failed, throws the first failure (after all have finished).
    size_t wait();
    size_t pending() const;
    // Waits for everything, stops the workers, frees kernel contexts. Throws the first unreported async
    // failure, if any. Idempotent; later submissions throw UsageError.
    void close();

    const std::string& backend() const { return backend_; }
    const HandleOptions& options() const { return opts_; }
    size_t alignment() const { return kPreferredAlignment; }

    // Test hook: while paused, workers start no newly queued request. Lets a test change a file between
    // submission and execution without sleeping.
    void set_paused(bool paused);
    bool paused() const { return paused_.load(std::memory_order_acquire); }

    // Called by a worker thread when the last piece of `req` is done.
    void request_finished(Request& req);

  private:
    int64_t dispatch(const std::shared_ptr<Request>& req, bool async);
    void check_open() const;

    HandleOptions opts_;
    std::string backend_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::atomic<unsigned> next_worker_{0};
    std::atomic<bool> paused_{false};

    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool closing_ = false;
    bool closed_ = false;
    size_t inflight_total_ = 0;  // sync + async requests not yet finished
    size_t inflight_async_ = 0;
    size_t completed_async_ = 0;
    std::optional<IoError> first_error_;
    bool async_oom_ = false;  // an async request failed and its error could not even be allocated
};

}  // namespace zo
