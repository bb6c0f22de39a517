"""Faults: each gives a typed exception with errno and file, and leaves fds and pinned memory as they were.

Faults that need other credentials or limits (permission denied as root, EFBIG, syscalls the kernel refuses)
run in a child process so the test process keeps its own.
"""

from __future__ import annotations

import errno
import os
import platform
import shutil
import tempfile
import warnings

import numpy as np
import pytest

from offload import _aio
from offload.aio import AioError, AioHandle, BackendUnavailableError, DirectIOFallbackWarning
from offload.pinned import pinned_bytes_in_use
from tests.aio_helpers import SECCOMP_DENY, FakeDevice, open_fds, random_bytes, run_child

BACKENDS = _aio.available_backends()


@pytest.fixture
def io_dir():
    with tempfile.TemporaryDirectory(
        prefix="zo-fault-", dir=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp")
    ) as d:
        yield d


@pytest.fixture
def no_leaks():
    """Snapshot open fds and pinned bytes; the test body must leave both where they were."""
    fds, pinned = open_fds(), pinned_bytes_in_use()
    yield
    assert open_fds() == fds, "file descriptors leaked"
    assert pinned_bytes_in_use() == pinned, "pinned memory leaked"


def assert_aio_error(info, err: int, path, op: str) -> None:
    e = info.value
    assert isinstance(e, OSError)
    assert e.errno == err, (
        f"errno {e.errno} ({os.strerror(e.errno or 0)}), expected {errno.errorcode[err]}: {e}"
    )
    if path is not None:
        assert e.filename == path
    assert e.op == op


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_directory(io_dir, no_leaks, backend):
    path = os.path.join(io_dir, "no", "such", "dir", "f.bin")
    buf = np.zeros(8192, np.uint8)
    with AioHandle(backend=backend) as h:
        for call in (h.sync_pwrite, h.async_pwrite, h.sync_pread, h.async_pread):
            with pytest.raises(AioError) as info:
                call(buf, path)
            assert_aio_error(info, errno.ENOENT, path, "open")
        assert h.pending() == 0
        assert h.wait() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_truncated_before_read(io_dir, no_leaks, backend):
    path = os.path.join(io_dir, "trunc.bin")
    data = random_bytes(1 << 20, 1)
    out = np.zeros_like(data)
    with AioHandle(backend=backend) as h:
        h.sync_pwrite(data, path)
        os.truncate(path, 1000)
        for call in (h.sync_pread, h.async_pread):
            with pytest.raises(AioError) as info:
                call(out, path)
            assert_aio_error(info, errno.ENODATA, path, "read")
            assert "1000" in str(info.value)  # names the file size
        assert h.pending() == 0
        # A read that ends exactly at the new end of file still works.
        h.sync_pread(out[:1000], path)
    np.testing.assert_array_equal(out[:1000], data[:1000])


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_truncated_after_the_request_was_queued(io_dir, no_leaks, backend):
    path = os.path.join(io_dir, "trunc2.bin")
    data = random_bytes(1 << 20, 2)
    out = np.zeros_like(data)
    dev = FakeDevice(1 << 20)
    with AioHandle(backend=backend) as h:
        h.sync_pwrite(data, path)
        h._h._set_paused(True)  # test hook: queued requests wait, so the truncation surely comes first
        try:
            assert h.async_pread(out, path) == 0  # passes the size check made at call time
            h.async_pread(dev, path)
            os.truncate(path, 1000)
        finally:
            h._h._set_paused(False)
        with pytest.raises(AioError) as info:
            h.wait()
        assert_aio_error(info, errno.ENODATA, path, "read")
        assert info.value.offset == 1000
        assert "truncated" in str(info.value)
        assert dev.from_host == 0  # a failed staged read is not copied to the device
        # The handle is empty and usable again.
        assert h.pending() == 0 and h.wait() == 0
        h.sync_pread(out[:1000], path)
    np.testing.assert_array_equal(out[:1000], data[:1000])


def test_closed_fd(no_leaks):
    with AioHandle() as h:
        # Opened and closed after the handle exists, so the number is not reused by the handle's own fds.
        fd = os.open("/dev/null", os.O_RDONLY)
        os.close(fd)
        with pytest.raises(OSError) as info:
            h.sync_pwrite(bytearray(4096), fd)
    assert info.value.errno == errno.EBADF


def test_permission_denied():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a directory for another user and drop privileges to it")
    top = tempfile.mkdtemp(prefix="zo-perm-", dir="/var/tmp")
    try:
        os.chmod(top, 0o711)  # others may traverse but not list
        ro_dir = os.path.join(top, "ro")
        os.mkdir(ro_dir, 0o500)
        os.chown(ro_dir, 65534, 65534)  # owned by nobody, who may read but not write in it
        secret = os.path.join(top, "secret.bin")
        with open(secret, "wb") as f:
            f.write(b"x" * 8192)
        os.chmod(secret, 0o600)
        result = run_child(
            f"""
            import os, numpy as np
            from offload.aio import AioHandle, AioError
            from offload.pinned import pinned_bytes_in_use
            h = AioHandle()
            fds, pinned = len(os.listdir("/proc/self/fd")), pinned_bytes_in_use()
            os.setgid(65534)
            os.setuid(65534)
            got = []
            for fn, path in ((h.sync_pwrite, {ro_dir!r} + "/f.bin"), (h.async_pwrite, {ro_dir!r} + "/g.bin"),
                             (h.sync_pread, {secret!r}), (h.async_pread, {secret!r})):
                try:
                    fn(np.zeros(4096, np.uint8), path)
                    got.append(None)
                except AioError as e:
                    got.append([e.errno, e.filename, e.op])
            result = {{"got": got, "pending": h.pending(),
                       "fds_back": len(os.listdir("/proc/self/fd")) == fds,
                       "pinned_back": pinned_bytes_in_use() == pinned}}
            """
        )
    finally:
        shutil.rmtree(top)
    assert "exc" not in result, result
    assert result["got"] == [
        [errno.EACCES, os.path.join(ro_dir, "f.bin"), "open"],
        [errno.EACCES, os.path.join(ro_dir, "g.bin"), "open"],
        [errno.EACCES, secret, "open"],
        [errno.EACCES, secret, "open"],
    ]
    assert result["pending"] == 0 and result["fds_back"] and result["pinned_back"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_write_failure_efbig(io_dir, backend, asynchronous):
    path = os.path.join(io_dir, "big.bin")
    result = run_child(
        f"""
        import os, resource, signal, numpy as np
        from offload.aio import AioHandle, AioError
        from offload.pinned import pinned_bytes_in_use
        h = AioHandle(backend={backend!r})
        fds, pinned = len(os.listdir("/proc/self/fd")), pinned_bytes_in_use()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            if {asynchronous!r}:
                h.async_pwrite(np.ones(4 << 20, np.uint8), {path!r})
                h.wait()
            else:
                h.sync_pwrite(np.ones(4 << 20, np.uint8), {path!r})
            result = {{"raised": None}}
        except AioError as e:
            result = {{"raised": [e.errno, e.filename, e.op]}}
        result.update(pending=h.pending(), fds_back=len(os.listdir("/proc/self/fd")) == fds,
                      pinned_back=pinned_bytes_in_use() == pinned)
        """
    )
    assert "exc" not in result, result
    assert result["raised"] == [errno.EFBIG, path, "write"]
    assert result["pending"] == 0 and result["fds_back"] and result["pinned_back"]


def test_tmpfs_falls_back_to_buffered_with_one_warning():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(prefix="zo-shm-", dir="/dev/shm") as d:
        path = os.path.join(d, "f.bin")
        result = run_child(
            f"""
            import os, warnings, numpy as np
            from offload.aio import AioHandle, AioError, DirectIOFallbackWarning
            from offload.pinned import pinned_bytes_in_use
            data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                h = AioHandle()
                fds, pinned = len(os.listdir("/proc/self/fd")), pinned_bytes_in_use()
                h.sync_pwrite(data, {path!r})
                h.async_pwrite(data, {path!r}, 3 << 20)
                h.wait()
                out = np.empty(6 << 20, np.uint8)
                h.sync_pread(out, {path!r})
            fallback = [str(w.message) for w in rec if issubclass(w.category, DirectIOFallbackWarning)]
            try:
                AioHandle(direct="on").sync_pwrite(data, {path!r})
                strict = None
            except AioError as e:
                strict = [e.errno, e.filename, e.op]
            with warnings.catch_warnings(record=True) as rec_off:
                warnings.simplefilter("always")
                AioHandle(direct="off").sync_pread(out[:100], {path!r})
            ok = bool((out[: 3 << 20] == data).all() and (out[3 << 20 :] == data).all())
            result = {{"warnings": fallback, "ok": ok, "strict": strict, "off_warnings": len(rec_off),
                       "fds_back": len(os.listdir("/proc/self/fd")) == fds,
                       "pinned_back": pinned_bytes_in_use() == pinned}}
            """
        )
    assert "exc" not in result, result
    assert result["ok"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert result["off_warnings"] == 0
    assert (
        result["strict"] is not None and result["strict"][0] == errno.EINVAL and result["strict"][1] == path
    )
    assert result["fds_back"] and result["pinned_back"]


def test_tmpfs_warning_is_a_warning_in_process(tmp_path):
    # Whatever the child saw, in this process the category must be catchable and the data still correct.
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = os.path.join(d, "g.bin")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DirectIOFallbackWarning)
            with AioHandle() as h:
                h.sync_pwrite(b"hello tmpfs", path)
                out = bytearray(11)
                h.sync_pread(out, path)
        assert bytes(out) == b"hello tmpfs"


FORCEABLE = [b for b in ("io_uring", "aio", "psync") if b not in BACKENDS]


@pytest.mark.parametrize(
    "backend", FORCEABLE or [pytest.param(None, marks=pytest.mark.skip("all backends available"))]
)
def test_forcing_an_unavailable_backend_in_process(backend):
    with pytest.raises(BackendUnavailableError, match=backend):
        AioHandle(backend=backend)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="seccomp filter uses x86_64 syscall numbers")
@pytest.mark.parametrize("deny", [["io_uring"], ["aio"], ["io_uring", "aio"]])
def test_forcing_a_backend_the_kernel_refuses(deny):
    result = run_child(
        """
        import os
        from offload import _aio
        from offload.aio import AioHandle, BackendUnavailableError
        from offload.pinned import pinned_bytes_in_use
        fds, pinned = len(os.listdir("/proc/self/fd")), pinned_bytes_in_use()
        refused = {}
        for name in DENY:
            try:
                AioHandle(backend=name)
                refused[name] = None
            except BackendUnavailableError as e:
                refused[name] = str(e)
        auto = AioHandle()
        backend = auto.backend
        auto.close()
        result = {"available": _aio.available_backends(), "refused": refused, "auto": backend,
                  "fds_back": len(os.listdir("/proc/self/fd")) == fds,
                  "pinned_back": pinned_bytes_in_use() == pinned}
        """,
        prelude=f"DENY = {deny!r}\n" + SECCOMP_DENY,
    )
    assert "exc" not in result, result
    for name in deny:
        assert name not in result["available"]
        assert result["refused"][name] is not None and name in result["refused"][name]
    assert "psync" in result["available"]
    assert result["auto"] == result["available"][0]
    assert result["fds_back"] and result["pinned_back"]


# --- Running out of memory inside the core ----------------------------------------------------------------
# `_aio._inject_alloc_failure(n, site)` makes the nth internal allocation at `site` fail (std::bad_alloc; at
# "thread", std::system_error(EAGAIN) as std::thread throws). Inside a worker thread the failure must become
# the request's AioError(ENOMEM), never std::terminate, and the handle must keep working afterwards.

BLOCK = 64 << 10


@pytest.fixture
def inject():
    yield _aio._inject_alloc_failure
    _aio._inject_alloc_failure(0)  # disarm even when the test failed before the hook fired


def assert_round_trip(h: AioHandle, path: str, offset: int, n: int, seed: int) -> None:
    """The handle still moves data bit-exactly, sync and async, aligned and not."""
    src = random_bytes(n, seed)
    h.sync_pwrite(src, path, offset)
    dst = np.zeros(n, np.uint8)
    h.sync_pread(dst, path, offset)
    np.testing.assert_array_equal(dst, src)
    dst[:] = 0
    h.async_pread(dst, path, offset)
    assert h.wait() == 1
    np.testing.assert_array_equal(dst, src)


def assert_enomem(info) -> None:
    e = info.value
    assert isinstance(e, AioError)
    assert e.errno == errno.ENOMEM, f"errno {e.errno}: {e}"
    assert "Cannot allocate memory" in str(e)  # strerror(ENOMEM), then where it happened


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("nth", [1, 5])
def test_alloc_failure_while_submitting_a_piece(io_dir, no_leaks, inject, backend, asynchronous, nth):
    path = os.path.join(io_dir, "f.bin")
    n = 16 * BLOCK
    with AioHandle(BLOCK, 4, backend=backend, intra_op_parallelism=2) as h:
        h.sync_pwrite(random_bytes(n, 1), path)
        inject(nth, "submit")
        buf = np.zeros(n, np.uint8)
        with pytest.raises(AioError) as info:
            if asynchronous:
                h.async_pread(buf, path)
                h.wait()
            else:
                h.sync_pread(buf, path)
        assert _aio._alloc_failure_countdown() == 0, "the injected failure did not fire"
        assert_enomem(info)
        assert info.value.filename == path and info.value.op == "read"
        assert h.pending() == 0
        assert h.wait() == 0  # the failure was reported once
        assert_round_trip(h, path, 0, n, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_failure_of_the_bounce_buffer(io_dir, no_leaks, inject, backend):
    # An unaligned request needs the worker's bounce buffers, allocated on first use on the worker thread.
    path = os.path.join(io_dir, "f.bin")
    with AioHandle(BLOCK, 4, backend=backend) as h:
        h.sync_pwrite(random_bytes(4 * BLOCK, 3), path)
    with AioHandle(BLOCK, 4, backend=backend) as h:  # a fresh handle has no bounce buffers yet
        inject(1, "bounce")
        with pytest.raises(AioError) as info:
            h.sync_pwrite(random_bytes(1000, 4), path, 123)
        assert _aio._alloc_failure_countdown() == 0
        assert_enomem(info)
        assert info.value.op == "write"
        assert_round_trip(h, path, 777, 3 * BLOCK + 5, 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_failure_taking_a_block_lock(io_dir, no_leaks, inject, backend):
    # A write with partial edge blocks locks them (process-wide bookkeeping) for its read-modify-write.
    path = os.path.join(io_dir, "f.bin")
    old = random_bytes(4 * BLOCK, 6)
    with AioHandle(BLOCK, 4, backend=backend) as h:
        h.sync_pwrite(old, path)
        inject(1, "block_lock")
        h.async_pwrite(random_bytes(5000, 7), path, 100)
        with pytest.raises(AioError) as info:
            h.wait()
        assert _aio._alloc_failure_countdown() == 0
        assert_enomem(info)
        # Nothing was written and the lock was not left held: the same blocks can be written again.
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), old)
        assert_round_trip(h, path, 100, 5000, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_failure_in_the_calling_thread(io_dir, no_leaks, inject, backend):
    path = os.path.join(io_dir, "f.bin")
    with AioHandle(BLOCK, 4, backend=backend) as h:
        inject(1, "request")
        with pytest.raises(MemoryError):
            h.async_pwrite(random_bytes(BLOCK, 9), path)
        assert h.pending() == 0
        assert h.wait() == 0
        assert_round_trip(h, path, 0, 2 * BLOCK, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_failure_setting_up_a_worker(no_leaks, inject, backend):
    # The ring / AIO context is created on the worker thread; its failure is the constructor's MemoryError.
    inject(2, "engine_setup")
    with pytest.raises(MemoryError):
        AioHandle(backend=backend, intra_op_parallelism=3)
    assert _aio._alloc_failure_countdown() == 0
    with AioHandle(backend=backend, intra_op_parallelism=3) as h:
        assert h.backend == backend


def test_thread_creation_failure(no_leaks, inject):
    inject(3, "thread")
    with pytest.raises(AioError) as info:
        AioHandle(intra_op_parallelism=4)
    e = info.value
    assert e.errno == errno.EAGAIN and e.op == "setup"
    assert "worker thread 3 of 4" in str(e)
    assert _aio._alloc_failure_countdown() == 0


def test_inject_hook_rejects_unknown_sites():
    with pytest.raises(ValueError, match="nowhere"):
        _aio._inject_alloc_failure(1, "nowhere")
    assert _aio._alloc_failure_countdown() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_failure_at_every_point_of_a_request(io_dir, backend):
    # Fail the 1st, 2nd, ... allocation of an unaligned multi-worker write + read, wherever it falls. In a
    # child process: a failure escaping a worker thread would std::terminate the interpreter.
    result = run_child(
        f"""
        import errno, os
        import numpy as np
        from offload import _aio
        from offload.aio import AioError, AioHandle
        path = os.path.join({io_dir!r}, "sweep.bin")
        src = np.random.default_rng(0).integers(0, 256, size=300_001, dtype=np.uint8)
        outcomes = []
        with AioHandle(65536, 4, backend={backend!r}, intra_op_parallelism=2) as h:
            h.sync_pwrite(np.zeros(400_000, np.uint8), path)
            for n in range(1, 40):
                _aio._inject_alloc_failure(n, "any")
                try:
                    h.async_pwrite(src, path, 77)
                    h.wait()
                    dst = np.zeros_like(src)
                    h.sync_pread(dst, path, 77)
                    outcome = "ok"
                except MemoryError:
                    outcome = "MemoryError"
                except AioError as e:
                    outcome = "ENOMEM" if e.errno == errno.ENOMEM else f"errno {{e.errno}}"
                fired = _aio._alloc_failure_countdown() == 0
                _aio._inject_alloc_failure(0)
                dst = np.zeros_like(src)
                h.sync_pwrite(src, path, 77)
                h.sync_pread(dst, path, 77)
                outcomes.append([n, outcome, fired, bool((dst == src).all()), h.pending()])
        result = {{"outcomes": outcomes}}
        """
    )
    assert "exc" not in result, result
    outcomes = result["outcomes"]
    for n, outcome, fired, round_trip, pending in outcomes:
        assert outcome in ("ok", "MemoryError", "ENOMEM"), (n, outcome)
        assert (outcome == "ok") == (not fired), (n, outcome, fired)  # every injected failure is reported
        assert round_trip and pending == 0, (n, outcome)
    # The sweep reached past the last allocation: some runs failed, the last ones did not.
    assert any(o[1] != "ok" for o in outcomes) and outcomes[-1][1] == "ok", outcomes
