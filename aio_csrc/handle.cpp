// Request splitting and the worker threads.
//
// A request [offset, offset + nbytes) is cut at multiples of the block size (absolute file offsets, so
// every cut is aligned) into at most intra_op_parallelism contiguous tasks, one per worker. Each worker
// turns its tasks into block-sized pieces and keeps up to queue_depth of them in flight on its own engine.
// A piece whose file range or buffer address is not aligned for O_DIRECT goes through an aligned bounce
// buffer of the worker: reads fetch the covering aligned range and copy out the wanted bytes; writes fill
// partial edge blocks from the file first (read-modify-write), copy the caller's bytes in, and write the
// aligned range. Because cuts fall on block boundaries, no two pieces of one request share a block.
#include "handle.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <list>
#include <new>
#include <set>
#include <system_error>
#include <thread>

#include "engine.h"
#include "fault_inject.h"
#include "file_registry.h"
#include "file_util.h"
#include "pinned.h"

namespace zo {

namespace {

constexpr unsigned kMaxBounceBuffers = 8;  // per worker; aligned requests never use them
constexpr unsigned kMaxRetries = 1000;     // EAGAIN/EINTR completions resubmitted before giving up
constexpr size_t kMaxBlockSize = size_t(1) << 30;
constexpr const char* kClosedMessage = "the aio Handle is closed";

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

DirectMode parse_direct_mode(const std::string& s) {
    if (s == "auto") return DirectMode::kAuto;
    if (s == "on") return DirectMode::kOn;
    if (s == "off") return DirectMode::kOff;
    throw UsageError("direct must be 'auto', 'on' or 'off', got '" + s + "'");
}

struct Request {
    bool write = false;
    bool async = false;
    char* buf = nullptr;
    uint64_t nbytes = 0;
    uint64_t offset = 0;
    FileUse registered;  // holds a registered file's descriptor open; declared before fd, released after it
    FileDesc fd;
    FileDesc rmw_fd;  // readable descriptor for read-modify-write when fd is write-only
    bool direct = false;
    uint32_t oa = 1;      // O_DIRECT offset/length alignment (1 when buffered)
    uint32_t ma = 1;      // O_DIRECT buffer address alignment (1 when buffered)
    uint64_t block = 0;   // piece size: block_size rounded up to oa
    uint64_t size = 0;    // file size when the request was made
    FileKey key;          // identifies the file for BlockLocks and SizeTracker
    bool padded = false;  // an O_DIRECT write with an unaligned end: its last block is written whole
    std::string path;     // empty for caller fds: named lazily, only for errors

    std::atomic<unsigned> tasks_left{0};
    std::atomic<bool> failed{false};
    std::mutex err_mu;
    std::optional<IoError> error;
    bool done = false;  // guarded by Handle::mu_

    std::string name() const { return path.empty() ? fd_name(fd.get()) : path; }
    int read_fd() const { return rmw_fd.get() >= 0 ? rmw_fd.get() : fd.get(); }
    // Never throws: when even the error text cannot be allocated, the errno alone is kept
    // (fallback_err) and the request still fails rather than the worker thread dying.
    void fail(int err, Op op, uint64_t off, uint64_t len, const std::string& detail) noexcept {
        try {
            IoError e(err, op, name(), static_cast<int64_t>(off), static_cast<int64_t>(len), detail);
            std::lock_guard<std::mutex> lk(err_mu);
            if (!error) error.emplace(std::move(e));
        } catch (...) {
            std::lock_guard<std::mutex> lk(err_mu);
            if (fallback_err == 0) fallback_err = err;
        }
        failed.store(true, std::memory_order_release);
    }
    // A C++ exception met while working on this request becomes its error instead of escaping the
    // worker thread (which would std::terminate the process): bad_alloc is ENOMEM.
    void fail_internal(const std::exception& e, uint64_t off, uint64_t len) noexcept {
        const Op op = write ? Op::kWrite : Op::kRead;
        if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
            fail(ENOMEM, op, off, len, "out of memory inside the I/O worker");
        } else if (const auto* se = dynamic_cast<const std::system_error*>(&e)) {
            fail(se->code().value(), op, off, len, std::string("inside the I/O worker: ") + e.what());
        } else {
            fail(EIO, op, off, len, std::string("internal error inside the I/O worker: ") + e.what());
        }
    }
    int fallback_err = 0;  // guarded by err_mu
};

struct Task {
    std::shared_ptr<Request> req;
    uint64_t pos;  // next file offset to issue
    uint64_t end;
    unsigned outstanding = 0;
};

class Worker {
  public:
    Worker(Handle& h, const HandleOptions& o, const std::string& backend) : h_(h), o_(o), backend_(backend) {
        slots_.resize(o.queue_depth);
        for (unsigned i = o.queue_depth; i-- > 0;) free_slots_.push_back(i);
        // Capacity up front, so that returning a bounce buffer never allocates on the worker thread.
        free_bounce_.reserve(kMaxBounceBuffers);
        std::promise<void> init;
        std::future<void> ready = init.get_future();
        // The engine is created on the worker thread: an io_uring ring may then be SINGLE_ISSUER.
        // std::thread throws std::system_error (EAGAIN) when the kernel refuses a thread; Handle turns it
        // into an IoError.
        alloc_point("thread");
        th_ = std::thread([this, &init] { run(init); });
        try {
            ready.get();  // rethrows the thread's setup failure: BackendUnavailable, bad_alloc, ...
        } catch (...) {
            th_.join();
            throw;
        }
    }
    ~Worker() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        if (th_.joinable()) th_.join();
    }
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;

    // Takes a one-element list: the caller allocated the node, so the worker never allocates to accept
    // work (splicing does not allocate).
    void enqueue(std::list<Task>& node) {
        {
            std::lock_guard<std::mutex> lk(mu_);
            queue_.splice(queue_.end(), node);
        }
        cv_.notify_one();
    }
    void wake() {
        {
            std::lock_guard<std::mutex> lk(mu_);
        }
        cv_.notify_all();
    }

  private:
    struct Slot {
        std::list<Task>::iterator task;
        uint64_t fo;      // the caller's bytes: file offset
        uint64_t len;     //   and length
        char* user;       //   and buffer
        int bounce;       // bounce buffer index, or -1 when the I/O goes straight to `user`
        uint64_t io_off;  // the I/O actually issued: aligned range when bounced
        uint64_t io_len;
        uint64_t need;  // bytes of the I/O that must arrive (reads may stop at EOF past the wanted bytes)
        uint64_t done;
        unsigned retries;
        int nlocked;  // partial blocks held in BlockLocks (read-modify-write in progress)
        uint64_t locked[2];
    };
    enum class Bounce { kReady, kBusy, kNoMemory };

    // Nothing may escape this function: an exception leaving a std::thread terminates the process.
    void run(std::promise<void>& init) noexcept {
        std::vector<IoDone> done;
        try {
            done.reserve(o_.queue_depth);
            alloc_point("engine_setup");
            eng_ = make_engine(backend_, o_.queue_depth, o_.single_submit);
        } catch (const std::bad_alloc&) {
            init.set_exception(std::current_exception());  // MemoryError: no other backend would help
            return;
        } catch (const BackendUnavailable&) {
            init.set_exception(std::current_exception());
            return;
        } catch (const std::exception& e) {
            // Whatever else kept the engine from starting: under "auto" the next backend is tried.
            try {
                init.set_exception(std::make_exception_ptr(BackendUnavailable(e.what())));
            } catch (...) {
                init.set_exception(std::current_exception());  // the message did not fit in memory
            }
            return;
        } catch (...) {
            init.set_exception(std::current_exception());
            return;
        }
        init.set_value();
        for (;;) {
            try {
                if (!step(done)) return;
            } catch (const std::exception& e) {
                abandon_active(e);
            } catch (...) {
                abandon_active(std::runtime_error("unknown exception"));
            }
        }
    }

    // Last resort for an exception that got past the per-piece handling: fail every request this worker
    // holds, so none waits forever. Pieces already in the kernel still complete normally.
    void abandon_active(const std::exception& e) noexcept {
        for (Task& t : active_) {
            t.req->fail_internal(e, t.pos, t.end - t.pos);
            t.pos = t.end;
        }
        try {
            fill();  // finishes the tasks that have nothing in flight
        } catch (...) {
            // fill() of failed tasks issues nothing; tasks left are finished by their last completion
        }
    }

    // One round: take new tasks, issue pieces, reap completions. False when the worker should exit.
    bool step(std::vector<IoDone>& done) {
        {
            std::unique_lock<std::mutex> lk(mu_);
            if (busy_ == 0 && active_.empty()) {
                cv_.wait(lk, [&] { return stop_ || (!queue_.empty() && !h_.paused()); });
                if (queue_.empty()) return false;  // stop_: the handle waited for everything first
            }
            if (!h_.paused()) active_.splice(active_.end(), queue_);
        }
        // overlap_events=False: a new batch only once the previous one has fully completed.
        lock_blocked_ = false;
        if (o_.overlap_events || busy_ == 0) fill();
        if (busy_ == 0) {
            // Nothing of ours in flight: the only thing to wait for is another writer's block.
            if (lock_blocked_) BlockLocks::instance().wait_for_release(lock_gen_);
            return true;
        }
        done.clear();
        eng_->submit_and_reap(o_.overlap_events ? 1 : busy_, done);
        for (const IoDone& d : done) complete(d);
        return true;
    }

    void fill() {
        auto it = active_.begin();
        while (it != active_.end() && !free_slots_.empty()) {
            Task& t = *it;
            if (t.req->failed.load(std::memory_order_acquire)) t.pos = t.end;
            bool blocked = false;
            while (t.pos < t.end && !free_slots_.empty()) {
                bool started = false;
                try {
                    started = start_piece(it);
                } catch (const std::exception& e) {
                    // start_piece changes nothing before it throws: fail the request, issue no more of it.
                    t.req->fail_internal(e, t.pos, t.end - t.pos);
                    t.pos = t.end;
                    break;
                }
                if (!started) {
                    blocked = true;
                    break;
                }
            }
            if (t.pos >= t.end && t.outstanding == 0) {
                it = finish_task(it);
                continue;
            }
            if (blocked) break;
            ++it;
        }
    }

    // Issues the next piece of *it. Returns false when it must wait for a bounce buffer or a block lock.
    // Strong guarantee: if it throws (out of memory), no slot, bounce buffer or block lock is taken.
    bool start_piece(std::list<Task>::iterator it) {
        Task& t = *it;
        Request& r = *t.req;
        const uint64_t fo = t.pos;
        const uint64_t end = std::min(t.end, (fo / r.block + 1) * r.block);
        const uint64_t len = end - fo;
        char* user = r.buf + (fo - r.offset);
        const bool aligned =
            !r.direct || (fo % r.oa == 0 && len % r.oa == 0 && reinterpret_cast<uintptr_t>(user) % r.ma == 0);
        Slot s{it, fo, len, user, -1, fo, len, len, 0, 0, 0, {0, 0}};
        if (!aligned) {
            const Bounce b = reserve_bounce(r.block);
            if (b == Bounce::kBusy) return false;
            if (b == Bounce::kNoMemory) {
                r.fail(ENOMEM, r.write ? Op::kWrite : Op::kRead, fo, len, "cannot allocate a bounce buffer");
                t.pos = t.end;
                return true;
            }
            s.bounce = free_bounce_.back();
            s.io_off = fo / r.oa * r.oa;
            s.io_len = round_up(fo + len, r.oa) - s.io_off;
            char* bb = bounce_ptr(s.bounce);
            if (r.write) {
                s.need = s.io_len;
                const uint64_t last = s.io_off + s.io_len - r.oa;
                const bool head = fo != s.io_off;
                const bool tail = fo + len != s.io_off + s.io_len && (last != s.io_off || !head);
                if (head) s.locked[s.nlocked++] = s.io_off;
                if (tail) s.locked[s.nlocked++] = last;
                if (s.nlocked > 0 &&
                    !BlockLocks::instance().try_lock(r.key, s.locked, s.nlocked, &lock_gen_)) {
                    lock_blocked_ = true;
                    return false;
                }
                bool ok = true;
                if (head) ok = prefill(r, bb, s.io_off);
                if (ok && tail) ok = prefill(r, bb + (last - s.io_off), last);
                if (!ok) {
                    BlockLocks::instance().unlock(r.key, s.locked, s.nlocked);
                    t.pos = t.end;
                    return true;
                }
                std::memcpy(bb + (fo - s.io_off), user, len);
            } else {
                s.need = fo + len - s.io_off;
            }
        }
        const uint32_t tag = free_slots_.back();
        slots_[tag] = s;
        try {
            issue(tag);
        } catch (...) {
            if (s.nlocked > 0) BlockLocks::instance().unlock(r.key, s.locked, s.nlocked);
            throw;
        }
        free_slots_.pop_back();
        if (s.bounce >= 0) free_bounce_.pop_back();
        ++busy_;
        ++t.outstanding;
        t.pos = end;
        return true;
    }

    // Read-modify-write: load the block at `off` so the bytes around the caller's survive.
    bool prefill(Request& r, char* dst, uint64_t off) {
        size_t got = 0;
        if (r.read_fd() >= 0) {
            while (got < r.oa) {
                const ssize_t n = pread(r.read_fd(), dst + got, r.oa - got, static_cast<off_t>(off + got));
                if (n < 0 && errno == EINTR) continue;
                if (n < 0) {
                    r.fail(errno, Op::kRead, off, r.oa, "reading a partial block for read-modify-write");
                    return false;
                }
                if (n == 0) break;  // past the end of file: zeros
                got += static_cast<size_t>(n);
                if (got % r.oa != 0 && r.direct) break;  // short O_DIRECT read = end of file
            }
        }
        std::memset(dst + got, 0, r.oa - got);
        return true;
    }

    void issue(uint32_t tag) {
        Slot& s = slots_[tag];
        Request& r = *s.task->req;
        char* base = s.bounce >= 0 ? bounce_ptr(s.bounce) : s.user;
        alloc_point("submit");
        eng_->prepare(IoReq{r.fd.get(), r.write, base + s.done, static_cast<size_t>(s.io_len - s.done),
                            s.io_off + s.done, tag, s.bounce >= 0 && arena_fixed_});
    }

    void complete(const IoDone& d) {
        Slot& s = slots_[d.tag];
        Request& r = *s.task->req;
        const Op op = r.write ? Op::kWrite : Op::kRead;
        if (d.res < 0) {
            const int err = static_cast<int>(-d.res);
            if ((err == EAGAIN || err == EINTR) && s.retries++ < kMaxRetries) {
                reissue(d.tag);
                return;
            }
            r.fail(err, op, s.io_off + s.done, s.io_len - s.done,
                   err == EINVAL && r.direct
                       ? "O_DIRECT refused the request (alignment " + std::to_string(r.oa) + ")"
                       : "");
            finish_piece(d.tag);
            return;
        }
        s.done += static_cast<uint64_t>(d.res);
        if (s.done >= s.need) {
            if (!r.write && s.bounce >= 0)
                std::memcpy(s.user, bounce_ptr(s.bounce) + (s.fo - s.io_off), s.len);
            finish_piece(d.tag);
            return;
        }
        const uint64_t at = s.io_off + s.done;
        // No progress, or an O_DIRECT transfer that stopped off-block: the file ends here.
        if (d.res == 0 || (r.direct && at % r.oa != 0)) {
            if (r.write) {
                r.fail(EIO, op, at, s.io_len - s.done,
                       d.res == 0 ? "the write made no progress"
                                  : "an O_DIRECT write stopped off a block boundary");
            } else {
                r.fail(ENODATA, op, at, s.need - s.done,
                       "file ended at offset " + std::to_string(at) +
                           ", before the requested range (was it truncated after the request was made?)");
            }
            finish_piece(d.tag);
            return;
        }
        reissue(d.tag);  // short transfer: the remainder
    }

    // Issues the rest of a piece already in flight; if that throws, the piece ends with the error.
    void reissue(uint32_t tag) {
        try {
            issue(tag);
        } catch (const std::exception& e) {
            Slot& s = slots_[tag];
            s.task->req->fail_internal(e, s.io_off + s.done, s.io_len - s.done);
            finish_piece(tag);
        }
    }

    void finish_piece(uint32_t tag) {
        Slot& s = slots_[tag];
        auto it = s.task;
        if (s.nlocked > 0) BlockLocks::instance().unlock(it->req->key, s.locked, s.nlocked);
        if (s.bounce >= 0) free_bounce_.push_back(s.bounce);
        free_slots_.push_back(tag);
        --busy_;
        Task& t = *it;
        --t.outstanding;
        if (t.req->failed.load(std::memory_order_acquire)) t.pos = t.end;
        if (t.pos >= t.end && t.outstanding == 0) finish_task(it);
    }

    std::list<Task>::iterator finish_task(std::list<Task>::iterator it) {
        std::shared_ptr<Request> req = std::move(it->req);
        auto next = active_.erase(it);
        if (req->tasks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) h_.request_finished(*req);
        return next;
    }

    Bounce reserve_bounce(uint64_t slot_bytes) {
        if (arena_ && bounce_bytes_ >= slot_bytes)
            return free_bounce_.empty() ? Bounce::kBusy : Bounce::kReady;
        if (arena_ && free_bounce_.size() != n_bounce_) return Bounce::kBusy;  // grow once all are back
        const unsigned n = std::min(o_.queue_depth, kMaxBounceBuffers);
        const uint64_t bytes = round_up(slot_bytes, kPreferredAlignment);
        arena_fixed_ = false;
        try {
            arena_.reset();
            alloc_point("bounce");
            arena_ = std::make_unique<PinnedMemory>(n * bytes, size_t(2) << 20, true, false);
        } catch (const std::bad_alloc&) {
            arena_.reset();
            free_bounce_.clear();
            return Bounce::kNoMemory;
        }
        n_bounce_ = n;
        bounce_bytes_ = bytes;
        free_bounce_.clear();
        for (unsigned i = n; i-- > 0;) free_bounce_.push_back(static_cast<int>(i));
        // Registered buffers spare the kernel from pinning the bounce pages on every I/O.
        arena_fixed_ = eng_->register_buffer(arena_->data(), arena_->size());
        return Bounce::kReady;
    }

    char* bounce_ptr(int idx) const { return arena_->data() + static_cast<size_t>(idx) * bounce_bytes_; }

    Handle& h_;
    const HandleOptions o_;
    const std::string backend_;
    std::unique_ptr<Engine> eng_;

    std::mutex mu_;  // guards queue_ and stop_
    std::condition_variable cv_;
    std::list<Task> queue_;
    bool stop_ = false;

    // Owned by the worker thread alone.
    std::list<Task> active_;
    std::vector<Slot> slots_;
    std::vector<uint32_t> free_slots_;
    size_t busy_ = 0;
    std::unique_ptr<PinnedMemory> arena_;
    uint64_t bounce_bytes_ = 0;
    unsigned n_bounce_ = 0;
    std::vector<int> free_bounce_;
    bool arena_fixed_ = false;
    bool lock_blocked_ = false;  // fill() stopped at a block held by another read-modify-write
    uint64_t lock_gen_ = 0;

    std::thread th_;
};

Handle::Handle(const HandleOptions& opts) : opts_(opts) {
    if (opts.block_size == 0 || opts.block_size > kMaxBlockSize)
        throw UsageError("block_size must be in [1, 2**30], got " + std::to_string(opts.block_size));
    if (opts.queue_depth == 0 || opts.queue_depth > 4096)
        throw UsageError("queue_depth must be in [1, 4096], got " + std::to_string(opts.queue_depth));
    if (opts.intra_op_parallelism == 0 || opts.intra_op_parallelism > 256)
        throw UsageError("intra_op_parallelism must be in [1, 256], got " +
                         std::to_string(opts.intra_op_parallelism));
    std::vector<std::string> candidates;
    if (opts.backend == "auto") {
        candidates = available_backends();
    } else if (opts.backend == "io_uring" || opts.backend == "aio" || opts.backend == "psync") {
        const std::string why = backend_unavailable_reason(opts.backend);
        if (!why.empty()) throw BackendUnavailable("backend '" + opts.backend + "' is unavailable: " + why);
        candidates = {opts.backend};
    } else {
        throw UsageError("backend must be 'auto', 'io_uring', 'aio' or 'psync', got '" + opts.backend + "'");
    }
    std::string last_error = "no backend is available";
    for (const std::string& name : candidates) {
        try {
            for (unsigned i = 0; i < opts.intra_op_parallelism; ++i)
                workers_.push_back(std::make_unique<Worker>(*this, opts, name));
            backend_ = name;
            return;
        } catch (const BackendUnavailable& e) {
            // e.g. fs.aio-max-nr exhausted by many contexts: fall back to the next backend under "auto".
            workers_.clear();
            last_error = e.what();
        } catch (const std::system_error& e) {
            // std::thread could not start one (EAGAIN: RLIMIT_NPROC, threads-max, memory). The workers
            // already started are joined by clear(); the caller gets an OSError with the errno.
            const size_t started = workers_.size();
            workers_.clear();
            throw IoError(e.code().value(), Op::kSetup, "", 0, 0,
                          "cannot start I/O worker thread " + std::to_string(started + 1) + " of " +
                              std::to_string(opts.intra_op_parallelism));
        }
    }
    throw BackendUnavailable("backend '" + opts.backend + "' is unavailable: " + last_error);
}

Handle::~Handle() {
    try {
        close();
    } catch (...) {
        // A destructor cannot report; close() explicitly to see late failures.
    }
}

// Counts a call from its entry check to its return, so that close() can refuse new calls and wait for
// the ones in progress before it takes the workers away.
class Handle::CallScope {
  public:
    explicit CallScope(Handle& h) : h_(h) {
        std::lock_guard<std::mutex> lk(h_.mu_);
        if (h_.closing_) throw UsageError(kClosedMessage);
        ++h_.callers_;
    }
    ~CallScope() {
        bool last;
        {
            std::lock_guard<std::mutex> lk(h_.mu_);
            last = --h_.callers_ == 0 && h_.closing_;
        }
        if (last) h_.cv_.notify_all();
    }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;

  private:
    Handle& h_;
};

// One warning per filesystem per process: many handles on one tmpfs should not repeat it.
static bool first_fallback_on(dev_t dev) {
    static std::mutex mu;
    static std::set<dev_t> reported;
    std::lock_guard<std::mutex> lk(mu);
    return reported.insert(dev).second;
}

static void check_args(const void* buf, int64_t nbytes, int64_t offset) {
    if (nbytes < 0) throw UsageError("nbytes must be >= 0, got " + std::to_string(nbytes));
    if (offset < 0) throw UsageError("offset must be >= 0, got " + std::to_string(offset));
    if (buf == nullptr && nbytes > 0) throw UsageError("buffer address is null");
    if (static_cast<uint64_t>(offset) > static_cast<uint64_t>(INT64_MAX - nbytes))
        throw UsageError("offset + nbytes overflows");
}

static std::shared_ptr<Request> new_request(bool write, void* buf, int64_t nbytes, int64_t offset,
                                            bool async) {
    auto req = std::make_shared<Request>();
    req->write = write;
    req->async = async;
    req->buf = static_cast<char*>(buf);
    req->nbytes = static_cast<uint64_t>(nbytes);
    req->offset = static_cast<uint64_t>(offset);
    return req;
}

static void set_alignment(Request& r, const DirectInfo& di, size_t block_size) {
    r.oa = r.direct ? std::max<uint32_t>(di.offset_align, 1) : 1;
    r.ma = r.direct ? std::max<uint32_t>(di.mem_align, 1) : 1;
    r.block = round_up(block_size, r.oa);
}

// Records the file's identity and size; for reads, checks the range against the size.
static void inspect_file(Request& r) {
    const Op op = r.write ? Op::kWrite : Op::kRead;
    struct stat st;
    if (fstat(r.fd.get(), &st) != 0)
        throw IoError(errno, Op::kStat, r.name(), r.offset, r.nbytes, "fstat failed");
    r.key = FileKey{st.st_dev, st.st_ino};
    const int64_t size = S_ISBLK(st.st_mode) ? file_size(r.fd.get()) : static_cast<int64_t>(st.st_size);
    if (size < 0)
        throw IoError(static_cast<int>(-size), Op::kStat, r.name(), r.offset, r.nbytes, "size query failed");
    r.size = static_cast<uint64_t>(size);
    const uint64_t end = r.offset + r.nbytes;
    if (!r.write && end > r.size)
        throw IoError(ENODATA, op, r.name(), r.offset, r.nbytes,
                      "read past end of file: the file is " + std::to_string(r.size) +
                          " bytes, the request ends at " + std::to_string(end));
    r.padded = r.write && r.direct && end % r.oa != 0;
}

// Whether an O_DIRECT write has partial edge blocks, whose other bytes must be read first.
static bool needs_rmw(const Request& r) {
    return r.write && r.direct && r.nbytes > 0 && (r.offset % r.oa != 0 || (r.offset + r.nbytes) % r.oa != 0);
}

namespace {

struct OpenedFile {
    FileDesc fd;
    DirectInfo di{false, 1, 1};
    bool direct = false;
};

// Opens `file` with `flags` | O_NOFOLLOW, with O_DIRECT unless the mode is off; where the filesystem
// refuses O_DIRECT, "auto" keeps the file buffered (and notes the fallback once per filesystem) and "on"
// throws. Errors name the request's range.
int open_nofollow(const FileRef& file, int flags) {
    int fd;
    do {
        fd = ::openat(file.dir_fd, file.name.c_str(), flags | O_NOFOLLOW, 0600);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

[[noreturn]] void throw_open_error(int err, const FileRef& file, int64_t offset, int64_t nbytes,
                                   const char* what) {
    if (err == ELOOP)
        throw IoError(err, Op::kOpen, file.label(), offset, nbytes,
                      std::string(what) + ": it is a symbolic link, which the I/O core never follows");
    throw IoError(err, Op::kOpen, file.label(), offset, nbytes, what);
}

OpenedFile open_file(const FileRef& file, int flags, DirectMode mode, const char* what, int64_t offset,
                     int64_t nbytes, CallNotes* notes) {
    OpenedFile f;
    if (mode != DirectMode::kOff) {
        const int fd = open_nofollow(file, flags | O_DIRECT);
        if (fd >= 0) {
            f.fd = FileDesc(fd, true);
            f.di = direct_info(fd);
            if (!f.di.supported) {
                // Keep the descriptor; just switch it to buffered I/O.
                const int fl = fcntl(fd, F_GETFL);
                if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0)
                    throw IoError(errno, Op::kOpen, file.label(), offset, nbytes, "clearing O_DIRECT");
            }
        } else if (errno != EINVAL) {
            throw_open_error(errno, file, offset, nbytes, what);
        }
        if (!f.di.supported && mode == DirectMode::kOn)
            throw IoError(EINVAL, Op::kOpen, file.label(), offset, nbytes,
                          "the filesystem does not support O_DIRECT (direct='on'; use 'auto' or 'off')");
    }
    if (f.fd.get() < 0) {
        const int fd = open_nofollow(file, flags);
        if (fd < 0) throw_open_error(errno, file, offset, nbytes, what);
        f.fd = FileDesc(fd, true);
    }
    f.direct = f.di.supported && mode != DirectMode::kOff;
    if (!f.direct && mode == DirectMode::kAuto && notes != nullptr) {
        struct stat st;
        if (fstat(f.fd.get(), &st) == 0 && first_fallback_on(st.st_dev)) {
            notes->direct_fallback = true;
            notes->fallback_path = file.label();
        }
    }
    return f;
}

// A second, readable descriptor of the file open as `fd` (read-modify-write of a partial block when `fd`
// is write-only): /proc/self/fd/N names the open file itself, whatever its path names meanwhile.
FileDesc reopen_for_read(int fd, const std::string& shown, int64_t offset, int64_t nbytes) {
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    int rfd;
    do {
        rfd = ::open(link.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    } while (rfd < 0 && errno == EINTR);
    if (rfd < 0)
        throw IoError(errno, Op::kOpen, shown, offset, nbytes,
                      "reopening the file (through /proc/self/fd) for read-modify-write of a partial block");
    return FileDesc(rfd, true);
}

std::string registration_key(const FileRef& file) {
    return file.dir_fd == AT_FDCWD ? FileTable::key_of(file.name) : FileTable::key_at(file.dir_fd, file.name);
}

}  // namespace

void FileRef::validate() const {
    if (name.empty()) throw UsageError("the file name is empty");
    if (name.find('\0') != std::string::npos)
        throw UsageError("the file name '" + name.substr(0, name.find('\0')) +
                         "\\0...' contains a NUL byte: no file can have that name");
    if (dir_fd != AT_FDCWD) {
        if (dir_fd < 0) throw UsageError("dir_fd must be >= 0, got " + std::to_string(dir_fd));
        if (name.find('/') != std::string::npos || name == "." || name == "..")
            throw UsageError("a file opened relative to a directory fd must have a plain name, got '" + name +
                             "'");
    }
}

int64_t Handle::submit_path(bool write, void* buf, int64_t nbytes, const std::string& path, int64_t offset,
                            bool async, CallNotes* notes) {
    return submit_at(write, buf, nbytes, FileRef{AT_FDCWD, path, path}, offset, async, notes);
}

int64_t Handle::submit_at(bool write, void* buf, int64_t nbytes, const FileRef& file, int64_t offset,
                          bool async, CallNotes* notes) {
    check_args(buf, nbytes, offset);
    file.validate();
    CallScope scope(*this);
    auto req = new_request(write, buf, nbytes, offset, async);
    Request& r = *req;
    r.path = file.label();
    if (!files_.empty()) r.registered = files_.use(registration_key(file));
    if (r.registered) {
        // Registered: the descriptor opened at registration, never the path as it is now.
        const RegisteredFile& f = *r.registered.get();
        if (write && !f.writable)
            throw IoError(EBADF, Op::kWrite, r.path, offset, nbytes, "the file is registered read-only");
        r.fd = FileDesc(f.fd.get(), false);
        r.direct = f.direct;
        set_alignment(r, f.di, opts_.block_size);
    } else {
        const int flags = (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_CLOEXEC;
        OpenedFile f = open_file(file, flags, opts_.direct, write ? "opening for write" : "opening for read",
                                 offset, nbytes, notes);
        r.fd = std::move(f.fd);
        r.direct = f.direct;
        set_alignment(r, f.di, opts_.block_size);
    }
    inspect_file(r);
    // Writes open O_WRONLY; read-modify-write of a partial block needs a readable descriptor of the same
    // file (a registered writable file is open O_RDWR already).
    if (needs_rmw(r) && !r.registered) r.rmw_fd = reopen_for_read(r.fd.get(), r.path, offset, nbytes);
    return dispatch(req, async);
}

int64_t Handle::submit_fd(bool write, void* buf, int64_t nbytes, int fd, int64_t offset, bool async) {
    check_args(buf, nbytes, offset);
    CallScope scope(*this);
    auto req = new_request(write, buf, nbytes, offset, async);
    Request& r = *req;
    const int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        throw IoError(errno, Op::kOpen, "<fd " + std::to_string(fd) + ">", offset, nbytes, "fd is not open");
    r.fd = FileDesc(fd, false);
    const int acc = fl & O_ACCMODE;
    if (write ? acc == O_RDONLY : acc == O_WRONLY)
        throw IoError(EBADF, write ? Op::kWrite : Op::kRead, r.name(), offset, nbytes,
                      write ? "the fd is open read-only" : "the fd is open write-only");
    r.direct = (fl & O_DIRECT) != 0;
    DirectInfo di{false, 1, 1};
    if (r.direct) {
        di = direct_info(fd);
        // The caller chose O_DIRECT: honour its rules even where the filesystem does not report them.
        if (!di.supported)
            di = {true, static_cast<uint32_t>(kPreferredAlignment),
                  static_cast<uint32_t>(kPreferredAlignment)};
    }
    set_alignment(r, di, opts_.block_size);
    inspect_file(r);
    if (needs_rmw(r) && acc == O_WRONLY) r.rmw_fd = reopen_for_read(fd, r.name(), offset, nbytes);
    return dispatch(req, async);
}

// Called inside a CallScope: close() cannot empty workers_ meanwhile.
int64_t Handle::dispatch(const std::shared_ptr<Request>& req, bool async) {
    Request& r = *req;
    if (r.nbytes == 0) return 0;
    const uint64_t n = workers_.size();
    if (n == 0) throw UsageError(kClosedMessage);  // unreachable while the CallScope holds
    const uint64_t first = r.offset / r.block;
    const uint64_t last = (r.offset + r.nbytes - 1) / r.block;
    const uint64_t nblocks = last - first + 1;
    const uint64_t per = (nblocks + std::min(n, nblocks) - 1) / std::min(n, nblocks);
    const uint64_t ntasks = (nblocks + per - 1) / per;
    r.tasks_left.store(static_cast<unsigned>(ntasks), std::memory_order_relaxed);
    // Everything that allocates happens before the request is counted, so running out of memory here
    // raises in the caller (MemoryError) and leaves the handle as it was.
    alloc_point("request");
    std::vector<std::list<Task>> nodes(ntasks);
    for (uint64_t i = 0; i < ntasks; ++i) {
        const uint64_t pos = std::max(r.offset, (first + i * per) * r.block);
        const uint64_t end = std::min(r.offset + r.nbytes, (first + (i + 1) * per) * r.block);
        nodes[i].push_back(Task{req, pos, end, 0});
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        ++inflight_total_;
        if (async) ++inflight_async_;
    }
    if (r.write) {
        try {
            SizeTracker::instance().begin_write(r.fd.get(), r.key, r.size, r.offset, r.offset + r.nbytes,
                                                r.direct, r.padded);
        } catch (...) {
            {
                std::lock_guard<std::mutex> lk(mu_);
                --inflight_total_;
                if (async) --inflight_async_;
            }
            cv_.notify_all();
            throw;
        }
    }
    // Rotate the first worker so that many small requests spread over all threads.
    const unsigned start = next_worker_.fetch_add(1, std::memory_order_relaxed);
    for (uint64_t i = 0; i < ntasks; ++i) workers_[(start + i) % n]->enqueue(nodes[i]);
    if (async) return 0;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return r.done; });
    if (r.error) throw *r.error;
    if (r.failed.load(std::memory_order_acquire)) throw std::bad_alloc();  // not even the error fitted
    return static_cast<int64_t>(r.nbytes);
}

void Handle::request_finished(Request& r) {
    if (r.write) {
        // Trims the padding of unaligned O_DIRECT writes once none is in flight on this file.
        const int err = SizeTracker::instance().end_write(r.fd.get(), r.key, r.padded);
        if (err != 0)
            r.fail(err, Op::kTruncate, r.offset, r.nbytes, "trimming the padding of an unaligned write");
    }
    r.rmw_fd.reset();
    const int close_err = r.fd.reset();  // closes only descriptors opened by path
    if (close_err != 0) r.fail(close_err, Op::kClose, r.offset, r.nbytes, "closing the file");
    // The last request on a file unregistered meanwhile closes the registered descriptor.
    const int reg_err = r.registered.release();
    if (reg_err != 0) r.fail(reg_err, Op::kClose, r.offset, r.nbytes, "closing the unregistered file");
    if (r.failed.load(std::memory_order_acquire) && !r.error) {
        // The error text could not be allocated when it happened; memory may be back by now.
        r.fail(r.fallback_err, r.write ? Op::kWrite : Op::kRead, r.offset, r.nbytes, "");
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (r.async) {
            --inflight_async_;
            ++completed_async_;
            if (r.error && !first_error_) {
                try {
                    first_error_ = r.error;
                } catch (const std::bad_alloc&) {
                    async_oom_ = true;
                }
            } else if (!r.error && r.failed.load(std::memory_order_acquire)) {
                async_oom_ = true;
            }
        } else {
            r.done = true;
        }
        --inflight_total_;
    }
    cv_.notify_all();
}

size_t Handle::wait() {
    size_t n = 0;
    bool oom = false;
    std::optional<IoError> err;
    bool notify;
    {
        std::unique_lock<std::mutex> lk(mu_);
        ++waiters_;  // close() lets a running wait() report the failures first
        cv_.wait(lk, [&] { return inflight_async_ == 0; });
        --waiters_;
        n = completed_async_;
        completed_async_ = 0;
        oom = async_oom_ && !first_error_;  // a request failed without memory left even for its error
        async_oom_ = false;
        err.swap(first_error_);  // no allocation: the error moves out
        notify = closing_ && waiters_ == 0;
    }
    if (notify) cv_.notify_all();
    if (err) throw IoError(std::move(*err));
    if (oom) throw std::bad_alloc();
    return n;
}

size_t Handle::pending() const {
    std::lock_guard<std::mutex> lk(mu_);
    return inflight_async_;
}

void Handle::set_paused(bool paused) {
    {
        // Under mu_: a pause that loses the race with close() must not outlive its unpausing.
        std::lock_guard<std::mutex> lk(mu_);
        paused_.store(paused && !closing_, std::memory_order_release);
    }
    wake_workers();
}

void Handle::wake_workers() {
    std::lock_guard<std::mutex> lk(workers_mu_);
    for (auto& w : workers_) w->wake();
}

void Handle::register_file(const std::string& path, bool writable, CallNotes* notes) {
    register_at(FileRef{AT_FDCWD, path, path}, writable, notes);
}

void Handle::register_at(const FileRef& file, bool writable, CallNotes* notes) {
    file.validate();
    CallScope scope(*this);
    const std::string key = registration_key(file);
    auto f = std::make_shared<RegisteredFile>();
    f->path = file.label();
    f->writable = writable;
    const int flags = (writable ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC;
    OpenedFile opened =
        open_file(file, flags, opts_.direct,
                  writable ? "registering for read and write" : "registering for read", 0, 0, notes);
    f->fd = std::move(opened.fd);
    f->di = opened.di;
    f->direct = opened.direct;
    if (!files_.add(key, f))
        throw UsageError("'" + file.label() + "' is already registered with this aio Handle");
}

void Handle::unregister_file(const std::string& path) { unregister_at(FileRef{AT_FDCWD, path, path}); }

void Handle::unregister_at(const FileRef& file) {
    file.validate();
    CallScope scope(*this);
    bool found = false;
    const int err = files_.remove(registration_key(file), &found);
    if (!found) throw UsageError("'" + file.label() + "' is not registered with this aio Handle");
    if (err != 0) throw IoError(err, Op::kClose, file.label(), 0, 0, "closing the unregistered file");
}

void Handle::close() {
    {
        std::unique_lock<std::mutex> lk(mu_);
        if (closing_) {
            cv_.wait(lk, [&] { return closed_; });  // another thread is closing
            return;
        }
        closing_ = true;                                  // from here on, new calls throw UsageError
        paused_.store(false, std::memory_order_release);  // paused workers would never drain
    }
    wake_workers();
    std::optional<IoError> err;
    bool oom = false;
    {
        std::unique_lock<std::mutex> lk(mu_);
        // Calls that passed their entry check finish first: a submission may still be opening its file
        // and is about to use workers_; a running wait() takes the failures it is waiting for.
        cv_.wait(lk, [&] { return callers_ == 0 && waiters_ == 0 && inflight_total_ == 0; });
        err.swap(first_error_);
        oom = async_oom_ && !err;
        async_oom_ = false;
        completed_async_ = 0;  // reaped here: a later wait() returns 0
    }
    std::string failed_path;
    const int close_err = files_.clear(&failed_path);
    {
        std::lock_guard<std::mutex> lk(workers_mu_);
        workers_.clear();  // joins the threads, frees rings / AIO contexts and bounce buffers
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        closed_ = true;
    }
    cv_.notify_all();
    if (err) throw IoError(std::move(*err));
    if (oom) throw std::bad_alloc();
    if (close_err != 0) throw IoError(close_err, Op::kClose, failed_path, 0, 0, "closing a registered file");
}

}  // namespace zo
