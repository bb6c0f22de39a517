// Backend selection: which engines this kernel supports, and construction by name.
#include "engine.h"

#include <string>
#include <vector>

#include "aio_error.h"

namespace zo {

std::unique_ptr<Engine> make_engine(const std::string& name, unsigned depth, bool single_submit) {
    if (name == "io_uring") return make_uring_engine(depth, single_submit);
    if (name == "aio") return make_aio_engine(depth, single_submit);
    if (name == "psync") return make_psync_engine(depth);
    throw UsageError("unknown backend '" + name + "' (expected io_uring, aio or psync)");
}

std::string backend_unavailable_reason(const std::string& name) {
    if (name == "io_uring") {
        static const std::string why = probe_uring_support();
        return why;
    }
    if (name == "aio") {
        static const std::string why = [] {
            try {
                make_aio_engine(1, false);
                return std::string();
            } catch (const BackendUnavailable& e) {
                return std::string(e.what());
            }
        }();
        return why;
    }
    if (name == "psync") return "";
    return "unknown backend '" + name + "' (expected io_uring, aio or psync)";
}

const std::vector<std::string>& available_backends() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> v;
        for (const char* n : {"io_uring", "aio", "psync"})
            if (backend_unavailable_reason(n).empty()) v.emplace_back(n);
        return v;
    }();
    return names;
}

}  // namespace zo
