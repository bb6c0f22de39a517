// Files as the core knows them: a handle's registered files, and process-wide coordination of writes to
// the same file, across requests, workers and handles.
//
// FileTable: the files a Handle opened once, at registration. A request that names a registered path uses
// the descriptor opened then, so replacing the path afterwards (a rename over it, a symlink in its place)
// never redirects the request to another file.
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

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "file_util.h"

namespace zo {

struct RegisteredFile {
    std::string path;  // as the caller spelled it, for messages
    FileDesc fd;       // O_RDWR (writable) or O_RDONLY; O_DIRECT where the filesystem does it
    DirectInfo di{false, 1, 1};
    bool direct = false;
    bool writable = false;

    std::mutex mu;         // guards the two below
    unsigned users = 0;    // requests holding the descriptor
    bool dropped = false;  // no longer registered: the last user closes the descriptor
};

// One request's hold on a registered file: the descriptor stays open until the hold ends, even if the
// file is unregistered meanwhile.
class FileUse {
  public:
    FileUse() = default;
    FileUse(const FileUse&) = delete;
    FileUse& operator=(const FileUse&) = delete;
    FileUse(FileUse&& o) noexcept : f_(std::move(o.f_)) {}
    FileUse& operator=(FileUse&& o) noexcept;
    ~FileUse() { release(); }
    RegisteredFile* get() const { return f_.get(); }
    explicit operator bool() const { return f_ != nullptr; }
    // Ends the hold. Returns the errno of closing the descriptor when this was the last hold on a file no
    // longer registered, else 0.
    int release() noexcept;

  private:
    friend class FileTable;
    explicit FileUse(std::shared_ptr<RegisteredFile> f) : f_(std::move(f)) {}
    std::shared_ptr<RegisteredFile> f_;
};

class FileTable {
  public:
    // The key a path is registered and looked up under: absolute (a relative path is taken against the
    // current directory), with "//", "/./" and a trailing "/" folded. ".." is kept: folding it is only
    // right where no symlink is involved. Throws IoError when a relative path meets an unreadable cwd.
    static std::string key_of(const std::string& path);
    // The key of file `name` in the open directory `dir_fd` (its device and inode, then the name): the
    // same directory reached through any path or descriptor gives the same key. A path key starts with
    // '/', this one never does. Throws IoError if dir_fd cannot be stat'ed or is not a directory.
    static std::string key_at(int dir_fd, const std::string& name);

    bool empty() const { return count_.load(std::memory_order_acquire) == 0; }
    // Adds `f` under `key`; false (and nothing changed) if the key is taken.
    bool add(const std::string& key, std::shared_ptr<RegisteredFile> f);
    // The file registered under `key`, held for one request; an empty FileUse if there is none.
    FileUse use(const std::string& key);
    // Unregisters `key`: *found says whether it was registered. The descriptor is closed now when no
    // request holds it (the errno of that close is returned), else by the last hold.
    int remove(const std::string& key, bool* found);
    // Unregisters every file. Returns the first errno of closing one (0 if none) and names it in *path.
    int clear(std::string* path);

  private:
    static int drop(RegisteredFile& f) noexcept;

    std::mutex mu_;
    std::map<std::string, std::shared_ptr<RegisteredFile>> files_;
    std::atomic<size_t> count_{0};
};

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
