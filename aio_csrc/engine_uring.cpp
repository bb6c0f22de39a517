// io_uring through raw syscalls and the mmap'd rings (no liburing).
//
// One ring per worker thread, created on that thread, so the ring can be SINGLE_ISSUER + DEFER_TASKRUN
// where the kernel has them (6.1+): completions are then processed only when we ask for them, in our own
// io_uring_enter, which is the cheapest mode for a thread that submits and waits in a loop. Submission and
// waiting share one io_uring_enter call.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "aio_error.h"
#include "engine.h"
#include "pinned.h"

namespace zo {

namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
    return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}
int sys_register(int fd, unsigned op, const void* arg, unsigned nr) {
    return static_cast<int>(syscall(__NR_io_uring_register, fd, op, arg, nr));
}

unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

[[noreturn]] void unavailable(const char* what, int err) {
    throw BackendUnavailable(
        std::string("io_uring: ") + what + " failed: [Errno " + std::to_string(err) + "] " + errno_text(err) +
        (err == EPERM    ? " (disabled by sysctl kernel.io_uring_disabled or a seccomp filter?)"
         : err == ENOSYS ? " (kernel without io_uring, or filtered)"
                         : ""));
}

class Mapping {
  public:
    Mapping() = default;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() {
        if (ptr_ != nullptr) munmap(ptr_, len_);
    }
    void map(int fd, size_t len, off_t what) {
        void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
        if (p == MAP_FAILED) unavailable("mmap of the ring", errno);
        ptr_ = p;
        len_ = len;
    }
    char* get() const { return static_cast<char*>(ptr_); }

  private:
    void* ptr_ = nullptr;
    size_t len_ = 0;
};

class UringEngine : public Engine {
  public:
    UringEngine(unsigned depth, bool single_submit) : single_submit_(single_submit) {
        // Allocate before the ring exists, so that running out of memory cannot leak its descriptor.
        slots_.resize(kFixedSlots);
        refused_.reserve(kMaxRefused);
        // Cheapest first; older kernels reject unknown flags with EINVAL.
        const unsigned flag_sets[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
                                      IORING_SETUP_COOP_TASKRUN, 0};
        int err = 0;
        for (unsigned flags : flag_sets) {
            std::memset(&p_, 0, sizeof(p_));
            p_.flags = flags;
            fd_ = sys_setup(depth, &p_);
            if (fd_ >= 0) break;
            err = errno;
            if (err != EINVAL) break;
        }
        if (fd_ < 0) unavailable("io_uring_setup", err);
        try {
            map_rings();
        } catch (...) {
            close(fd_);
            throw;
        }
        // A sparse table of fixed buffers (5.19+): slot 0 for the bounce arena, the rest for the caller's
        // pinned staging buffers as they show up. Older kernels: the arena alone, via REGISTER_BUFFERS.
        io_uring_rsrc_register rr{};
        rr.nr = kFixedSlots;
        rr.flags = IORING_RSRC_REGISTER_SPARSE;
        sparse_ = sys_register(fd_, IORING_REGISTER_BUFFERS2, &rr, sizeof(rr)) == 0;
    }
    ~UringEngine() override {
        // Closing the ring cancels and reaps what is left; the worker never closes with I/O in flight.
        if (fd_ >= 0) close(fd_);
    }
    const char* name() const override { return "io_uring"; }

    void prepare(const IoReq& req) override {
        const unsigned tail = *sq_tail_;  // only this thread writes the tail
        const unsigned idx = tail & *sq_mask_;
        io_uring_sqe* sqe = &sqes_[idx];
        std::memset(sqe, 0, sizeof(*sqe));
        int slot = -1;
        if (req.fixed_buf && fixed_) {
            slot = 0;
        } else if (sparse_) {
            slot = staging_slot(reinterpret_cast<uintptr_t>(req.buf), req.len);
        }
        if (slot >= 0) {
            sqe->opcode = req.write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
            sqe->buf_index = static_cast<uint16_t>(slot);
        } else {
            sqe->opcode = req.write ? IORING_OP_WRITE : IORING_OP_READ;
        }
        sqe->fd = req.fd;
        sqe->addr = reinterpret_cast<uint64_t>(req.buf);
        sqe->len = static_cast<uint32_t>(req.len);
        sqe->off = req.offset;
        sqe->user_data = req.tag;
        sq_array_[idx] = idx;
        store_release(sq_tail_, tail + 1);
        ++unsubmitted_;
    }

    void submit_and_reap(size_t min_done, std::vector<IoDone>& done) override {
        size_t got = harvest(done);
        while (unsubmitted_ > 0) {
            const unsigned n = single_submit_ ? 1 : unsubmitted_;
            // The last batch also waits; with DEFER_TASKRUN, GETEVENTS is what runs completions.
            const bool last = n == unsubmitted_;
            const unsigned want = last && got < min_done ? static_cast<unsigned>(min_done - got) : 0;
            const int r = sys_enter(fd_, n, want, IORING_ENTER_GETEVENTS);
            if (r >= 0) {
                unsubmitted_ -= static_cast<unsigned>(r);
                inflight_ += static_cast<unsigned>(r);
                got += harvest(done);
                if (r == 0 && n > 0) refuse_unsubmitted(EAGAIN, done, got);
                continue;
            }
            const int err = errno;
            if (err == EINTR) continue;
            if ((err == EAGAIN || err == EBUSY) && inflight_ > 0) {
                got += wait_for(1, done);
                continue;
            }
            refuse_unsubmitted(err, done, got);
        }
        if (got < min_done) wait_for(min_done - got, done);
    }

    bool register_buffer(void* base, size_t len) override {
        if (sparse_) {
            fixed_ = update_slot(0, base, len);
            return fixed_;
        }
        if (fixed_) sys_register(fd_, IORING_UNREGISTER_BUFFERS, nullptr, 0);
        iovec iov{base, len};
        fixed_ = sys_register(fd_, IORING_REGISTER_BUFFERS, &iov, 1) == 0;
        return fixed_;
    }

  private:
    static constexpr unsigned kFixedSlots = 16;
    static constexpr size_t kMaxRefused = 64;
    static constexpr size_t kMaxFixedLen = size_t(1) << 30;  // the kernel's limit per fixed buffer

    struct FixedSlot {
        uint64_t id = 0;  // PinnedRegistry id, 0 = empty
        uintptr_t base = 0;
        size_t len = 0;
        uint64_t last_use = 0;
    };

    bool update_slot(unsigned slot, void* base, size_t len) {
        iovec iov{base, len};
        io_uring_rsrc_update2 up{};
        up.offset = slot;
        up.data = reinterpret_cast<uint64_t>(&iov);
        up.nr = 1;
        return sys_register(fd_, IORING_REGISTER_BUFFERS_UPDATE, &up, sizeof(up)) == 1;
    }

    // Fixed-buffer slot covering [addr, addr + len) of a live pinned buffer, registering (a window of at
    // most 1 GiB of) it on first use; -1 for other memory. Requests in flight keep their own reference to
    // a slot's old buffer, so replacing a slot is safe at any time.
    int staging_slot(uintptr_t addr, size_t len) {
        PinnedRegistry& reg = PinnedRegistry::instance();
        const uint64_t epoch = reg.epoch();
        if (epoch != epoch_seen_) {
            // Some buffer was released: drop registrations of dead ones so their pages are not held.
            for (unsigned i = 1; i < kFixedSlots; ++i) {
                if (slots_[i].id != 0 && !reg.alive(slots_[i].id)) {
                    update_slot(i, nullptr, 0);
                    slots_[i] = FixedSlot{};
                }
            }
            epoch_seen_ = epoch;
        }
        for (unsigned i = 1; i < kFixedSlots; ++i) {
            FixedSlot& f = slots_[i];
            if (f.id != 0 && addr >= f.base && addr + len <= f.base + f.len) {
                f.last_use = ++clock_;
                return static_cast<int>(i);
            }
        }
        PinnedRegion region;
        if (len > kMaxFixedLen || !reg.find(addr, len, &region)) return -1;
        for (uint64_t id : refused_)
            if (id == region.id) return -1;
        // Window: from the 2 MiB boundary below addr, at most 1 GiB, within the region.
        uintptr_t base = std::max(region.base, addr & ~((uintptr_t(2) << 20) - 1));
        size_t wlen = std::min(kMaxFixedLen, region.base + region.len - base);
        if (addr + len > base + wlen) {
            base = addr;
            wlen = std::min(kMaxFixedLen, region.base + region.len - base);
        }
        unsigned victim = 1;
        for (unsigned i = 1; i < kFixedSlots; ++i) {
            if (slots_[i].id == 0) {
                victim = i;
                break;
            }
            if (slots_[i].last_use < slots_[victim].last_use) victim = i;
        }
        if (!update_slot(victim, reinterpret_cast<void*>(base), wlen)) {
            // e.g. RLIMIT_MEMLOCK for an unprivileged user: use this buffer unregistered from now on.
            if (refused_.size() < kMaxRefused) refused_.push_back(region.id);  // capacity reserved
            return -1;
        }
        slots_[victim] = FixedSlot{region.id, base, wlen, ++clock_};
        return static_cast<int>(victim);
    }

    void map_rings() {
        const size_t sq_len = p_.sq_off.array + p_.sq_entries * sizeof(unsigned);
        const size_t cq_len = p_.cq_off.cqes + p_.cq_entries * sizeof(io_uring_cqe);
        if (p_.features & IORING_FEAT_SINGLE_MMAP) {
            sq_map_.map(fd_, sq_len > cq_len ? sq_len : cq_len, IORING_OFF_SQ_RING);
        } else {
            sq_map_.map(fd_, sq_len, IORING_OFF_SQ_RING);
            cq_map_.map(fd_, cq_len, IORING_OFF_CQ_RING);
        }
        sqe_map_.map(fd_, p_.sq_entries * sizeof(io_uring_sqe), IORING_OFF_SQES);
        char* sq = sq_map_.get();
        char* cq = (p_.features & IORING_FEAT_SINGLE_MMAP) ? sq : cq_map_.get();
        sq_head_ = reinterpret_cast<unsigned*>(sq + p_.sq_off.head);
        sq_tail_ = reinterpret_cast<unsigned*>(sq + p_.sq_off.tail);
        sq_mask_ = reinterpret_cast<unsigned*>(sq + p_.sq_off.ring_mask);
        sq_array_ = reinterpret_cast<unsigned*>(sq + p_.sq_off.array);
        cq_head_ = reinterpret_cast<unsigned*>(cq + p_.cq_off.head);
        cq_tail_ = reinterpret_cast<unsigned*>(cq + p_.cq_off.tail);
        cq_mask_ = reinterpret_cast<unsigned*>(cq + p_.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p_.cq_off.cqes);
        sqes_ = reinterpret_cast<io_uring_sqe*>(sqe_map_.get());
    }

    size_t harvest(std::vector<IoDone>& done) {
        unsigned head = *cq_head_;
        const unsigned tail = load_acquire(cq_tail_);
        size_t n = 0;
        while (head != tail) {
            const io_uring_cqe& c = cqes_[head & *cq_mask_];
            done.push_back({static_cast<uint32_t>(c.user_data), c.res});
            ++head;
            ++n;
        }
        store_release(cq_head_, head);
        inflight_ -= static_cast<unsigned>(n);
        return n;
    }

    size_t wait_for(size_t want, std::vector<IoDone>& done) {
        size_t got = harvest(done);
        while (got < want && inflight_ > 0) {
            const unsigned need = static_cast<unsigned>(want - got);
            const int r = sys_enter(fd_, 0, need > inflight_ ? inflight_ : need, IORING_ENTER_GETEVENTS);
            if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) break;
            got += harvest(done);
        }
        return got;
    }

    // Without SQPOLL the kernel reads the SQ only inside io_uring_enter, so entries it has not consumed
    // can be taken back and reported as failed.
    void refuse_unsubmitted(int err, std::vector<IoDone>& done, size_t& got) {
        const unsigned head = load_acquire(sq_head_);
        unsigned tail = *sq_tail_;
        for (unsigned i = head; i != tail; ++i) {
            const io_uring_sqe& sqe = sqes_[sq_array_[i & *sq_mask_]];
            done.push_back({static_cast<uint32_t>(sqe.user_data), -static_cast<int64_t>(err)});
            ++got;
        }
        store_release(sq_tail_, head);
        unsubmitted_ = 0;
    }

    bool single_submit_;
    bool fixed_ = false;   // the bounce arena is registered (slot 0)
    bool sparse_ = false;  // a sparse fixed-buffer table exists
    std::vector<FixedSlot> slots_;
    std::vector<uint64_t> refused_;
    uint64_t epoch_seen_ = 0;
    uint64_t clock_ = 0;
    int fd_ = -1;
    io_uring_params p_{};
    Mapping sq_map_, cq_map_, sqe_map_;
    unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_mask_ = nullptr, *sq_array_ = nullptr;
    unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr, *cq_mask_ = nullptr;
    io_uring_cqe* cqes_ = nullptr;
    io_uring_sqe* sqes_ = nullptr;
    unsigned unsubmitted_ = 0;
    unsigned inflight_ = 0;
};

}  // namespace

// A kernel may have io_uring but predate IORING_OP_READ/WRITE (5.6): ask its probe.
std::string probe_uring_support() {
    try {
        UringEngine ring(2, false);
        (void)ring;
    } catch (const BackendUnavailable& e) {
        return e.what();
    }
    io_uring_params p{};
    const int fd = sys_setup(2, &p);
    if (fd < 0) return "io_uring: io_uring_setup failed: " + errno_text(errno);
    // io_uring_probe ends in a flexible array: room for every opcode the kernel may describe.
    alignas(io_uring_probe) unsigned char raw[sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op)] = {};
    auto* probe = reinterpret_cast<io_uring_probe*>(raw);
    std::string why;
    if (sys_register(fd, IORING_REGISTER_PROBE, probe, 256) != 0) {
        why = "io_uring: kernel too old (IORING_REGISTER_PROBE failed: " + errno_text(errno) + ")";
    } else {
        for (unsigned op : {unsigned(IORING_OP_READ), unsigned(IORING_OP_WRITE),
                            unsigned(IORING_OP_READ_FIXED), unsigned(IORING_OP_WRITE_FIXED)}) {
            if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED))
                why = "io_uring: kernel too old (opcode " + std::to_string(op) + " unsupported)";
        }
    }
    close(fd);
    return why;
}

std::unique_ptr<Engine> make_uring_engine(unsigned depth, bool single_submit) {
    return std::make_unique<UringEngine>(depth, single_submit);
}

}  // namespace zo
