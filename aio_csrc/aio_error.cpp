#include "aio_error.h"

#include <cstring>

namespace zo {

const char* op_name(Op op) {
    switch (op) {
        case Op::kOpen:
            return "open";
        case Op::kRead:
            return "read";
        case Op::kWrite:
            return "write";
        case Op::kStat:
            return "stat";
        case Op::kTruncate:
            return "truncate";
        case Op::kClose:
            return "close";
        case Op::kSetup:
            return "setup";
    }
    return "unknown";
}

std::string errno_text(int err) {
    char buf[256];
    // GNU strerror_r returns the message (maybe not in buf); thread-safe, unlike strerror.
    const char* msg = strerror_r(err, buf, sizeof(buf));
    return std::string(msg);
}

static std::string make_reason(int err, const std::string& detail) {
    std::string r = errno_text(err);
    if (!detail.empty()) r += ": " + detail;
    return r;
}

static std::string make_what(int err, Op op, const std::string& path, int64_t offset, int64_t length,
                             const std::string& detail) {
    return std::string(op_name(op)) + " of '" + path + "' (offset " + std::to_string(offset) + ", " +
           std::to_string(length) + " bytes) failed: [Errno " + std::to_string(err) + "] " +
           make_reason(err, detail);
}

IoError::IoError(int err, Op op, std::string path, int64_t offset, int64_t length, const std::string& detail)
    : std::runtime_error(make_what(err, op, path, offset, length, detail)),
      err_(err),
      op_(op),
      path_(std::move(path)),
      offset_(offset),
      length_(length),
      reason_(make_reason(err, detail)) {}

}  // namespace zo
