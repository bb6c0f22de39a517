#include "file_registry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <new>
#include <vector>

#include "aio_error.h"
#include "fault_inject.h"

namespace zo {

FileUse& FileUse::operator=(FileUse&& o) noexcept {
    if (this != &o) {
        release();
        f_ = std::move(o.f_);
    }
    return *this;
}

int FileUse::release() noexcept {
    if (!f_) return 0;
    std::shared_ptr<RegisteredFile> f = std::move(f_);
    bool last;
    {
        std::lock_guard<std::mutex> lk(f->mu);
        --f->users;
        last = f->dropped && f->users == 0;
    }
    return last ? f->fd.reset() : 0;
}

std::string FileTable::key_of(const std::string& path) {
    std::string full;
    if (path.empty() || path[0] != '/') {
        std::vector<char> buf(PATH_MAX);
        while (getcwd(buf.data(), buf.size()) == nullptr) {
            if (errno != ERANGE) throw IoError(errno, Op::kOpen, path, 0, 0, "reading the current directory");
            buf.resize(buf.size() * 2);
        }
        full = buf.data();
        full += '/';
    }
    full += path;
    std::string key;
    key.reserve(full.size());
    size_t i = 0;
    while (i < full.size()) {
        const size_t j = std::min(full.find('/', i), full.size());
        const size_t len = j - i;
        if (len > 0 && !(len == 1 && full[i] == '.')) {
            key += '/';
            key.append(full, i, len);
        }
        i = j + 1;
    }
    return key.empty() ? "/" : key;
}

std::string FileTable::key_at(int dir_fd, const std::string& name) {
    struct stat st;
    if (fstat(dir_fd, &st) != 0) throw IoError(errno, Op::kStat, name, 0, 0, "the directory fd is not open");
    if (!S_ISDIR(st.st_mode)) throw IoError(ENOTDIR, Op::kOpen, name, 0, 0, "dir_fd is not a directory");
    return "@" + std::to_string(static_cast<uint64_t>(st.st_dev)) + ":" +
           std::to_string(static_cast<uint64_t>(st.st_ino)) + "/" + name;
}

bool FileTable::add(const std::string& key, std::shared_ptr<RegisteredFile> f) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!files_.emplace(key, std::move(f)).second) return false;
    count_.store(files_.size(), std::memory_order_release);
    return true;
}

FileUse FileTable::use(const std::string& key) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = files_.find(key);
    if (it == files_.end()) return FileUse();
    std::shared_ptr<RegisteredFile> f = it->second;  // may throw bad_alloc: nothing counted yet
    {
        // A file in the table is never dropped: remove() takes it out under mu_ first.
        std::lock_guard<std::mutex> flk(f->mu);
        ++f->users;
    }
    return FileUse(std::move(f));
}

int FileTable::drop(RegisteredFile& f) noexcept {
    bool unused;
    {
        std::lock_guard<std::mutex> lk(f.mu);
        f.dropped = true;
        unused = f.users == 0;
    }
    return unused ? f.fd.reset() : 0;
}

int FileTable::remove(const std::string& key, bool* found) {
    std::shared_ptr<RegisteredFile> f;
    {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = files_.find(key);
        *found = it != files_.end();
        if (!*found) return 0;
        f = std::move(it->second);
        files_.erase(it);
        count_.store(files_.size(), std::memory_order_release);
    }
    return drop(*f);
}

int FileTable::clear(std::string* path) {
    std::map<std::string, std::shared_ptr<RegisteredFile>> files;
    {
        std::lock_guard<std::mutex> lk(mu_);
        files.swap(files_);
        count_.store(0, std::memory_order_release);
    }
    int first = 0;
    for (auto& kv : files) {
        const int err = drop(*kv.second);
        if (err != 0 && first == 0) {
            first = err;
            try {
                *path = kv.second->path;
            } catch (const std::bad_alloc&) {
                // the errno alone still reaches the caller
            }
        }
    }
    return first;
}

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
