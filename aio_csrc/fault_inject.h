// Test-only fault injection, compiled in and off by default: "fail the Nth internal allocation".
//
// The I/O core calls alloc_point() just before each allocation it makes on a path that must survive
// running out of memory (worker engine setup, bounce buffers, block-lock bookkeeping, per-piece submission,
// worker thread creation). When armed with inject_alloc_failure(n, site), the nth matching call throws
// std::bad_alloc (std::system_error(EAGAIN) at the "thread" site, as std::thread does when the kernel
// refuses a thread) and the hook disarms itself. Unarmed, a call is one relaxed atomic load.
#pragma once

#include <string>

namespace zo {

// Arms the hook: the nth call of alloc_point() whose site matches `site` ("any" matches all) fails.
// n == 0 disarms. Process-wide; meant for one test at a time.
void inject_alloc_failure(long n, const std::string& site);
// Matching calls still to go before the injected failure; 0 once it fired or when disarmed.
long alloc_failure_countdown();
// Throws if the armed countdown reaches zero at this call. `site` is a string literal.
void alloc_point(const char* site);

}  // namespace zo
