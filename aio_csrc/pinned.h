// Page-aligned anonymous memory for staging buffers: aligned to any power of two, optionally backed by
// transparent huge pages and locked in RAM. RAII: the mapping is released when the object dies.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace zo {

// Live PinnedMemory mappings, so that an io_uring engine can register the long-lived staging buffers it
// is asked to use (fixed buffers: the kernel then skips pinning their pages on every I/O).
struct PinnedRegion {
    uintptr_t base = 0;
    size_t len = 0;
    uint64_t id = 0;  // unique for the process lifetime: a new mapping at the same address gets a new id
};

class PinnedRegistry {
  public:
    static PinnedRegistry& instance();
    uint64_t add(uintptr_t base, size_t len);
    void remove(uint64_t id);
    // The live region containing [addr, addr + len), if any.
    bool find(uintptr_t addr, size_t len, PinnedRegion* out);
    bool alive(uint64_t id);
    // Bumped on every removal: a cached registration is still valid while this is unchanged.
    uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }

  private:
    std::mutex mu_;
    std::vector<PinnedRegion> regions_;
    uint64_t next_id_ = 1;
    std::atomic<uint64_t> epoch_{0};
};

// When the pages of a locked buffer are faulted in (allocated and zeroed by the kernel). Faulting in
// gigabytes takes seconds; the memory is usable at once in every mode, only where that cost is paid differs.
enum class Populate {
    kSync,        // before the constructor returns (mlock): no later access ever takes a page fault
    kBackground,  // by a thread of this buffer, overlapping whatever the caller does next (small: kSync)
    kNone,        // on first touch (mlock2 MLOCK_ONFAULT: each page is locked as it faults in)
};

class PinnedMemory {
  public:
    // Throws UsageError for a bad alignment, std::bad_alloc (with errno in the message) if mmap fails.
    // A failed mlock is not an error: locked() is false and lock_errno() says why. Unlocked buffers are
    // never populated ahead of use. Where MLOCK_ONFAULT is unsupported, kBackground and kNone become kSync.
    PinnedMemory(size_t nbytes, size_t alignment, bool huge_pages, bool lock,
                 Populate populate = Populate::kSync);
    ~PinnedMemory();
    PinnedMemory(const PinnedMemory&) = delete;
    PinnedMemory& operator=(const PinnedMemory&) = delete;

    char* data() const { return data_; }
    size_t size() const { return nbytes_; }
    bool locked() const { return locked_; }
    bool huge_pages() const { return huge_pages_; }
    int lock_errno() const { return lock_errno_; }
    bool released() const { return data_ == nullptr; }
    // True once every page is resident (always true for unlocked buffers: nothing is done for them).
    bool populated();
    // Blocks until the background population finished; returns its errno (0: all pages resident).
    int wait_populated();
    void release();

  private:
    char* data_ = nullptr;
    size_t nbytes_ = 0;
    size_t mapped_ = 0;  // bytes mapped at data_ (nbytes rounded up to the page size)
    bool locked_ = false;
    bool huge_pages_ = false;
    bool sync_populated_ = false;
    int lock_errno_ = 0;
    uint64_t region_id_ = 0;

    // Shared with the populating thread, which never touches anything else of this object.
    struct PopulateState {
        std::atomic<bool> stop{false};
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;  // guarded by mu
        int error = 0;      // guarded by mu
        void finish(int err);
    };
    std::shared_ptr<PopulateState> populate_;
    std::thread populate_thread_;
    void start_populate();
    void stop_populate();
};

}  // namespace zo
