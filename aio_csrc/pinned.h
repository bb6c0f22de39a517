// Page-aligned anonymous memory for staging buffers: aligned to any power of two, optionally backed by
// transparent huge pages and locked in RAM. RAII: the mapping is released when the object dies.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
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

class PinnedMemory {
  public:
    // Throws UsageError for a bad alignment, std::bad_alloc (with errno in the message) if mmap fails.
    // A failed mlock is not an error: locked() is false and lock_errno() says why.
    PinnedMemory(size_t nbytes, size_t alignment, bool huge_pages, bool lock);
    ~PinnedMemory();
    PinnedMemory(const PinnedMemory&) = delete;
    PinnedMemory& operator=(const PinnedMemory&) = delete;

    char* data() const { return data_; }
    size_t size() const { return nbytes_; }
    bool locked() const { return locked_; }
    bool huge_pages() const { return huge_pages_; }
    int lock_errno() const { return lock_errno_; }
    bool released() const { return data_ == nullptr; }
    void release();

  private:
    char* data_ = nullptr;
    size_t nbytes_ = 0;
    size_t mapped_ = 0;  // bytes mapped at data_ (nbytes rounded up to the page size)
    bool locked_ = false;
    bool huge_pages_ = false;
    int lock_errno_ = 0;
    uint64_t region_id_ = 0;
};

}  // namespace zo
