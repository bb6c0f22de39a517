// Error types of the async I/O core. No Python here: the bindings translate these into AioError and
// BackendUnavailableError.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace zo {

enum class Op { kOpen, kRead, kWrite, kStat, kTruncate, kClose, kSetup };

const char* op_name(Op op);

// An I/O failure with everything a caller needs to act on it: errno, the file, the byte range and the step.
class IoError : public std::runtime_error {
  public:
    IoError(int err, Op op, std::string path, int64_t offset, int64_t length, const std::string& detail);

    int err() const { return err_; }
    Op op() const { return op_; }
    const std::string& path() const { return path_; }
    int64_t offset() const { return offset_; }
    int64_t length() const { return length_; }
    // strerror(err) followed by the detail, e.g. "No data available: read past end of file (size 10)".
    const std::string& reason() const { return reason_; }

  private:
    int err_;
    Op op_;
    std::string path_;
    int64_t offset_;
    int64_t length_;
    std::string reason_;
};

// A backend that was asked for by name cannot be used on this kernel (disabled, filtered, too old).
class BackendUnavailable : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// The caller passed something invalid (maps to ValueError in Python).
class UsageError : public std::invalid_argument {
  public:
    using std::invalid_argument::invalid_argument;
};

std::string errno_text(int err);

}  // namespace zo
