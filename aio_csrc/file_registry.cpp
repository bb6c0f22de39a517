#include "file_registry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "fault_inject.h"

namespace zo {

BlockLocks& BlockLocks::instance() {
    static BlockLocks locks;
    return locks;
}

bool BlockLocks::try_lock(const FileKey& f, const uint64_t* blocks, int n, uint64_t* generation) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int i = 0; i < n; ++i) {
        if (held_.count(std::make_tuple(f.dev, f.ino, blocks[i])) != 0) {
            *generation = generation_;
            return false;
        }
    }
    // All or nothing: if an insert runs out of memory, the blocks taken so far are given back.
    int taken = 0;
    try {
        for (; taken < n; ++taken) {
            alloc_point("block_lock");
            held_.insert(std::make_tuple(f.dev, f.ino, blocks[taken]));
        }
    } catch (...) {
        for (int i = 0; i < taken; ++i) held_.erase(std::make_tuple(f.dev, f.ino, blocks[i]));
        throw;
    }
    return true;
}

void BlockLocks::unlock(const FileKey& f, const uint64_t* blocks, int n) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        for (int i = 0; i < n; ++i) held_.erase(std::make_tuple(f.dev, f.ino, blocks[i]));
        ++generation_;
    }
    cv_.notify_all();
}

void BlockLocks::wait_for_release(uint64_t generation) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return generation_ != generation; });
}

SizeTracker& SizeTracker::instance() {
    static SizeTracker tracker;
    return tracker;
}

void SizeTracker::begin_write(int fd, const FileKey& f, uint64_t size, uint64_t offset, uint64_t end,
                              bool direct, bool padded) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = files_.find(f);
    if (it == files_.end()) {
        // No write of ours is in flight on this file: its current size is the truth.
        it = files_.emplace(f, Entry{size, 0, 0}).first;
    }
    Entry& e = it->second;
    e.logical = std::max(e.logical, end);
    ++e.writers;
    if (padded) ++e.padded;
    if (direct && end > size) {
        const uint64_t from = std::max(offset, size);
        int rc;
        do {
            rc = fallocate(fd, 0, static_cast<off_t>(from), static_cast<off_t>(end - from));
        } while (rc != 0 && errno == EINTR);
    }
}

int SizeTracker::end_write(int fd, const FileKey& f, bool padded) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = files_.find(f);
    if (it == files_.end()) return 0;
    Entry& e = it->second;
    int err = 0;
    if (padded && --e.padded == 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) > e.logical &&
            ftruncate(fd, static_cast<off_t>(e.logical)) != 0)
            err = errno;
    }
    if (--e.writers == 0) files_.erase(it);
    return err;
}

}  // namespace zo
