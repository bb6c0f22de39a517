#include "pinned.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <fstream>
#include <new>
#include <string>
#include <system_error>

#include "aio_error.h"

namespace zo {

namespace {

size_t page_size() {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : 4096;
}

// madvise(MADV_HUGEPAGE) succeeds even when THP is globally "never"; then it changes nothing.
bool thp_possible() {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string s;
    if (!f || !std::getline(f, s)) return false;
    return s.find("[never]") == std::string::npos;
}

#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 0x01
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Population works in slices of one huge page: each holds the process's mmap lock (read) while it faults,
// so a slice is what an mmap/munmap of the caller (malloc of a large tensor, an io_uring ring) may wait for,
// and what release() waits for at most.
constexpr size_t kPopulateSlice = size_t(2) << 20;
// Buffers up to this size are populated before returning: a thread would cost more.
constexpr size_t kPopulateSyncMax = size_t(16) << 20;

// One buffer's slice at a time, process-wide: several populating threads would only compete with each
// other and with the caller for the same memory bandwidth and mmap lock.
std::mutex& populate_mutex() {
    static std::mutex mu;
    return mu;
}

// Fault in [p, p + n) as if written, without changing its contents: safe while the owner already uses the
// memory. Returns 0 or an errno.
int populate_range(char* p, size_t n) {
    while (madvise(p, n, MADV_POPULATE_WRITE) != 0) {
        if (errno == EINTR) continue;
        if (errno != EINVAL) return errno;
        // Kernel without MADV_POPULATE_WRITE: mlock of an already locked range populates it (content-safe).
        while (mlock(p, n) != 0) {
            if (errno != EINTR) return errno;
        }
        return 0;
    }
    return 0;
}

}  // namespace

PinnedRegistry& PinnedRegistry::instance() {
    static PinnedRegistry registry;
    return registry;
}

uint64_t PinnedRegistry::add(uintptr_t base, size_t len) {
    std::lock_guard<std::mutex> lk(mu_);
    const uint64_t id = next_id_++;
    regions_.push_back({base, len, id});
    return id;
}

void PinnedRegistry::remove(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < regions_.size(); ++i) {
        if (regions_[i].id == id) {
            regions_[i] = regions_.back();
            regions_.pop_back();
            break;
        }
    }
    epoch_.fetch_add(1, std::memory_order_acq_rel);
}

bool PinnedRegistry::find(uintptr_t addr, size_t len, PinnedRegion* out) {
    std::lock_guard<std::mutex> lk(mu_);
    for (const PinnedRegion& r : regions_) {
        if (addr >= r.base && addr + len <= r.base + r.len) {
            *out = r;
            return true;
        }
    }
    return false;
}

bool PinnedRegistry::alive(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    for (const PinnedRegion& r : regions_)
        if (r.id == id) return true;
    return false;
}

PinnedMemory::PinnedMemory(size_t nbytes, size_t alignment, bool huge_pages, bool lock, Populate populate)
    : nbytes_(nbytes) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
        throw UsageError("alignment must be a power of two, got " + std::to_string(alignment));
    const size_t page = page_size();
    if (alignment < page) alignment = page;
    // Even an empty buffer gets a page so that data() is a valid aligned address.
    mapped_ = ((nbytes == 0 ? 1 : nbytes) + page - 1) / page * page;
    if (mapped_ > SIZE_MAX - alignment) throw std::bad_alloc();
    // Over-map by the alignment, then give back the unaligned head and the unused tail.
    const size_t total = mapped_ + alignment;
    void* raw = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (base + alignment - 1) & ~(uintptr_t(alignment) - 1);
    const size_t head = aligned - base;
    const size_t tail = total - head - mapped_;
    if (head > 0) munmap(raw, head);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + mapped_), tail);
    data_ = reinterpret_cast<char*>(aligned);
    if (huge_pages) huge_pages_ = madvise(data_, mapped_, MADV_HUGEPAGE) == 0 && thp_possible();
    region_id_ = PinnedRegistry::instance().add(aligned, mapped_);
    if (!lock) return;
    // A thread costs more than faulting in one slice here and now.
    if (populate == Populate::kBackground && mapped_ <= kPopulateSyncMax) populate = Populate::kSync;
    if (populate != Populate::kSync) {
        // MLOCK_ONFAULT checks RLIMIT_MEMLOCK like mlock (same errno on failure) but faults nothing in.
        if (mlock2(data_, mapped_, MLOCK_ONFAULT) == 0) {
            locked_ = true;
            if (populate == Populate::kBackground) start_populate();
            return;
        }
        if (errno != EINVAL && errno != ENOSYS) {
            lock_errno_ = errno;
            return;
        }
        // No MLOCK_ONFAULT on this kernel: lock and populate now.
    }
    // mlock also faults every page in, so later I/O never takes a page fault on this buffer.
    if (mlock(data_, mapped_) == 0) {
        locked_ = true;
        sync_populated_ = true;
    } else {
        lock_errno_ = errno;
    }
}

void PinnedMemory::PopulateState::finish(int err) {
    {
        std::lock_guard<std::mutex> lk(mu);
        done = true;
        error = err;
    }
    cv.notify_all();
}

void PinnedMemory::start_populate() {
    auto state = std::make_shared<PopulateState>();
    char* base = data_;
    const size_t len = mapped_;
    try {
        populate_thread_ = std::thread([state, base, len] {
            int err = 0;
            for (size_t off = 0; off < len && err == 0; off += kPopulateSlice) {
                if (state->stop.load(std::memory_order_relaxed)) {
                    err = ECANCELED;
                    break;
                }
                std::lock_guard<std::mutex> lk(populate_mutex());
                err = populate_range(base + off, std::min(kPopulateSlice, len - off));
            }
            state->finish(err);
        });
    } catch (const std::system_error&) {
        // No thread to be had: populate here instead (the buffer is locked; the pages just fault in now).
        state->finish(populate_range(base, len));
    }
    populate_ = std::move(state);
}

void PinnedMemory::stop_populate() {
    if (populate_ == nullptr) return;
    populate_->stop.store(true, std::memory_order_relaxed);
    if (populate_thread_.joinable()) populate_thread_.join();
}

bool PinnedMemory::populated() {
    if (sync_populated_) return true;
    if (populate_ == nullptr) return false;
    std::lock_guard<std::mutex> lk(populate_->mu);
    return populate_->done && populate_->error == 0;
}

int PinnedMemory::wait_populated() {
    if (populate_ == nullptr) return 0;
    std::unique_lock<std::mutex> lk(populate_->mu);
    populate_->cv.wait(lk, [this] { return populate_->done; });
    return populate_->error;
}

void PinnedMemory::release() {
    if (data_ != nullptr) {
        stop_populate();  // the thread must be done with the pages before they are unmapped
        // Out of the registry first, so that no engine registers it again; rings that hold it drop it on
        // their next I/O (their reference keeps the pages, never another mapping, until then).
        PinnedRegistry::instance().remove(region_id_);
        munmap(data_, mapped_);  // also unlocks; cannot fail for a mapping we own
        data_ = nullptr;
    }
}

PinnedMemory::~PinnedMemory() { release(); }

}  // namespace zo
