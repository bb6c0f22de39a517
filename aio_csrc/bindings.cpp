// pybind11 face of the I/O core: argument conversion, GIL release, exceptions and warnings. Nothing else.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "aio_error.h"
#include "engine.h"
#include "fault_inject.h"
#include "handle.h"
#include "pinned.h"

namespace py = pybind11;

namespace {

PyObject* g_aio_error = nullptr;
PyObject* g_backend_error = nullptr;
PyObject* g_fallback_warning = nullptr;

void raise_aio_error(const zo::IoError& e) {
    // OSError(errno, strerror, filename) fills .errno/.strerror/.filename; the rest are extra attributes.
    py::object filename = e.path().empty() ? py::none() : py::object(py::str(e.path()));
    py::object exc = py::reinterpret_borrow<py::object>(g_aio_error)(e.err(), e.reason(), filename);
    exc.attr("offset") = e.offset();
    exc.attr("length") = e.length();
    exc.attr("op") = zo::op_name(e.op());
    PyErr_SetObject(g_aio_error, exc.ptr());
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// A file of an open directory; a negative dir_fd is refused by FileRef::validate.
zo::FileRef at_ref(int dir_fd, const std::string& name, const std::string& shown) {
    if (dir_fd < 0) throw zo::UsageError("dir_fd must be >= 0, got " + std::to_string(dir_fd));
    return zo::FileRef{dir_fd, name, shown};
}

// Runs `fn` without the GIL; then, holding it again, issues any warning and rethrows any error.
template <typename Fn>
int64_t call_io(Fn&& fn, zo::CallNotes* notes) {
    int64_t result = 0;
    std::exception_ptr error;
    {
        py::gil_scoped_release nogil;
        try {
            result = fn();
        } catch (...) {
            error = std::current_exception();
        }
    }
    if (notes != nullptr && notes->direct_fallback) {
        const std::string msg = "O_DIRECT is not supported on the filesystem of '" + notes->fallback_path +
                                "': using buffered I/O there (reported once per filesystem)";
        if (PyErr_WarnEx(g_fallback_warning, msg.c_str(), 2) != 0) throw py::error_already_set();
    }
    if (error) std::rethrow_exception(error);
    return result;
}

class PyHandle {
  public:
    PyHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
             int64_t intra_op_parallelism, const std::string& backend, const std::string& direct) {
        if (block_size <= 0)
            throw zo::UsageError("block_size must be > 0, got " + std::to_string(block_size));
        if (queue_depth <= 0 || queue_depth > 4096)
            throw zo::UsageError("queue_depth must be in [1, 4096], got " + std::to_string(queue_depth));
        if (intra_op_parallelism <= 0 || intra_op_parallelism > 256)
            throw zo::UsageError("intra_op_parallelism must be in [1, 256], got " +
                                 std::to_string(intra_op_parallelism));
        zo::HandleOptions o;
        o.block_size = static_cast<size_t>(block_size);
        o.queue_depth = static_cast<unsigned>(queue_depth);
        o.single_submit = single_submit;
        o.overlap_events = overlap_events;
        o.intra_op_parallelism = static_cast<unsigned>(intra_op_parallelism);
        o.backend = backend;
        o.direct = zo::parse_direct_mode(direct);
        py::gil_scoped_release nogil;  // probing and starting threads may take a moment
        h_ = std::make_unique<zo::Handle>(o);
    }

    int64_t io_path(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path, int64_t offset,
                    bool asynchronous) {
        zo::CallNotes notes;
        return call_io(
            [&] { return h_->submit_path(write, as_ptr(ptr), nbytes, path, offset, asynchronous, &notes); },
            &notes);
    }
    int64_t io_at(bool write, uintptr_t ptr, int64_t nbytes, const zo::FileRef& file, int64_t offset,
                  bool asynchronous) {
        zo::CallNotes notes;
        return call_io(
            [&] { return h_->submit_at(write, as_ptr(ptr), nbytes, file, offset, asynchronous, &notes); },
            &notes);
    }
    int64_t io_fd(bool write, uintptr_t ptr, int64_t nbytes, int fd, int64_t offset, bool asynchronous) {
        return call_io([&] { return h_->submit_fd(write, as_ptr(ptr), nbytes, fd, offset, asynchronous); },
                       nullptr);
    }
    void register_file(const std::string& path, bool writable) {
        zo::CallNotes notes;
        call_io(
            [&] {
                h_->register_file(path, writable, &notes);
                return int64_t(0);
            },
            &notes);
    }
    void register_at(const zo::FileRef& file, bool writable) {
        zo::CallNotes notes;
        call_io(
            [&] {
                h_->register_at(file, writable, &notes);
                return int64_t(0);
            },
            &notes);
    }
    void unregister_at(const zo::FileRef& file) {
        call_io(
            [&] {
                h_->unregister_at(file);
                return int64_t(0);
            },
            nullptr);
    }
    void unregister_file(const std::string& path) {
        call_io(
            [&] {
                h_->unregister_file(path);
                return int64_t(0);
            },
            nullptr);
    }
    int64_t wait() {
        return call_io([&] { return static_cast<int64_t>(h_->wait()); }, nullptr);
    }
    int64_t pending() const { return static_cast<int64_t>(h_->pending()); }
    void close() {
        call_io(
            [&] {
                h_->close();
                return int64_t(0);
            },
            nullptr);
    }
    void pause(bool paused) { h_->set_paused(paused); }
    const zo::Handle& h() const { return *h_; }

  private:
    std::unique_ptr<zo::Handle> h_;
};

// The memory of a PinnedBuffer. release() while I/O into it is in flight (hold_io() without its
// unhold_io()) only marks it released: the mapping goes once the last hold ends, so a request never
// writes into memory that was unmapped under it. Every member runs with the GIL held.
class PyPinned {
  public:
    PyPinned(size_t nbytes, size_t alignment, bool huge_pages, bool lock, zo::Populate populate)
        : mem_(std::make_unique<zo::PinnedMemory>(nbytes, alignment, huge_pages, lock, populate)),
          nbytes_(nbytes) {}
    zo::PinnedMemory& mut() {
        if (released()) throw py::value_error("PinnedBuffer was released");
        return *mem_;
    }
    const zo::PinnedMemory& mem() const {
        if (released()) throw py::value_error("PinnedBuffer was released");
        return *mem_;
    }
    void release() {
        released_ = true;
        if (holds_ == 0) mem_->release();
    }
    void hold_io() {
        if (released()) throw py::value_error("PinnedBuffer was released");
        ++holds_;
    }
    void unhold_io() {
        if (holds_ == 0) throw py::value_error("unhold_io() without a matching hold_io()");
        if (--holds_ == 0 && released_) mem_->release();
    }
    size_t nbytes() const { return nbytes_; }
    bool released() const { return released_ || mem_->released(); }
    const zo::PinnedMemory& raw() const { return *mem_; }

  private:
    std::unique_ptr<zo::PinnedMemory> mem_;
    size_t nbytes_;
    size_t holds_ = 0;
    bool released_ = false;
};

}  // namespace

PYBIND11_MODULE(_aio, m) {
    m.doc() = "Async file I/O core (io_uring, Linux AIO, pread/pwrite) and aligned pinned host buffers.";

    g_aio_error = PyErr_NewExceptionWithDoc(
        "offload._aio.AioError",
        "An I/O request failed: .errno, .strerror, .filename, plus .offset, .length and .op.", PyExc_OSError,
        nullptr);
    g_backend_error = PyErr_NewExceptionWithDoc("offload._aio.BackendUnavailableError",
                                                "The requested I/O backend cannot run on this kernel.",
                                                PyExc_RuntimeError, nullptr);
    g_fallback_warning =
        PyErr_NewExceptionWithDoc("offload._aio.DirectIOFallbackWarning",
                                  "O_DIRECT was refused by a filesystem; buffered I/O is used there instead.",
                                  PyExc_UserWarning, nullptr);
    m.attr("AioError") = py::handle(g_aio_error);
    m.attr("BackendUnavailableError") = py::handle(g_backend_error);
    m.attr("DirectIOFallbackWarning") = py::handle(g_fallback_warning);

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const zo::IoError& e) {
            raise_aio_error(e);
        } catch (const zo::BackendUnavailable& e) {
            PyErr_SetString(g_backend_error, e.what());
        }
    });

    m.def(
        "_inject_alloc_failure",
        [](int64_t n, const std::string& site) {
            if (n < 0) throw zo::UsageError("n must be >= 0, got " + std::to_string(n));
            static const char* const kSites[] = {"any",    "thread", "engine_setup", "request",
                                                 "submit", "bounce", "block_lock"};
            bool known = false;
            for (const char* k : kSites) known = known || site == k;
            if (!known) throw zo::UsageError("unknown fault injection site '" + site + "'");
            zo::inject_alloc_failure(static_cast<long>(n), site);
        },
        py::arg("n"), py::arg("site") = "any",
        "Test hook: make the nth internal allocation at `site` fail (bad_alloc; EAGAIN for 'thread'). "
        "0 disarms. Sites: any, thread, engine_setup, request, submit, bounce, block_lock.");
    m.def("_alloc_failure_countdown", &zo::alloc_failure_countdown,
          "Test hook: matching allocations left before the injected failure; 0 once fired or disarmed.");

    m.def(
        "available_backends", [] { return zo::available_backends(); },
        "Backends usable on this kernel, in preference order.");

    py::class_<PyHandle>(m, "Handle")
        .def(py::init<int64_t, int64_t, bool, bool, int64_t, const std::string&, const std::string&>(),
             py::arg("block_size") = 1 << 20, py::arg("queue_depth") = 32, py::arg("single_submit") = false,
             py::arg("overlap_events") = true, py::arg("intra_op_parallelism") = 1,
             py::arg("backend") = "auto", py::arg("direct") = "auto")
        .def_property_readonly("backend", [](const PyHandle& h) { return h.h().backend(); })
        .def_property_readonly("block_size", [](const PyHandle& h) { return h.h().options().block_size; })
        .def_property_readonly("queue_depth", [](const PyHandle& h) { return h.h().options().queue_depth; })
        .def_property_readonly("single_submit",
                               [](const PyHandle& h) { return h.h().options().single_submit; })
        .def_property_readonly("overlap_events",
                               [](const PyHandle& h) { return h.h().options().overlap_events; })
        .def_property_readonly("intra_op_parallelism",
                               [](const PyHandle& h) { return h.h().options().intra_op_parallelism; })
        .def_property_readonly("alignment", [](const PyHandle& h) { return h.h().alignment(); })
        .def(
            "pread",
            [](PyHandle& h, uintptr_t ptr, int64_t nbytes, const std::string& path, int64_t offset,
               bool asynchronous) { return h.io_path(false, ptr, nbytes, path, offset, asynchronous); },
            py::arg("ptr"), py::arg("nbytes"), py::arg("path"), py::arg("offset"), py::arg("asynchronous"))
        .def(
            "pwrite",
            [](PyHandle& h, uintptr_t ptr, int64_t nbytes, const std::string& path, int64_t offset,
               bool asynchronous) { return h.io_path(true, ptr, nbytes, path, offset, asynchronous); },
            py::arg("ptr"), py::arg("nbytes"), py::arg("path"), py::arg("offset"), py::arg("asynchronous"))
        .def(
            "pread_fd",
            [](PyHandle& h, uintptr_t ptr, int64_t nbytes, int fd, int64_t offset, bool asynchronous) {
                return h.io_fd(false, ptr, nbytes, fd, offset, asynchronous);
            },
            py::arg("ptr"), py::arg("nbytes"), py::arg("fd"), py::arg("offset"), py::arg("asynchronous"))
        .def(
            "pwrite_fd",
            [](PyHandle& h, uintptr_t ptr, int64_t nbytes, int fd, int64_t offset, bool asynchronous) {
                return h.io_fd(true, ptr, nbytes, fd, offset, asynchronous);
            },
            py::arg("ptr"), py::arg("nbytes"), py::arg("fd"), py::arg("offset"), py::arg("asynchronous"))
        .def(
            "pread_at",
            [](PyHandle& h, uintptr_t ptr, int64_t nbytes, int dir_fd, const std::string& name,
               const std::string& shown, int64_t offset, bool asynchronous) {
                return h.io_at(false, ptr, nbytes, at_ref(dir_fd, name, shown), offset, asynchronous);
            },
            py::arg("ptr"), py::arg("nbytes"), py::arg("dir_fd"), py::arg("name"), py::arg("shown"),
            py::arg("offset"), py::arg("asynchronous"),
            "Read from file `name` of the open directory `dir_fd` (openat, O_NOFOLLOW); `shown` names it in "
            "errors.")
        .def(
            "pwrite_at",
            [](PyHandle& h, uintptr_t ptr, int64_t nbytes, int dir_fd, const std::string& name,
               const std::string& shown, int64_t offset, bool asynchronous) {
                return h.io_at(true, ptr, nbytes, at_ref(dir_fd, name, shown), offset, asynchronous);
            },
            py::arg("ptr"), py::arg("nbytes"), py::arg("dir_fd"), py::arg("name"), py::arg("shown"),
            py::arg("offset"), py::arg("asynchronous"),
            "Write to file `name` of the open directory `dir_fd` (openat, O_NOFOLLOW; created 0600).")
        .def(
            "register_at",
            [](PyHandle& h, int dir_fd, const std::string& name, const std::string& shown, bool writable) {
                h.register_at(at_ref(dir_fd, name, shown), writable);
            },
            py::arg("dir_fd"), py::arg("name"), py::arg("shown"), py::arg("writable") = true,
            "register_file for file `name` of the open directory `dir_fd`.")
        .def(
            "unregister_at",
            [](PyHandle& h, int dir_fd, const std::string& name, const std::string& shown) {
                h.unregister_at(at_ref(dir_fd, name, shown));
            },
            py::arg("dir_fd"), py::arg("name"), py::arg("shown"),
            "unregister_file for file `name` of the open directory `dir_fd`.")
        .def("register_file", &PyHandle::register_file, py::arg("path"), py::arg("writable") = true,
             "Open `path` once; requests naming it use that descriptor until unregister_file() or close().")
        .def("unregister_file", &PyHandle::unregister_file, py::arg("path"),
             "Forget a registration; the descriptor closes once no request uses it.")
        .def("wait", &PyHandle::wait, "Block until every queued request finished; returns how many finished.")
        .def("pending", &PyHandle::pending)
        .def("close", &PyHandle::close)
        .def("_set_paused", &PyHandle::pause, py::arg("paused"),
             "Test hook: while paused, workers start no newly queued request.");

    py::class_<PyPinned>(m, "PinnedBuffer", py::buffer_protocol())
        .def_buffer([](PyPinned& b) {
            const zo::PinnedMemory& mem = b.mem();
            return py::buffer_info(mem.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(b.nbytes())}, {1}, /*readonly=*/false);
        })
        .def_property_readonly("ptr",
                               [](const PyPinned& b) { return reinterpret_cast<uintptr_t>(b.mem().data()); })
        .def_property_readonly("nbytes", &PyPinned::nbytes)
        .def_property_readonly("locked", [](const PyPinned& b) { return b.raw().locked(); })
        .def_property_readonly("huge_pages", [](const PyPinned& b) { return b.raw().huge_pages(); })
        .def_property_readonly("lock_errno", [](const PyPinned& b) { return b.raw().lock_errno(); })
        .def_property_readonly("released", &PyPinned::released)
        .def_property_readonly("populated", [](PyPinned& b) { return b.mut().populated(); })
        .def(
            "wait_populated",
            [](PyPinned& b) {
                zo::PinnedMemory& mem = b.mut();
                py::gil_scoped_release nogil;
                return mem.wait_populated();
            },
            "Block until the background population is done; returns its errno (0: every page resident).")
        .def("release", &PyPinned::release,
             "Unmap now, or once the I/O holding it (hold_io) is done; the buffer must not be used "
             "afterwards.")
        .def("hold_io", &PyPinned::hold_io,
             "Keep the memory mapped until the matching unhold_io(), even if release() is called meanwhile.")
        .def("unhold_io", &PyPinned::unhold_io, "End a hold_io(); unmaps if release() was called meanwhile.");

    m.def(
        "alloc_pinned",
        [](int64_t nbytes, int64_t alignment, bool huge_pages, bool lock, const std::string& populate) {
            if (nbytes < 0) throw zo::UsageError("nbytes must be >= 0, got " + std::to_string(nbytes));
            if (alignment <= 0)
                throw zo::UsageError("alignment must be > 0, got " + std::to_string(alignment));
            zo::Populate mode;
            if (populate == "sync") {
                mode = zo::Populate::kSync;
            } else if (populate == "background") {
                mode = zo::Populate::kBackground;
            } else if (populate == "none") {
                mode = zo::Populate::kNone;
            } else {
                throw zo::UsageError("populate must be 'sync', 'background' or 'none', got '" + populate +
                                     "'");
            }
            py::gil_scoped_release nogil;  // mlock faults in every page
            return std::make_unique<PyPinned>(static_cast<size_t>(nbytes), static_cast<size_t>(alignment),
                                              huge_pages, lock, mode);
        },
        py::arg("nbytes"), py::arg("alignment") = 2 << 20, py::arg("huge_pages") = true,
        py::arg("lock") = true, py::arg("populate") = "sync",
        "Anonymous, aligned, optionally huge-page backed and mlock'ed host buffer of exactly nbytes. "
        "populate: when a locked buffer's pages fault in: 'sync' (before returning), 'background' (a "
        "thread of the buffer), 'none' (on first touch).");
}
