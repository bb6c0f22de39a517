// The async I/O handle: worker threads, request splitting, alignment handling. No Python in here.
#pragma once

#include <fcntl.h>
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
#include "file_registry.h"

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

// Names a file: `name` relative to the open directory `dir_fd`, or a path (dir_fd AT_FDCWD, the default).
// The core opens it with openat(O_NOFOLLOW): a symlink in its last component is refused (ELOOP), never
// followed. With a directory fd, `name` must be a plain file name (no '/', not "." or ".."), so nothing
// but the directory the caller holds open is ever walked. `shown` names the file in errors (default: name).
struct FileRef {
    int dir_fd;
    std::string name;
    std::string shown;
    // Throws UsageError for an empty name, an embedded NUL, or a name that is not plain under a dir fd.
    void validate() const;
    const std::string& label() const { return shown.empty() ? name : shown; }
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

    // Thread safety: every member may be called from any thread at any time, close() included. A call
    // that has passed its entry check when close() begins is finished first (close() waits for it); a
    // call that enters after close() began throws UsageError("the aio Handle is closed").

    // Moves `nbytes` between `buf` and `path` at `offset`. The file is opened (and, for reads, checked
    // against its size) here, so those errors throw at once; it is closed when the request completes.
    // A registered path (register_file) is not opened again: the request uses the registered descriptor.
    // Sync: returns nbytes or throws IoError. Async: queues and returns 0.
    int64_t submit_path(bool write, void* buf, int64_t nbytes, const std::string& path, int64_t offset,
                        bool async, CallNotes* notes);
    // Same for a file named relative to a directory fd (FileRef); a registration made with the same
    // directory (compared by device and inode) and name is used instead of opening it.
    int64_t submit_at(bool write, void* buf, int64_t nbytes, const FileRef& file, int64_t offset, bool async,
                      CallNotes* notes);
    // Same on a caller-owned descriptor, which is never closed here. O_DIRECT is taken from its flags.
    int64_t submit_fd(bool write, void* buf, int64_t nbytes, int fd, int64_t offset, bool async);

    // Opens `path` once (O_RDWR | O_CREAT, mode 0600, never truncating, when `writable`; else O_RDONLY;
    // O_DIRECT as for path requests). Until unregister_file(path) or close(), requests naming the path
    // (compared as FileTable::key_of spells it) use this descriptor, whatever the path names meanwhile.
    // Throws IoError for open failures, UsageError if the path is registered already.
    void register_file(const std::string& path, bool writable, CallNotes* notes);
    void register_at(const FileRef& file, bool writable, CallNotes* notes);
    // Forgets the registration. The descriptor is closed now if no request uses it (IoError if that
    // close fails), else when the last such request completes. UsageError if the path is not registered.
    void unregister_file(const std::string& path);
    void unregister_at(const FileRef& file);

    // Blocks until every queued async request finished; returns how many finished since the last wait().
    // If any failed, throws the first failure (after all have finished).
    size_t wait();
    size_t pending() const;
    // Refuses new calls, waits for the calls in progress (submissions and wait()s) and for every request,
    // stops the workers, frees kernel contexts and closes the registered files. Throws the first async
    // failure that no wait() reported: a failure is reported by exactly one of wait() and close(), and a
    // wait() already running when close() begins reports it first. Idempotent (a second caller returns
    // once the first is done); later calls throw UsageError, a later wait() returns 0.
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
    class CallScope;
    int64_t dispatch(const std::shared_ptr<Request>& req, bool async);
    void wake_workers();

    HandleOptions opts_;
    std::string backend_;
    // Filled by the constructor, emptied by close() once no call is in progress: calls in progress read
    // it without a lock. workers_mu_ orders set_paused() against close() emptying it.
    std::vector<std::unique_ptr<Worker>> workers_;
    std::mutex workers_mu_;
    std::atomic<unsigned> next_worker_{0};
    std::atomic<bool> paused_{false};
    FileTable files_;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool closing_ = false;       // close() began: new calls are refused
    bool closed_ = false;        // close() finished
    size_t callers_ = 0;         // submissions and registrations between their entry check and their return
    size_t waiters_ = 0;         // wait() calls in progress
    size_t inflight_total_ = 0;  // sync + async requests not yet finished
    size_t inflight_async_ = 0;
    size_t completed_async_ = 0;
    std::optional<IoError> first_error_;
    bool async_oom_ = false;  // an async request failed and its error could not even be allocated
};

}  // namespace zo
