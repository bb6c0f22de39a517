#include "pinned.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <fstream>
#include <new>
#include <string>

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

PinnedMemory::PinnedMemory(size_t nbytes, size_t alignment, bool huge_pages, bool lock) : nbytes_(nbytes) {
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
    if (lock) {
        // mlock also faults every page in, so later I/O never takes a page fault on this buffer.
        if (mlock(data_, mapped_) == 0) {
            locked_ = true;
        } else {
            lock_errno_ = errno;
        }
    }
}

void PinnedMemory::release() {
    if (data_ != nullptr) {
        // Out of the registry first, so that no engine registers it again; rings that hold it drop it on
        // their next I/O (their reference keeps the pages, never another mapping, until then).
        PinnedRegistry::instance().remove(region_id_);
        munmap(data_, mapped_);  // also unlocks; cannot fail for a mapping we own
        data_ = nullptr;
    }
}

PinnedMemory::~PinnedMemory() { release(); }

}  // namespace zo
