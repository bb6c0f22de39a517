// Process-wide coordination of writes to the same file, across requests, workers and handles.
//
// O_DIRECT writes of partial blocks are read-modify-write, and a padded tail block may grow the file past
// the caller's end until it is trimmed. Two requests with disjoint byte ranges can still meet in one block
// or in that padding (two swappers sharing a swap file, neighbouring unaligned tensors), so:
//  - BlockLocks: a partial block is owned by one read-modify-write at a time, from its pre-read until its
//    write completes. Workers only try-lock (a worker blocked on a lock could not reap the completion that
//    frees it), and wait for a release only when they have nothing in flight.
//  - SizeTracker: per file, the size it must end up with (its size before our writes, raised to the end
//    of every write since). Once no padded write is in flight the file is trimmed to exactly that.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

namespace zo {

struct FileKey {
    dev_t dev = 0;
    ino_t ino = 0;
    bool operator<(const FileKey& o) const { return std::tie(dev, ino) < std::tie(o.dev, o.ino); }
};

class BlockLocks {
  public:
    static BlockLocks& instance();
    // Takes every block in blocks[0..n) or none. On failure returns false and sets *generation, to be
    // passed to wait_for_release.
    bool try_lock(const FileKey& f, const uint64_t* blocks, int n, uint64_t* generation);
    void unlock(const FileKey& f, const uint64_t* blocks, int n);
    // Blocks until some block was released after `generation`.
    void wait_for_release(uint64_t generation);

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    uint64_t generation_ = 0;
    std::set<std::tuple<dev_t, ino_t, uint64_t>> held_;
};

class SizeTracker {
  public:
    static SizeTracker& instance();
    // Registers a write of [offset, end) on fd (file f, current size `size`). For O_DIRECT writes, also
    // preallocates the new range: ext4 and others serialize appending O_DIRECT writes on the inode lock,
    // while overwrites of preallocated blocks run in parallel. Best effort: a filesystem without
    // fallocate is only slower, and a real ENOSPC is reported by the writes themselves.
    void begin_write(int fd, const FileKey& f, uint64_t size, uint64_t offset, uint64_t end, bool direct,
                     bool padded);
    // The write finished (successfully or not). Returns 0 or the errno of a failed trim.
    int end_write(int fd, const FileKey& f, bool padded);

  private:
    struct Entry {
        uint64_t logical = 0;  // the size the file must have once our writes are done
        unsigned writers = 0;
        unsigned padded = 0;
    };
    std::mutex mu_;
    std::map<FileKey, Entry> files_;
};

}  // namespace zo
