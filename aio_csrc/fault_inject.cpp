#include "fault_inject.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <system_error>

namespace zo {

namespace {

std::atomic<long> g_countdown{0};
std::mutex g_mu;  // guards g_site and the decrement once armed
std::string g_site;

}  // namespace

void inject_alloc_failure(long n, const std::string& site) {
    std::lock_guard<std::mutex> lk(g_mu);
    g_site = site;
    g_countdown.store(n > 0 ? n : 0, std::memory_order_release);
}

long alloc_failure_countdown() { return g_countdown.load(std::memory_order_acquire); }

void alloc_point(const char* site) {
    if (g_countdown.load(std::memory_order_relaxed) == 0) return;  // the production path
    bool fire = false;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        const long left = g_countdown.load(std::memory_order_relaxed);
        if (left == 0 || (g_site != "any" && g_site != site)) return;
        g_countdown.store(left - 1, std::memory_order_release);
        fire = left == 1;
    }
    if (!fire) return;
    if (std::strcmp(site, "thread") == 0)
        throw std::system_error(EAGAIN, std::generic_category(), "injected thread creation failure");
    throw std::bad_alloc();
}

}  // namespace zo
