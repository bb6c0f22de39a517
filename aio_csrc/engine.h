// A backend moves fixed pieces of I/O between memory and file descriptors. Each worker thread owns one
// engine; engines are not thread-safe. Every outcome, including a refused submission, comes back as a
// completion, so the worker has one place to check results.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zo {

struct IoReq {
    int fd;
    bool write;
    char* buf;
    size_t len;
    uint64_t offset;
    uint32_t tag;    // the worker's slot number, < depth
    bool fixed_buf;  // buf lies inside the buffer given to register_buffer()
};

struct IoDone {
    uint32_t tag;
    int64_t res;  // bytes moved, or -errno
};

class Engine {
  public:
    virtual ~Engine() = default;
    virtual const char* name() const = 0;
    // Queue one request; it is issued by the next submit_and_reap(). At most `depth` requests may be
    // queued or in flight at once.
    virtual void prepare(const IoReq& req) = 0;
    // Issue everything prepared, then wait until at least `min_done` completions were appended to `done`
    // (fewer only if fewer are outstanding).
    virtual void submit_and_reap(size_t min_done, std::vector<IoDone>& done) = 0;
    // Offer a long-lived bounce buffer for registration with the kernel; true if fixed I/O may use it.
    virtual bool register_buffer(void* base, size_t len) {
        (void)base;
        (void)len;
        return false;
    }
};

// Creates the named engine ("io_uring", "aio", "psync") for `depth` requests in flight. Throws
// BackendUnavailable (with the errno) if the kernel refuses it.
std::unique_ptr<Engine> make_engine(const std::string& name, unsigned depth, bool single_submit);
std::unique_ptr<Engine> make_uring_engine(unsigned depth, bool single_submit);
std::unique_ptr<Engine> make_aio_engine(unsigned depth, bool single_submit);
std::unique_ptr<Engine> make_psync_engine(unsigned depth);

// Backends usable on this kernel, in preference order. Probed once per process.
const std::vector<std::string>& available_backends();
// Opens a small ring and checks the opcodes we use; "" if io_uring is usable, else why not.
std::string probe_uring_support();
// Why a backend is unusable ("" if usable).
std::string backend_unavailable_reason(const std::string& name);

}  // namespace zo
