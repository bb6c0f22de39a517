// Exercises the I/O core directly (no Python), meant to run under ASan + UBSan:
//   g++ -std=c++17 -fsanitize=address,undefined -fno-omit-frame-pointer -g -O1 -I aio_csrc
//       aio_csrc/tests/aio_core_test.cpp $(ls aio_csrc/*.cpp | grep -v bindings) -pthread
//   ./a.out <scratch dir on a real disk>
// Exit status 0 and "ALL OK" on success; every failed check prints a line and makes the status 1.
#include <dirent.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "aio_error.h"
#include "check.h"
#include "engine.h"
#include "fault_inject.h"
#include "handle.h"
#include "pinned.h"

namespace {

std::string g_dir;
int g_fallback_notes = 0;

std::vector<char> read_all(const std::string& path) {
    std::vector<char> out;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return out;
    char buf[65536];
    for (;;) {
        const ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0) break;
        out.insert(out.end(), buf, buf + n);
    }
    close(fd);
    return out;
}

void write_all(const std::string& path, const std::vector<char>& data) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return;
    size_t done = 0;
    while (done < data.size()) {
        const ssize_t n = write(fd, data.data() + done, data.size() - done);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
    }
    close(fd);
}

int count_fds() {
    int n = 0;
    DIR* d = opendir("/proc/self/fd");
    if (d == nullptr) return -1;
    while (readdir(d) != nullptr) ++n;
    closedir(d);
    return n;
}

std::vector<char> random_bytes(std::mt19937_64& rng, size_t n) {
    std::vector<char> v(n);
    for (auto& c : v) c = static_cast<char>(rng());
    return v;
}

// Random unaligned writes over random old contents, then reads back, sync and async, through the handle.
void round_trips(const zo::HandleOptions& o, const char* label, int trials) {
    zo::Handle h(o);
    std::mt19937_64 rng(42);
    const std::string path = g_dir + "/rt_" + h.backend();
    zo::PinnedMemory src(1 << 20, 4096, false, false);
    zo::PinnedMemory dst(1 << 20, 4096, false, false);
    for (int t = 0; t < trials; ++t) {
        const size_t n = 1 + rng() % (300 * 1024);
        const size_t off = rng() % 3 == 0 ? (rng() % 64) * 4096 : rng() % 20000;
        const size_t shift = rng() % 3 == 0 ? 0 : rng() % 4096;  // buffer address misalignment
        const std::vector<char> old = random_bytes(rng, rng() % 2 ? rng() % 400000 : 0);
        write_all(path, old);
        const std::vector<char> data = random_bytes(rng, n);
        std::memcpy(src.data() + shift, data.data(), n);
        const bool async = rng() % 2;
        try {
            const int64_t r = h.submit_path(true, src.data() + shift, n, path, off, async, nullptr);
            if (async) {
                CHECK(r == 0, "async submit returned %lld", (long long)r);
                CHECK(h.wait() == 1, "wait count");
            } else {
                CHECK(r == static_cast<int64_t>(n), "sync write returned %lld", (long long)r);
            }
        } catch (const std::exception& e) {
            CHECK(false, "%s write threw: %s", label, e.what());
            continue;
        }
        std::vector<char> expect = old;
        if (expect.size() < off + n) expect.resize(off + n, 0);
        std::memcpy(expect.data() + off, data.data(), n);
        const std::vector<char> got = read_all(path);
        CHECK(got.size() == expect.size(), "%s trial %d: size %zu, expected %zu (old %zu, off %zu, n %zu)",
              label, t, got.size(), expect.size(), old.size(), off, n);
        CHECK(got == expect, "%s trial %d: file contents differ (off %zu n %zu shift %zu)", label, t, off, n,
              shift);
        std::memset(dst.data(), 0xAB, dst.size());
        try {
            const int64_t r = h.submit_path(false, dst.data() + shift, n, path, off, async, nullptr);
            if (async) h.wait();
            CHECK(async || r == static_cast<int64_t>(n), "sync read returned %lld", (long long)r);
        } catch (const std::exception& e) {
            CHECK(false, "%s read threw: %s", label, e.what());
            continue;
        }
        CHECK(std::memcmp(dst.data() + shift, data.data(), n) == 0, "%s trial %d: read back differs", label,
              t);
        CHECK(shift == 0 || static_cast<unsigned char>(dst.data()[shift - 1]) == 0xAB,
              "%s trial %d: read wrote before the buffer", label, t);
        CHECK(static_cast<unsigned char>(dst.data()[shift + n]) == 0xAB,
              "%s trial %d: read wrote past the buffer", label, t);
    }
    unlink(path.c_str());
}

template <typename Fn>
int expect_io_error(Fn&& fn, int want_errno, zo::Op want_op, const char* what) {
    try {
        fn();
        CHECK(false, "%s: no error raised", what);
    } catch (const zo::IoError& e) {
        CHECK(e.err() == want_errno, "%s: errno %d (%s), expected %d", what, e.err(), e.what(), want_errno);
        CHECK(e.op() == want_op, "%s: op %s", what, zo::op_name(e.op()));
        return e.err();
    } catch (const std::exception& e) {
        CHECK(false, "%s: wrong exception: %s", what, e.what());
    }
    return 0;
}

void errors(const std::string& backend) {
    zo::HandleOptions o;
    o.backend = backend;
    o.block_size = 64 * 1024;
    o.queue_depth = 4;
    zo::Handle h(o);
    zo::PinnedMemory buf(1 << 20, 4096, false, false);
    const std::string missing = g_dir + "/does/not/exist";
    expect_io_error([&] { h.submit_path(false, buf.data(), 10, missing, 0, true, nullptr); }, ENOENT,
                    zo::Op::kOpen, "missing file (async)");
    const std::string path = g_dir + "/err_" + backend;
    std::mt19937_64 rng(7);
    write_all(path, random_bytes(rng, 10000));
    expect_io_error([&] { h.submit_path(false, buf.data(), 100, path, 9950, false, nullptr); }, ENODATA,
                    zo::Op::kRead, "read past EOF");
    try {
        h.submit_path(false, buf.data(), 100, path, 9950, false, nullptr);
    } catch (const zo::IoError& e) {
        CHECK(std::string(e.what()).find("10000") != std::string::npos, "EOF message names the size: %s",
              e.what());
        CHECK(e.path() == path && e.offset() == 9950 && e.length() == 100, "EOF error fields");
    }
    // Truncated between submission and execution: ENODATA, not a hang; the handle keeps working.
    write_all(path, random_bytes(rng, 300000));
    h.set_paused(true);
    h.submit_path(false, buf.data(), 300000, path, 0, true, nullptr);
    CHECK(truncate(path.c_str(), 5000) == 0, "truncate");
    h.set_paused(false);
    expect_io_error([&] { h.wait(); }, ENODATA, zo::Op::kRead, "truncated after submission");
    CHECK(h.pending() == 0, "nothing pending after a failure");
    CHECK(h.submit_path(false, buf.data(), 4000, path, 1000, false, nullptr) == 4000,
          "handle works after failure");
    // An fd open write-only cannot be read.
    const int wfd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
    expect_io_error([&] { h.submit_fd(false, buf.data(), 10, wfd, 0, false); }, EBADF, zo::Op::kRead,
                    "read from a write-only fd");
    // ...but unaligned writes to it still work (read-modify-write reopens it for reading).
    std::memset(buf.data(), 'x', 101);
    CHECK(h.submit_fd(true, buf.data() + 1, 100, wfd, 33, false) == 100,
          "unaligned write to a write-only fd");
    close(wfd);
    const std::vector<char> got = read_all(path);
    CHECK(got.size() == 5000 && std::string(got.data() + 33, 100) == std::string(100, 'x'),
          "write through a write-only fd");
    // An fd the caller opened is never closed by the handle.
    const int rfd = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    CHECK(h.submit_fd(false, buf.data() + 3, 777, rfd, 11, false) == 777, "O_DIRECT fd, unaligned read");
    CHECK(fcntl(rfd, F_GETFD) >= 0, "caller fd still open");
    close(rfd);
    // direct='on' on tmpfs refuses, 'auto' falls back and says so once.
    if (access("/dev/shm", W_OK) == 0) {
        const std::string shm = "/dev/shm/zo_aio_core_test_" + std::to_string(getpid());
        zo::HandleOptions on = o;
        on.direct = zo::DirectMode::kOn;
        zo::Handle hon(on);
        expect_io_error([&] { hon.submit_path(true, buf.data(), 100, shm, 0, false, nullptr); }, EINVAL,
                        zo::Op::kOpen, "direct=on on tmpfs");
        zo::CallNotes n1, n2;
        CHECK(h.submit_path(true, buf.data() + 1, 100, shm, 5, false, &n1) == 100, "tmpfs write");
        CHECK(h.submit_path(false, buf.data() + 200, 100, shm, 5, false, &n2) == 100, "tmpfs read");
        g_fallback_notes += int(n1.direct_fallback) + int(n2.direct_fallback);  // once per process
        CHECK(std::memcmp(buf.data() + 1, buf.data() + 200, 100) == 0, "tmpfs round trip");
        unlink(shm.c_str());
    }
    unlink(path.c_str());
}

template <typename Fn>
void expect_usage_error(Fn&& fn, const char* what) {
    try {
        fn();
        CHECK(false, "%s: no error raised", what);
    } catch (const zo::UsageError&) {
    } catch (const std::exception& e) {
        CHECK(false, "%s: wrong exception: %s", what, e.what());
    }
}

// A registered path is opened once: requests naming it use that descriptor, even after the path was
// renamed over or replaced by a symlink. Unregistering goes back to opening the path per request.
void registered_files(const std::string& backend) {
    zo::HandleOptions o;
    o.backend = backend;
    o.block_size = 16 * 1024;
    const int fds_before = count_fds();
    std::mt19937_64 rng(21);
    const size_t n = 50000;
    const std::vector<char> first = random_bytes(rng, n);
    const std::vector<char> other = random_bytes(rng, n);
    const std::string path = g_dir + "/reg_" + backend;
    const std::string intruder = g_dir + "/reg_intruder_" + backend;
    const std::string target = g_dir + "/reg_target_" + backend;
    write_all(path, first);
    zo::PinnedMemory buf(2 * n + 4096, 4096, false, false);
    {
        zo::Handle h(o);
        // Registered under a spelling with "//" and "/./": requests by the plain path still match it.
        h.register_file(g_dir + "//./reg_" + backend, true, nullptr);
        expect_usage_error([&] { h.register_file(path, true, nullptr); }, "registering twice");
        // Another file renamed over the path: reads and writes still reach the registered file.
        write_all(intruder, other);
        CHECK(rename(intruder.c_str(), path.c_str()) == 0, "rename: %s", std::strerror(errno));
        CHECK(h.submit_path(false, buf.data() + 1, n, path, 0, false, nullptr) == static_cast<int64_t>(n),
              "read");
        CHECK(std::memcmp(buf.data() + 1, first.data(), n) == 0, "%s: read came from the new file",
              backend.c_str());
        std::memset(buf.data(), 'z', 1000);
        h.submit_path(true, buf.data(), 1000, path, 7, true, nullptr);
        CHECK(h.wait() == 1, "wait");
        CHECK(read_all(path) == other, "%s: a write by path went to the file renamed over it",
              backend.c_str());
        // The path replaced by a symlink to a third file: still the registered file.
        write_all(target, other);
        CHECK(unlink(path.c_str()) == 0 && symlink(target.c_str(), path.c_str()) == 0, "symlink");
        std::memset(buf.data() + n, 0, n);
        CHECK(h.submit_path(false, buf.data() + n, n, path, 0, false, nullptr) == static_cast<int64_t>(n),
              "read after symlink");
        std::vector<char> expect = first;
        std::memset(expect.data() + 7, 'z', 1000);
        CHECK(std::memcmp(buf.data() + n, expect.data(), n) == 0, "%s: read followed the symlink",
              backend.c_str());
        h.submit_path(true, buf.data() + 3, 5000, path, 20000, false, nullptr);
        CHECK(read_all(target) == other, "%s: a write followed the symlink", backend.c_str());
        // Unregistered while a request is queued: the request completes on the registered descriptor.
        h.set_paused(true);
        h.submit_path(false, buf.data() + n, 100, path, 0, true, nullptr);
        h.unregister_file(path);
        h.set_paused(false);
        CHECK(h.wait() == 1, "wait after unregister");
        CHECK(std::memcmp(buf.data() + n, expect.data(), 100) == 0, "queued read after unregister");
        expect_usage_error([&] { h.unregister_file(path); }, "unregistering twice");
        // Unregistered: the path is opened per request again, and the symlink now there is refused.
        expect_io_error([&] { h.submit_path(false, buf.data(), 100, path, 0, false, nullptr); }, ELOOP,
                        zo::Op::kOpen, "a request by a path that is a symlink");
        // Read-only registration refuses writes; a missing file cannot be registered for reading.
        h.register_file(target, false, nullptr);
        expect_io_error([&] { h.submit_path(true, buf.data(), 10, target, 0, false, nullptr); }, EBADF,
                        zo::Op::kWrite, "write to a read-only registration");
        expect_io_error([&] { h.register_file(g_dir + "/reg_missing", false, nullptr); }, ENOENT,
                        zo::Op::kOpen, "registering a missing file for reading");
        // close() closes what is still registered; later registrations are refused.
        h.close();
        expect_usage_error([&] { h.register_file(target, false, nullptr); }, "register after close");
    }
    CHECK(count_fds() == fds_before, "%s: fds %d -> %d", backend.c_str(), fds_before, count_fds());
    unlink(path.c_str());
    unlink(target.c_str());
}

// Files named relative to a directory fd: the directory renamed away and a directory of symlinks put in
// its place changes nothing (requests and registrations reach the held directory's files); names that are
// not plain, or carry a NUL, are refused before anything is opened.
void files_at(const std::string& backend) {
    zo::HandleOptions o;
    o.backend = backend;
    o.block_size = 16 * 1024;
    const int fds_before = count_fds();
    std::mt19937_64 rng(33);
    const size_t n = 40000;
    const std::vector<char> data = random_bytes(rng, n);
    const std::vector<char> victim_bytes = random_bytes(rng, n);
    const std::string dir = g_dir + "/at_" + backend;
    const std::string moved = dir + "_moved";
    const std::string victim = g_dir + "/at_victim_" + backend;
    CHECK(mkdir(dir.c_str(), 0700) == 0, "mkdir: %s", std::strerror(errno));
    write_all(victim, victim_bytes);
    const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(dfd >= 0, "open dir: %s", std::strerror(errno));
    zo::PinnedMemory buf(2 * n + 4096, 4096, false, false);
    {
        zo::Handle h(o);
        const zo::FileRef a{dfd, "a", dir + "/a"};
        const zo::FileRef b{dfd, "b", dir + "/b"};
        std::memcpy(buf.data() + 1, data.data(), n);
        CHECK(h.submit_at(true, buf.data() + 1, n, a, 3, false, nullptr) == static_cast<int64_t>(n),
              "write a");
        h.register_at(b, true, nullptr);
        CHECK(h.submit_at(true, buf.data() + 1, n, b, 0, false, nullptr) == static_cast<int64_t>(n),
              "write b");
        // The attacker's move: the directory renamed away, one of symlinks to the victim in its place.
        CHECK(rename(dir.c_str(), moved.c_str()) == 0, "rename: %s", std::strerror(errno));
        CHECK(mkdir(dir.c_str(), 0700) == 0, "mkdir again: %s", std::strerror(errno));
        CHECK(symlink(victim.c_str(), (dir + "/a").c_str()) == 0 &&
                  symlink(victim.c_str(), (dir + "/b").c_str()) == 0,
              "symlinks: %s", std::strerror(errno));
        std::memset(buf.data(), 'q', 2 * n);
        CHECK(h.submit_at(true, buf.data() + 5, 1000, a, 11, false, nullptr) == 1000, "unaligned write a");
        h.submit_at(true, buf.data() + 5, 1000, b, 11, true, nullptr);
        CHECK(h.wait() == 1, "wait");
        CHECK(read_all(victim) == victim_bytes, "%s: a write reached the victim through a swapped directory",
              backend.c_str());
        std::vector<char> expect(3, 0);
        expect.insert(expect.end(), data.begin(), data.end());
        std::memset(expect.data() + 11, 'q', 1000);
        CHECK(read_all(moved + "/a") == expect, "%s: file a in the held directory", backend.c_str());
        std::vector<char> expect_b = data;
        std::memset(expect_b.data() + 11, 'q', 1000);
        CHECK(read_all(moved + "/b") == expect_b, "%s: file b in the held directory", backend.c_str());
        CHECK(h.submit_at(false, buf.data() + 1, n, b, 0, false, nullptr) == static_cast<int64_t>(n),
              "read b");
        CHECK(std::memcmp(buf.data() + 1, expect_b.data(), n) == 0, "%s: read b", backend.c_str());
        h.unregister_at(b);
        // A symlink inside the held directory itself is refused, never followed.
        CHECK(symlinkat(victim.c_str(), dfd, "link") == 0, "symlinkat: %s", std::strerror(errno));
        expect_io_error(
            [&] { h.submit_at(true, buf.data(), 10, zo::FileRef{dfd, "link", "link"}, 0, false, nullptr); },
            ELOOP, zo::Op::kOpen, "a write through a symlink in the directory");
        expect_io_error([&] { h.register_at(zo::FileRef{dfd, "link", "link"}, true, nullptr); }, ELOOP,
                        zo::Op::kOpen, "registering a symlink");
        CHECK(read_all(victim) == victim_bytes, "%s: the victim changed", backend.c_str());
        expect_usage_error(
            [&] { h.submit_at(false, buf.data(), 10, zo::FileRef{dfd, "x/y", ""}, 0, false, nullptr); },
            "a name with a slash");
        expect_usage_error(
            [&] { h.submit_at(false, buf.data(), 10, zo::FileRef{dfd, "..", ""}, 0, false, nullptr); },
            "a name of ..");
        expect_usage_error(
            [&] { h.submit_path(false, buf.data(), 10, std::string("a\0b", 3), 0, false, nullptr); },
            "a path with a NUL");
        expect_usage_error([&] { h.register_at(zo::FileRef{dfd, std::string("a\0", 2), ""}, true, nullptr); },
                           "a name with a NUL");
        h.close();
    }
    CHECK(close(dfd) == 0, "close dir");
    CHECK(count_fds() == fds_before, "%s: fds %d -> %d", backend.c_str(), fds_before, count_fds());
    for (const char* f : {"/a", "/b", "/link"}) unlink((moved + f).c_str());
    for (const char* f : {"/a", "/b"}) unlink((dir + f).c_str());
    rmdir(moved.c_str());
    rmdir(dir.c_str());
    unlink(victim.c_str());
}

// Many small async requests in flight at once, spread over threads and two handles. Records are not
// block-aligned, so neighbours share partial blocks (read-modify-write) and padded tails: all must land.
// Expects `fn` to throw an IoError with errno `err`.
template <typename Fn>
void expect_io_error(const char* what, int err, Fn&& fn) {
    try {
        fn();
        CHECK(false, "%s: no error", what);
    } catch (const zo::IoError& e) {
        CHECK(e.err() == err, "%s: errno %d (%s), expected %d", what, e.err(), e.what(), err);
    } catch (const std::exception& e) {
        CHECK(false, "%s: threw %s instead of IoError", what, e.what());
    }
}

// Injected allocation failures inside worker threads become the request's ENOMEM (no std::terminate), and
// the handle round-trips data bit-exactly afterwards, without leaking fds, locks or memory.
void alloc_faults(const std::string& backend) {
    zo::HandleOptions o;
    o.backend = backend;
    o.block_size = 64 * 1024;
    o.queue_depth = 4;
    o.intra_op_parallelism = 2;
    const std::string path = g_dir + "/oom_" + backend;
    std::mt19937_64 rng(11);
    const size_t n = 16 * o.block_size;
    const std::vector<char> data = random_bytes(rng, n);
    zo::PinnedMemory buf(n + 4096, 4096, false, false);
    auto round_trip = [&](zo::Handle& h, const char* label) {
        const std::vector<char> fresh = random_bytes(rng, n);
        std::memcpy(buf.data() + 1, fresh.data(), n);  // unaligned: through the bounce buffers
        try {
            h.submit_path(true, buf.data() + 1, n, path, 3, false, nullptr);
            std::memset(buf.data(), 0, buf.size());
            h.submit_path(false, buf.data(), n, path, 3, true, nullptr);
            CHECK(h.wait() == 1, "%s: wait count", label);
        } catch (const std::exception& e) {
            CHECK(false, "%s: round trip after the failure threw: %s", label, e.what());
            return;
        }
        CHECK(std::memcmp(buf.data(), fresh.data(), n) == 0, "%s: round trip differs", label);
    };
    {
        zo::Handle h(o);
        std::memcpy(buf.data(), data.data(), n);
        h.submit_path(true, buf.data(), n, path, 0, false, nullptr);
        zo::inject_alloc_failure(3, "submit");
        expect_io_error("submit (async)", ENOMEM, [&] {
            h.submit_path(false, buf.data(), n, path, 0, true, nullptr);
            h.wait();
        });
        CHECK(zo::alloc_failure_countdown() == 0, "submit failure did not fire");
        CHECK(h.pending() == 0, "pending after failure");
        round_trip(h, "after submit failure");
    }
    {
        zo::Handle h(o);
        zo::inject_alloc_failure(1, "bounce");
        expect_io_error("bounce (sync)", ENOMEM,
                        [&] { h.submit_path(true, buf.data() + 1, 5000, path, 7, false, nullptr); });
        round_trip(h, "after bounce failure");
        zo::inject_alloc_failure(1, "block_lock");
        expect_io_error("block lock (sync)", ENOMEM,
                        [&] { h.submit_path(true, buf.data() + 1, 5000, path, 7, false, nullptr); });
        round_trip(h, "after block lock failure");
    }
    zo::inject_alloc_failure(2, "engine_setup");
    try {
        zo::Handle h(o);
        CHECK(false, "engine setup failure: no exception");
    } catch (const std::bad_alloc&) {
    }
    zo::inject_alloc_failure(2, "thread");
    expect_io_error("thread creation", EAGAIN, [&] { zo::Handle h(o); });
    zo::inject_alloc_failure(0, "any");
    zo::Handle h(o);
    round_trip(h, "after setup failures");
}

void many_async(const std::string& backend) {
    zo::HandleOptions o;
    o.backend = backend;
    o.block_size = 8192;
    o.queue_depth = 8;
    o.intra_op_parallelism = 3;
    zo::Handle h(o);
    o.intra_op_parallelism = 1;
    zo::Handle h2(o);
    const std::string path = g_dir + "/many_" + backend;
    std::mt19937_64 rng(3);
    const size_t rec = 1000;
    const int count = 300;
    std::vector<char> data = random_bytes(rng, rec * count);
    for (int round = 0; round < 3; ++round) {
        unlink(path.c_str());
        for (int i = 0; i < count; ++i)
            (i % 2 ? h2 : h).submit_path(true, data.data() + i * rec, rec, path, i * rec, true, nullptr);
        CHECK(h.wait() == static_cast<size_t>((count + 1) / 2), "wait count");
        CHECK(h2.wait() == static_cast<size_t>(count / 2), "wait count (second handle)");
        const std::vector<char> got = read_all(path);
        size_t first = 0;
        while (first < std::min(got.size(), data.size()) && got[first] == data[first]) ++first;
        CHECK(got == data, "many async writes %s: size %zu vs %zu, first difference at %zu", backend.c_str(),
              got.size(), data.size(), first);
    }
    std::vector<char> back(data.size(), 0);
    for (int i = 0; i < count; ++i)
        h.submit_path(false, back.data() + i * rec, rec, path, i * rec, true, nullptr);
    CHECK(h.pending() <= static_cast<size_t>(count), "pending");
    CHECK(h.wait() == static_cast<size_t>(count), "wait count (reads)");
    CHECK(back == data, "many async reads %s", backend.c_str());
    unlink(path.c_str());
}

// Pinned buffers are registered with io_uring rings on first use. A buffer released and a new one mapped
// at the same address must never be served by the stale registration.
void staging_reuse(const std::string& backend) {
    zo::HandleOptions o;
    o.backend = backend;
    o.block_size = 256 * 1024;
    zo::Handle h(o);
    const std::string path = g_dir + "/reuse_" + backend;
    std::mt19937_64 rng(11);
    const size_t n = 3 * 1024 * 1024 + 4096;
    const std::vector<char> data = random_bytes(rng, n);
    write_all(path, data);
    for (int round = 0; round < 4; ++round) {
        zo::PinnedMemory buf(n, size_t(2) << 20, true, false);
        std::memset(buf.data(), 0, n);
        CHECK(h.submit_path(false, buf.data(), n, path, 0, false, nullptr) == static_cast<int64_t>(n),
              "read");
        CHECK(std::memcmp(buf.data(), data.data(), n) == 0, "%s round %d: read into a reused address",
              backend.c_str(), round);
        buf.data()[round] ^= 1;
        CHECK(h.submit_path(true, buf.data(), n, path, 0, false, nullptr) == static_cast<int64_t>(n),
              "write");
        const std::vector<char> got = read_all(path);
        CHECK(got.size() == n && std::memcmp(got.data(), buf.data(), n) == 0,
              "%s round %d: write from reused address", backend.c_str(), round);
        buf.data()[round] ^= 1;
        h.submit_path(true, buf.data(), n, path, 0, false, nullptr);
    }
    unlink(path.c_str());
}

void pinned() {
    zo::PinnedMemory m(12345, size_t(2) << 20, true, true);
    CHECK(reinterpret_cast<uintptr_t>(m.data()) % (size_t(2) << 20) == 0, "2 MiB aligned");
    CHECK(m.size() == 12345, "exact size");
    std::memset(m.data(), 1, m.size());
    CHECK(m.locked() || m.lock_errno() != 0, "lock state reported");
    m.release();
    CHECK(m.released(), "released");
    bool threw = false;
    try {
        zo::PinnedMemory bad(10, 3000, false, false);
    } catch (const zo::UsageError&) {
        threw = true;
    }
    CHECK(threw, "non power of two alignment refused");
}

// In a child with a seccomp filter that makes io_uring_setup fail with EPERM (as kernel.io_uring_disabled
// does) and io_setup with ENOSYS: auto must fall back to psync, named backends must refuse clearly.
int seccomp_child() {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        std::fprintf(stderr, "seccomp unavailable: %s\n", std::strerror(errno));
        return 77;
    }
    const auto& av = zo::available_backends();
    CHECK(av.size() == 1 && av[0] == "psync", "only psync available under the filter (%zu)", av.size());
    zo::HandleOptions o;
    zo::Handle h(o);
    CHECK(h.backend() == "psync", "auto fell back to %s", h.backend().c_str());
    for (const char* name : {"io_uring", "aio"}) {
        o.backend = name;
        try {
            zo::Handle forced(o);
            CHECK(false, "forcing %s did not throw", name);
        } catch (const zo::BackendUnavailable& e) {
            const std::string msg = e.what();
            const bool has_errno =
                msg.find(std::string(name) == "io_uring" ? "Errno 1]" : "Errno 38]") != std::string::npos;
            CHECK(has_errno, "message names the errno: %s", msg.c_str());
        }
    }
    return g_failures == 0 ? 0 : 1;
}

void seccomp_fallback() {
#if defined(__x86_64__)
    const pid_t pid = fork();
    if (pid == 0) _exit(seccomp_child());
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
        std::printf("seccomp fallback test skipped\n");
        return;
    }
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "seccomp child failed (status %d)", status);
#endif
}

}  // namespace

int main(int argc, char** argv) {
    g_dir = argc > 1 ? argv[1] : ".";
    seccomp_fallback();  // first: fork before any thread exists
    const int fds_before = count_fds();
    pinned();
    for (const std::string& backend : zo::available_backends()) {
        std::printf("backend %s\n", backend.c_str());
        std::fflush(stdout);
        zo::HandleOptions o;
        o.backend = backend;
        o.block_size = 64 * 1024;
        o.queue_depth = 4;
        o.intra_op_parallelism = 2;
        round_trips(o, ("default " + backend).c_str(), 40);
        o.overlap_events = false;
        o.single_submit = true;
        o.block_size = 5000;  // not a multiple of the alignment: rounded up internally
        o.intra_op_parallelism = 1;
        round_trips(o, ("batch+single " + backend).c_str(), 15);
        o = zo::HandleOptions();
        o.backend = backend;
        o.direct = zo::DirectMode::kOff;
        round_trips(o, ("buffered " + backend).c_str(), 10);
        errors(backend);
        many_async(backend);
        alloc_faults(backend);
        staging_reuse(backend);
        registered_files(backend);
        files_at(backend);
    }
    if (access("/dev/shm", W_OK) == 0)
        CHECK(g_fallback_notes == 1, "O_DIRECT fallback reported %d times, expected once", g_fallback_notes);
    const int fds_after = count_fds();
    CHECK(fds_before == fds_after, "fd count %d -> %d", fds_before, fds_after);
    if (g_failures != 0) {
        std::printf("%d FAILED\n", g_failures.load());
        return 1;
    }
    std::printf("ALL OK\n");
    return 0;
}
