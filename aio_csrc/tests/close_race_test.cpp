// close() racing submissions and wait(), driven directly on the I/O core (no Python), meant to run under
// ThreadSanitizer and under ASan + UBSan:
//   g++ -std=c++17 -fsanitize=thread -g -O1 -I aio_csrc aio_csrc/tests/close_race_test.cpp
//       $(ls aio_csrc/*.cpp | grep -v bindings) -pthread
//   ./a.out <scratch dir> [rounds]
// First, per backend, a submission held inside open() (a FIFO without a reader) while close() runs:
// close() must wait for it, and the submission must complete normally. Then the rounds: one thread submits
// async (and now and then sync) writes and reads in a loop while another closes the handle; the submitter
// must end with the UsageError of a closed handle, never a crash or a hang. Every fourth round, a write
// fails (injected allocation failure) and wait() races close(): exactly one of them must report the
// failure. Exit status 0 and "ALL OK" on success.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "aio_error.h"
#include "check.h"
#include "engine.h"
#include "fault_inject.h"
#include "handle.h"
#include "pinned.h"

namespace {

constexpr size_t kRec = 8192;  // bytes per request
constexpr size_t kSlots = 16;  // distinct file offsets in use
const char* const kClosed = "the aio Handle is closed";

bool is_closed_error(const zo::UsageError& e) { return std::strcmp(e.what(), kClosed) == 0; }

// Submits until the handle refuses with the closed-handle UsageError; returns how many it queued.
long submit_until_closed(zo::Handle& h, char* buf, const std::string& wpath, const std::string& rpath,
                         std::atomic<long>& submitted, unsigned seed) {
    std::mt19937 rng(seed);
    for (long i = 0;; ++i) {
        // At most kSlots requests between two wait()s, each on its own slot: no two requests in flight
        // touch the same bytes of memory or file (that would be the caller's race, not the handle's).
        const size_t slot = static_cast<size_t>(i) % kSlots;
        const bool write = rng() % 2 == 0;
        const bool async = rng() % 8 != 0;
        try {
            if (write) {
                h.submit_path(true, buf + slot * kRec, kRec, wpath, slot * kRec, async, nullptr);
            } else {
                h.submit_path(false, buf + (kSlots + slot) * kRec, kRec, rpath, slot * kRec, async, nullptr);
            }
            submitted.fetch_add(1, std::memory_order_release);
            if (slot == kSlots - 1 || rng() % 16 == 0) h.wait();
        } catch (const zo::UsageError& e) {
            CHECK(is_closed_error(e), "submitter got UsageError '%s'", e.what());
            return i;
        } catch (const std::exception& e) {
            CHECK(false, "submitter got unexpected exception: %s", e.what());
            return i;
        }
    }
}

void close_race_round(const zo::HandleOptions& o, const std::string& dir, char* buf, unsigned round) {
    zo::Handle h(o);
    const std::string wpath = dir + "/race_w";
    const std::string rpath = dir + "/race_r";
    std::atomic<long> submitted{0};
    std::mt19937 rng(round);
    const long close_after = static_cast<long>(rng() % 6);  // 0: close races the very first submission
    std::thread submitter([&] { submit_until_closed(h, buf, wpath, rpath, submitted, round * 7919u + 1); });
    std::thread closer([&] {
        while (submitted.load(std::memory_order_acquire) < close_after) std::this_thread::yield();
        try {
            h.close();
        } catch (const std::exception& e) {
            CHECK(false, "close threw: %s", e.what());
        }
    });
    submitter.join();
    closer.join();
    // Once closed: every submission and wait() has a clear answer.
    try {
        h.submit_path(true, buf, kRec, wpath, 0, true, nullptr);
        CHECK(false, "%s", "submit after close did not throw");
    } catch (const zo::UsageError& e) {
        CHECK(is_closed_error(e), "submit after close: '%s'", e.what());
    }
    try {
        h.submit_path(false, buf, kRec, rpath, 0, false, nullptr);
        CHECK(false, "%s", "sync submit after close did not throw");
    } catch (const zo::UsageError& e) {
        CHECK(is_closed_error(e), "sync submit after close: '%s'", e.what());
    }
    CHECK(h.pending() == 0, "pending %zu after close", h.pending());
}

// One failed async write; then wait() and close() from two threads at once. Exactly one reports it.
void fault_round(const zo::HandleOptions& o, const std::string& dir, char* buf, unsigned round) {
    zo::Handle h(o);
    const std::string wpath = dir + "/fault_w";
    zo::inject_alloc_failure(1, "submit");
    h.submit_path(true, buf, kRec, wpath, 0, true, nullptr);
    std::atomic<int> reported{0};
    std::atomic<int> go{0};
    auto report = [&](const char* who, auto&& fn) {
        go.fetch_add(1);
        while (go.load() < 2) std::this_thread::yield();
        try {
            fn();
        } catch (const zo::IoError& e) {
            CHECK(e.err() == ENOMEM && e.op() == zo::Op::kWrite, "%s: errno %d op %s", who, e.err(),
                  zo::op_name(e.op()));
            reported.fetch_add(1);
        } catch (const std::exception& e) {
            CHECK(false, "%s threw %s", who, e.what());
        }
    };
    std::thread waiter([&] { report("wait", [&] { h.wait(); }); });
    std::thread closer([&] { report("close", [&] { h.close(); }); });
    waiter.join();
    closer.join();
    CHECK(zo::alloc_failure_countdown() == 0, "round %u: the injected failure did not fire", round);
    zo::inject_alloc_failure(0, "any");
    CHECK(reported.load() == 1, "round %u: the failed write was reported %d times", round, reported.load());
    try {
        CHECK(h.wait() == 0, "%s", "wait after close");
    } catch (const std::exception& e) {
        CHECK(false, "wait after close threw: %s", e.what());
    }
}

// Whether thread `tid` of this process is blocked in openat(2).
bool in_openat(pid_t tid) {
    std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/syscall");
    long nr = -1;
    return static_cast<bool>(f >> nr) && nr == SYS_openat;
}

// A synchronous write whose open() blocks (a FIFO with no reader yet) while another thread closes the
// handle: close() waits for it instead of taking the workers away under it.
void submission_inside_open(const std::string& backend, const std::string& dir, char* buf) {
    const std::string fifo = dir + "/fifo_" + backend;
    unlink(fifo.c_str());
    if (mkfifo(fifo.c_str(), 0600) != 0) {
        CHECK(false, "mkfifo %s: %s", fifo.c_str(), std::strerror(errno));
        return;
    }
    zo::HandleOptions o;
    o.backend = backend;
    zo::Handle h(o);
    std::atomic<pid_t> tid{0};
    std::atomic<int> outcome{0};  // 1 completed, 2 IoError, 3 closed-handle UsageError, 4 other
    std::thread submitter([&] {
        tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
        try {
            h.submit_path(true, buf, kRec, fifo, 0, false, nullptr);
            outcome.store(1);
        } catch (const zo::IoError&) {
            outcome.store(2);  // a FIFO cannot be written at an offset on every backend: fine
        } catch (const zo::UsageError& e) {
            outcome.store(is_closed_error(e) ? 3 : 4);
        } catch (const std::exception&) {
            outcome.store(4);
        }
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((tid.load() == 0 || !in_openat(tid.load())) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(tid.load() != 0 && in_openat(tid.load()), "%s: the submitter never blocked in open()",
          backend.c_str());
    std::atomic<bool> closed{false};
    std::thread closer([&] {
        try {
            h.close();
        } catch (const std::exception& e) {
            CHECK(false, "%s: close threw %s", backend.c_str(), e.what());
        }
        closed.store(true);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(!closed.load(), "%s: close() returned while a submission was still opening its file",
          backend.c_str());
    const int rfd = open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // lets the open() finish
    CHECK(rfd >= 0, "opening the FIFO for reading: %s", std::strerror(errno));
    submitter.join();
    closer.join();
    if (rfd >= 0) close(rfd);
    CHECK(outcome.load() == 1 || outcome.load() == 2, "%s: the submission ended with outcome %d",
          backend.c_str(), outcome.load());
    unlink(fifo.c_str());
}

bool write_file(const std::string& path, size_t n) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    std::vector<char> data(n, 'r');
    size_t done = 0;
    while (done < n) {
        const ssize_t w = write(fd, data.data() + done, n - done);
        if (w <= 0) break;
        done += static_cast<size_t>(w);
    }
    return close(fd) == 0 && done == n;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string dir = argc > 1 ? argv[1] : ".";
    const unsigned rounds = argc > 2 ? static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10)) : 3000;
    if (!write_file(dir + "/race_r", kSlots * kRec)) {
        std::fprintf(stderr, "cannot create %s/race_r: %s\n", dir.c_str(), std::strerror(errno));
        return 2;
    }
    const std::vector<std::string> backends = zo::available_backends();
    zo::PinnedMemory buf(2 * kSlots * kRec, 4096, false, false);
    std::memset(buf.data(), 'w', buf.size());
    for (const std::string& b : backends) submission_inside_open(b, dir, buf.data());
    // Closing a Linux AIO context waits for an RCU grace period (tens of ms): one round in 16 uses it.
    std::vector<std::string> fast;
    bool aio = false;
    for (const std::string& b : backends) {
        if (b == "aio") {
            aio = true;
        } else {
            fast.push_back(b);
        }
    }
    const auto t0 = std::chrono::steady_clock::now();
    unsigned faults = 0;
    for (unsigned r = 0; r < rounds; ++r) {
        zo::HandleOptions o;
        const bool slow = aio && (r % 32 == 5 || r % 32 == 11);
        o.backend = slow ? "aio" : fast[r % fast.size()];
        o.block_size = 4096;
        o.queue_depth = 4;
        o.intra_op_parallelism = slow ? 1 : 1 + r % 3;
        if (r % 4 == 3) {
            fault_round(o, dir, buf.data(), r);
            ++faults;
        } else {
            close_race_round(o, dir, buf.data(), r);
        }
        if (g_failures.load() > 20) break;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%u rounds (%u with a failed write) on %zu backends in %.2f s\n", rounds, faults,
                backends.size(), secs);
    unlink((dir + "/race_r").c_str());
    unlink((dir + "/race_w").c_str());
    unlink((dir + "/fault_w").c_str());
    if (g_failures.load() != 0) {
        std::printf("%d FAILED\n", g_failures.load());
        return 1;
    }
    std::printf("ALL OK\n");
    return 0;
}
