#include "file_util.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>

namespace zo {

FileDesc& FileDesc::operator=(FileDesc&& o) noexcept {
    if (this != &o) {
        reset();
        fd_ = o.fd_;
        owned_ = o.owned_;
        o.fd_ = -1;
    }
    return *this;
}

int FileDesc::reset() {
    int err = 0;
    if (fd_ >= 0 && owned_) {
        // Linux frees the descriptor even when close reports an error; never retry.
        if (close(fd_) != 0) err = errno;
    }
    fd_ = -1;
    return err;
}

DirectInfo direct_info(int fd) {
    struct statfs sfs;
    if (fstatfs(fd, &sfs) == 0 && (sfs.f_type == TMPFS_MAGIC || sfs.f_type == RAMFS_MAGIC))
        return {false, 1, 1};
#ifdef STATX_DIOALIGN
    struct statx stx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN)) {
        if (stx.stx_dio_offset_align == 0) return {false, 1, 1};
        const uint32_t mem = stx.stx_dio_mem_align == 0 ? 1 : stx.stx_dio_mem_align;
        return {true, stx.stx_dio_offset_align, mem};
    }
#endif
    return {true, 4096, 4096};
}

int64_t file_size(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return -errno;
    if (S_ISBLK(st.st_mode)) {
        uint64_t bytes = 0;
        if (ioctl(fd, BLKGETSIZE64, &bytes) != 0) return -errno;
        return static_cast<int64_t>(bytes);
    }
    return static_cast<int64_t>(st.st_size);
}

std::string fd_name(int fd) {
    char buf[4096];
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
    if (n <= 0) return "<fd " + std::to_string(fd) + ">";
    return std::string(buf, static_cast<size_t>(n));
}

}  // namespace zo
