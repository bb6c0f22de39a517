// The portable backend: plain pread/pwrite, one at a time on the worker thread. Parallelism comes from the
// handle's worker threads (intra_op_parallelism), so queue_depth only bounds how much is prepared at once.
#include <unistd.h>

#include <cerrno>

#include "engine.h"

namespace zo {

namespace {

class PsyncEngine : public Engine {
  public:
    explicit PsyncEngine(unsigned depth) { queued_.reserve(depth); }
    const char* name() const override { return "psync"; }
    void prepare(const IoReq& req) override { queued_.push_back(req); }
    void submit_and_reap(size_t min_done, std::vector<IoDone>& done) override {
        (void)min_done;  // everything queued is done synchronously
        for (const IoReq& r : queued_) {
            ssize_t n;
            do {
                n = r.write ? pwrite(r.fd, r.buf, r.len, static_cast<off_t>(r.offset))
                            : pread(r.fd, r.buf, r.len, static_cast<off_t>(r.offset));
            } while (n < 0 && errno == EINTR);
            done.push_back({r.tag, n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n)});
        }
        queued_.clear();
    }

  private:
    std::vector<IoReq> queued_;
};

}  // namespace

std::unique_ptr<Engine> make_psync_engine(unsigned depth) { return std::make_unique<PsyncEngine>(depth); }

}  // namespace zo
