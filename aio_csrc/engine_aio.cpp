// Linux native AIO through raw syscalls (no libaio): io_setup / io_submit / io_getevents / io_destroy.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "aio_error.h"
#include "engine.h"

namespace zo {

namespace {

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(__NR_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(__NR_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, struct iocb** iocbs) {
    return syscall(__NR_io_submit, ctx, n, iocbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event* ev) {
    return syscall(__NR_io_getevents, ctx, min_nr, nr, ev, nullptr);
}

class AioEngine : public Engine {
  public:
    AioEngine(unsigned depth, bool single_submit)
        : single_submit_(single_submit), iocbs_(depth), events_(depth) {
        pending_.reserve(depth);
        if (sys_io_setup(depth, &ctx_) != 0) {
            const int err = errno;
            throw BackendUnavailable("aio: io_setup(" + std::to_string(depth) + ") failed: [Errno " +
                                     std::to_string(err) + "] " + errno_text(err) +
                                     (err == EAGAIN ? " (fs.aio-max-nr exhausted?)" : ""));
        }
    }
    ~AioEngine() override {
        // io_destroy waits for (or cancels) whatever is still in flight, so no buffer is written later.
        if (ctx_ != 0) sys_io_destroy(ctx_);
    }
    const char* name() const override { return "aio"; }

    void prepare(const IoReq& req) override {
        struct iocb& cb = iocbs_[req.tag];  // tags are slot numbers < depth: one iocb per slot
        std::memset(&cb, 0, sizeof(cb));
        cb.aio_data = req.tag;
        cb.aio_lio_opcode = req.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
        cb.aio_fildes = static_cast<uint32_t>(req.fd);
        cb.aio_buf = reinterpret_cast<uint64_t>(req.buf);
        cb.aio_nbytes = req.len;
        cb.aio_offset = static_cast<int64_t>(req.offset);
        pending_.push_back(&cb);
    }

    void submit_and_reap(size_t min_done, std::vector<IoDone>& done) override {
        size_t reaped = 0;
        size_t i = 0;
        while (i < pending_.size()) {
            const long n = single_submit_ ? 1 : static_cast<long>(pending_.size() - i);
            const long r = sys_io_submit(ctx_, n, &pending_[i]);
            if (r > 0) {
                i += static_cast<size_t>(r);
                inflight_ += static_cast<size_t>(r);
                continue;
            }
            const int err = r == 0 ? EAGAIN : errno;
            if ((err == EAGAIN || err == EINTR) && inflight_ > 0) {
                reaped += reap(1, done);  // make room, then retry
                continue;
            }
            if (err == EINTR) continue;
            // The first unsubmitted iocb was refused (e.g. EINVAL, EBADF): report it and go on.
            done.push_back({static_cast<uint32_t>(pending_[i]->aio_data), -static_cast<int64_t>(err)});
            ++reaped;
            ++i;
        }
        pending_.clear();
        if (reaped < min_done) reap(min_done - reaped, done);
    }

  private:
    size_t reap(size_t want, std::vector<IoDone>& done) {
        if (want > inflight_) want = inflight_;
        size_t got = 0;
        while (got < want || (want == 0 && got == 0 && inflight_ > 0)) {
            const long min_nr = static_cast<long>(want - got);
            const long r = sys_io_getevents(ctx_, min_nr, static_cast<long>(events_.size()), events_.data());
            if (r < 0) {
                if (errno == EINTR) continue;
                return got;  // EFAULT/EINVAL cannot happen with our own context and array
            }
            for (long k = 0; k < r; ++k)
                done.push_back({static_cast<uint32_t>(events_[k].data), events_[k].res});
            got += static_cast<size_t>(r);
            inflight_ -= static_cast<size_t>(r);
            if (want == 0) break;
        }
        return got;
    }

    aio_context_t ctx_ = 0;
    bool single_submit_;
    size_t inflight_ = 0;
    std::vector<struct iocb> iocbs_;
    std::vector<struct iocb*> pending_;
    std::vector<struct io_event> events_;
};

}  // namespace

std::unique_ptr<Engine> make_aio_engine(unsigned depth, bool single_submit) {
    return std::make_unique<AioEngine>(depth, single_submit);
}

}  // namespace zo
