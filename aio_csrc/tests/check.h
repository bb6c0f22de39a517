// CHECK(cond, fmt, ...) for the core's C++ test programs: a failed check prints where and why and counts in
// g_failures (atomic: checks run on several threads); the program's exit status reports the count.
#pragma once

#include <atomic>
#include <cstdio>

inline std::atomic<int> g_failures{0};

#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        if (!(cond)) {                                                           \
            ++g_failures;                                                        \
            std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                                   \
            std::fprintf(stderr, "\n");                                          \
        }                                                                        \
    } while (0)
