// File-level helpers: RAII descriptors, O_DIRECT support and alignment, sizes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace zo {

// Owns a file descriptor (or borrows one: then it is never closed).
class FileDesc {
  public:
    FileDesc() = default;
    FileDesc(int fd, bool owned) : fd_(fd), owned_(owned) {}
    FileDesc(const FileDesc&) = delete;
    FileDesc& operator=(const FileDesc&) = delete;
    FileDesc(FileDesc&& o) noexcept : fd_(o.fd_), owned_(o.owned_) { o.fd_ = -1; }
    FileDesc& operator=(FileDesc&& o) noexcept;
    ~FileDesc() { reset(); }
    int get() const { return fd_; }
    bool owned() const { return owned_; }
    // Closes an owned descriptor now; returns 0 or the errno of close().
    int reset();

  private:
    int fd_ = -1;
    bool owned_ = false;
};

struct DirectInfo {
    bool supported;         // real direct I/O is possible on this file
    uint32_t offset_align;  // file offset and length granularity for O_DIRECT
    uint32_t mem_align;     // buffer address granularity for O_DIRECT
};

// Whether `fd`'s filesystem does real direct I/O, and with which alignment: statx(STATX_DIOALIGN) where
// the kernel reports it, else 4096. tmpfs/ramfs count as unsupported: since Linux 6.6 tmpfs accepts
// O_DIRECT but serves it from the page cache, so calling that "direct" would be a lie.
DirectInfo direct_info(int fd);

// Size of a regular file or block device; -errno on failure.
int64_t file_size(int fd);

// Best-effort name of an fd for error messages (readlink of /proc/self/fd/N).
std::string fd_name(int fd);

}  // namespace zo
