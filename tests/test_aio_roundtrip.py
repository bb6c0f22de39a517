"""AioHandle round trips, bit-exact over sizes, alignments, backends, queue depths, block sizes, threads."""

from __future__ import annotations

import errno
import gc
import os
import tempfile
import threading
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import _aio
from offload.aio import AioError, AioHandle
from offload.pinned import pinned_bytes_in_use, pinned_tensor
from tests.aio_helpers import FakeDevice, file_bytes, open_fds, random_bytes, unaligned

BACKENDS = _aio.available_backends()


@pytest.fixture(scope="module")
def io_dir():
    # On the real disk (not tmpfs) so that O_DIRECT is exercised; removed with its files afterwards.
    with tempfile.TemporaryDirectory(
        prefix="zo-aio-test-", dir=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp")
    ) as d:
        yield d


def test_available_backends_is_an_ordered_subset():
    assert BACKENDS, "at least psync must always be available"
    known = ["io_uring", "aio", "psync"]
    assert set(BACKENDS) <= set(known)
    assert BACKENDS == sorted(BACKENDS, key=known.index)
    assert "psync" in BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_handle_reports_its_configuration(backend):
    with AioHandle(
        block_size=256 << 10,
        queue_depth=8,
        single_submit=True,
        overlap_events=False,
        intra_op_parallelism=3,
        backend=backend,
    ) as h:
        assert h.backend == backend
        assert h.get_block_size() == 256 << 10
        assert h.get_queue_depth() == 8
        assert h.get_single_submit() is True
        assert h.get_overlap_events() is False
        assert h.get_intra_op_parallelism() == 3
        assert h.get_thread_count() == 3
        align = h.get_alignment()
        assert align >= 512 and align & (align - 1) == 0


def test_auto_backend_is_the_first_available():
    with AioHandle() as h:
        assert h.backend == BACKENDS[0]


SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 1 << 20), st.integers((1 << 20) + 1, 6 << 20))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=SIZES,
    buf_misalign=st.sampled_from([0, 1, 7, 512, 4095]),
    file_offset=st.one_of(st.just(0), st.integers(1, 3 << 20)),
    block_size=st.sampled_from([4096, 64 << 10, 1 << 20]),
    queue_depth=st.sampled_from([1, 4, 32]),
    threads=st.sampled_from([1, 2, 4]),
    single_submit=st.booleans(),
    overlap_events=st.booleans(),
    asynchronous=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_bit_exact(
    io_dir,
    backend,
    size,
    buf_misalign,
    file_offset,
    block_size,
    queue_depth,
    threads,
    single_submit,
    overlap_events,
    asynchronous,
    seed,
):
    path = os.path.join(io_dir, f"rt-{backend}.bin")
    if os.path.exists(path):
        os.unlink(path)
    src = unaligned(size, buf_misalign)
    src[:] = random_bytes(size, seed)
    dst = unaligned(size, (buf_misalign * 3 + 1) % 4096)
    with AioHandle(block_size, queue_depth, single_submit, overlap_events, threads, backend=backend) as h:
        if asynchronous:
            assert h.async_pwrite(src, path, file_offset) == 0
            assert h.wait() == 1
        else:
            assert h.sync_pwrite(src, path, file_offset) == 1
        assert os.path.getsize(path) == file_offset + size
        # Checked against an independent reader, so a symmetric bug in write and read cannot hide.
        np.testing.assert_array_equal(file_bytes(path, file_offset, size), src)
        if asynchronous:
            assert h.async_pread(dst, path, file_offset) == 0
            assert h.wait() == 1
        else:
            assert h.sync_pread(dst, path, file_offset) == 1
    np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize("backend", BACKENDS)
def test_roundtrip_64mib_unaligned(io_dir, backend):
    n = 64 << 20
    path = os.path.join(io_dir, f"big-{backend}.bin")
    src = unaligned(n, 3)
    src[:] = random_bytes(n, 64)
    dst = unaligned(n, 4093)
    with AioHandle(1 << 20, 32, intra_op_parallelism=2, backend=backend) as h:
        h.sync_pwrite(src, path, 12345)
        h.sync_pread(dst, path, 12345)
    os.unlink(path)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_async_requests_then_one_wait(io_dir, backend):
    # Unaligned lengths; each request starts on its own 4 KiB block of a file that already has its final
    # size, so requests share no block (that case: test_concurrent_writes_sharing_a_block).
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 200_000, size=150)
    slots = (sizes + 4095) // 4096 * 4096 + 4096 * rng.integers(0, 2, size=150)
    offsets = np.concatenate([[0], np.cumsum(slots)[:-1]])
    data = [random_bytes(int(n), i) for i, n in enumerate(sizes)]
    path = os.path.join(io_dir, f"many-{backend}.bin")
    fds = open_fds()
    with AioHandle(64 << 10, 16, intra_op_parallelism=2, backend=backend) as h:
        h.sync_pwrite(np.zeros(int(slots.sum()), np.uint8), path)
        for buf, off in zip(data, offsets):
            assert h.async_pwrite(buf, path, int(off)) == 0
        assert h.pending() <= len(data)  # requests still running; some may have finished already
        assert h.wait() == len(data)
        assert h.pending() == 0
        back = [np.empty_like(b) for b in data]
        for buf, off in zip(back, offsets):
            h.async_pread(buf, path, int(off))
        assert h.wait() == len(data)
        assert h.wait() == 0  # nothing queued: DeepSpeed asserts, we report zero
    os.unlink(path)
    assert open_fds() == fds
    for a, b in zip(back, data):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "a_range, b_range",
    [
        pytest.param((0, 10_000), (10_000, 20_000), id="adjacent-in-one-block"),
        pytest.param((100, 1000), (3000, 4000), id="disjoint-in-one-block"),
        pytest.param((0, 5000), (8192, 12288), id="second-extends-past-first"),
    ],
)
@pytest.mark.parametrize("handles", [1, 2])
def test_concurrent_writes_sharing_a_block(io_dir, backend, a_range, b_range, handles):
    # Two queued writes to disjoint byte ranges must both land, even when the ranges share a 4 KiB
    # block (O_DIRECT read-modify-write of partial blocks) or one extends the file past the other;
    # from one handle or from two (e.g. two swappers sharing a swap file).
    path = os.path.join(io_dir, f"share-{backend}.bin")
    a = random_bytes(a_range[1] - a_range[0], 1)
    b = random_bytes(b_range[1] - b_range[0], 2)
    for _ in range(5):  # a race: give it several chances to show
        if os.path.exists(path):
            os.unlink(path)
        with AioHandle(backend=backend, intra_op_parallelism=2) as h1, AioHandle(backend=backend) as h2:
            h1.async_pwrite(a, path, a_range[0])
            (h2 if handles == 2 else h1).async_pwrite(b, path, b_range[0])
            h1.wait()
            h2.wait()
        assert os.path.getsize(path) == b_range[1]
        np.testing.assert_array_equal(file_bytes(path, a_range[0], a.size), a)
        np.testing.assert_array_equal(file_bytes(path, b_range[0], b.size), b)


def test_sync_request_completes_earlier_async_ones_first(io_dir):
    # DeepSpeed queues a sync request behind pending async ones and returns the count of all it waited for.
    path = os.path.join(io_dir, "order.bin")
    a, b = random_bytes(8192, 1), random_bytes(10_000, 2)
    with AioHandle() as h:
        h.async_pwrite(a, path, 0)
        h.async_pwrite(b, path, 8192)
        out = np.empty(18_192, np.uint8)
        assert h.sync_pread(out, path, 0) == 3
        assert h.pending() == 0
        # The count does not depend on whether the earlier request is still running or already done.
        h.async_pwrite(a, path, 0)
        assert h.sync_pwrite(b, path, 8192) == 2
        assert h.sync_pread(out, path, 0) == 1
    assert np.array_equal(out, np.concatenate([a, b]))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: torch.empty(n // 4, dtype=torch.float32), id="torch-f32"),
        pytest.param(lambda n: torch.empty(n // 2, dtype=torch.bfloat16), id="torch-bf16"),
        pytest.param(lambda n: torch.empty(n // 8, dtype=torch.float64)[None, :], id="torch-2d"),
        pytest.param(lambda n: np.empty(n // 4, dtype=np.float32), id="numpy"),
        pytest.param(lambda n: bytearray(n), id="bytearray"),
        pytest.param(lambda n: memoryview(bytearray(n)), id="memoryview"),
        pytest.param(lambda n: _aio.alloc_pinned(n), id="PinnedBuffer"),
        pytest.param(lambda n: pinned_tensor(n, torch.uint8), id="pinned_tensor"),
    ],
)
def test_buffer_kinds(io_dir, make):
    n = 3 * 4096 + 8  # divisible by every item size above, not by the block size
    path = os.path.join(io_dir, "kinds.bin")
    src, dst = make(n), make(n)
    as_u8(src)[:] = random_bytes(n, 5)
    with AioHandle() as h:
        h.sync_pwrite(src, path)
        h.async_pread(dst, path)
        h.wait()
    np.testing.assert_array_equal(as_u8(dst), random_bytes(n, 5))
    os.unlink(path)


def as_u8(obj) -> np.ndarray:
    """A writable uint8 numpy view of any buffer kind used above."""
    if isinstance(obj, torch.Tensor):
        return obj.reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(obj, dtype=np.uint8)


def test_deepspeed_general_forms(io_dir):
    # DeepSpeed: pread/pwrite(buffer, filename, validate, async, file_offset), all positional.
    path = os.path.join(io_dir, "general.bin")
    src = torch.arange(5000, dtype=torch.int32)
    dst = torch.zeros_like(src)
    with AioHandle() as h:
        assert h.pwrite(src, path, False, True, 100) == 0
        assert h.wait() == 1
        assert h.pread(dst, path, False, False, 100) == 1
        with pytest.raises(ValueError, match="validate"):
            h.pread(dst, path, True, False, 0)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_requests_count_and_check(io_dir, backend):
    path = os.path.join(io_dir, f"empty-{backend}.bin")
    with AioHandle(backend=backend) as h:
        assert h.sync_pwrite(torch.empty(0), path) == 1
        assert os.path.getsize(path) == 0  # created, nothing written
        assert h.async_pread(np.empty(0, np.uint8), path) == 0
        assert h.async_pwrite(bytearray(0), path, 10) == 0
        assert h.async_pwrite(bytearray(5), path) == 0
        assert h.wait() == 3
        assert h.sync_pread(bytearray(0), path, 5) == 1  # ends exactly at the end of file
        with pytest.raises(OSError) as info:
            h.async_pread(bytearray(0), os.path.join(io_dir, "missing.bin"))
        assert info.value.errno == errno.ENOENT
        assert h.wait() == 0
    os.unlink(path)


def test_write_from_read_only_buffer(io_dir):
    path = os.path.join(io_dir, "ro.bin")
    payload = bytes(random_bytes(5000, 9))
    with AioHandle() as h:
        h.sync_pwrite(payload, path)
    assert open(path, "rb").read() == payload
    os.unlink(path)


def test_new_cpu_locked_tensor(io_dir):
    path = os.path.join(io_dir, "locked.bin")
    before = pinned_bytes_in_use()
    with AioHandle() as h:
        t = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float16))
        assert t.dtype == torch.float16 and t.numel() == 1000 and not t.is_cuda
        assert pinned_bytes_in_use() - before == 2000
        t.copy_(torch.arange(1000, dtype=torch.float16))
        h.sync_pwrite(t, path)
        u = h.new_cpu_locked_tensor(1000, t)
        h.sync_pread(u, path)
        assert torch.equal(u, t)
        assert h.free_cpu_locked_tensor(t) is True
        assert h.free_cpu_locked_tensor(t) is False  # not ours any more
        assert h.free_cpu_locked_tensor(torch.empty(3)) is False
        h.free_cpu_locked_tensor(u)
    del t, u
    assert pinned_bytes_in_use() == before
    os.unlink(path)


def test_writes_extend_but_never_truncate(io_dir):
    path = os.path.join(io_dir, "extend.bin")
    big = random_bytes(100_000, 3)
    with AioHandle() as h:
        h.sync_pwrite(big, path)
        h.sync_pwrite(np.zeros(10, np.uint8), path, 5)
        assert os.path.getsize(path) == 100_000
        h.sync_pwrite(np.ones(10, np.uint8), path, 100_000 + 4096)
    assert os.path.getsize(path) == 100_000 + 4096 + 10
    expected = big.copy()
    expected[5:15] = 0
    np.testing.assert_array_equal(file_bytes(path, 0, 100_000), expected)
    np.testing.assert_array_equal(file_bytes(path, 100_000, 4096), np.zeros(4096, np.uint8))
    os.unlink(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_fd_target(io_dir, backend):
    path = os.path.join(io_dir, f"fd-{backend}.bin")
    src = random_bytes(300_001, 11)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with AioHandle(backend=backend) as h:
            h.async_pwrite(src, fd, 17)
            h.wait()
            dst = np.empty_like(src)
            h.sync_pread(dst, fd, 17)
        os.fstat(fd)  # still open: the handle never closes a caller's fd
    finally:
        os.close(fd)
    np.testing.assert_array_equal(dst, src)
    os.unlink(path)


# -- registered files: opened once, never reopened by path ------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_file_is_used_after_another_file_is_renamed_over_its_path(io_dir, backend):
    path = os.path.join(io_dir, f"reg-{backend}.bin")
    intruder = os.path.join(io_dir, f"intruder-{backend}.bin")
    original, other = random_bytes(200_000, 41), random_bytes(200_000, 42)
    with open(path, "wb") as f:
        f.write(original.tobytes())
    keep = os.open(path, os.O_RDONLY)  # the registered inode, to check it after the path moved on
    fds = open_fds()
    try:
        with AioHandle(backend=backend, block_size=64 << 10) as h:
            with_handle = open_fds()  # an io_uring ring is a descriptor too
            h.register_file(path)
            with open(intruder, "wb") as f:
                f.write(other.tobytes())
            os.replace(intruder, path)
            out = np.zeros_like(original)
            h.sync_pread(out, path)
            np.testing.assert_array_equal(out, original)  # from the registered file, not the new one
            patch = random_bytes(5000, 43)
            h.async_pwrite(patch, path, 1001)  # unaligned: read-modify-write through the registered fd
            # Extends the registered file by 5 bytes; completes the queued write first (returns 2).
            assert h.sync_pwrite(patch[:10], path, 199_995) == 2
            assert open_fds() == with_handle + 1  # the registered descriptor, and no other
        assert open_fds() == fds  # close() closed it
        with open(path, "rb") as f:
            assert f.read() == other.tobytes()  # the file now at the path was never touched
        expect = original.copy()
        expect[1001:6001] = patch
        expect = np.concatenate([expect[:199_995], patch[:10]])
        assert os.fstat(keep).st_size == 200_005
        np.testing.assert_array_equal(np.frombuffer(os.pread(keep, 300_000, 0), np.uint8), expect)
    finally:
        os.close(keep)


@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_file_is_used_after_a_symlink_replaces_its_path(io_dir, backend):
    path = os.path.join(io_dir, f"reg-sym-{backend}.bin")
    target = os.path.join(io_dir, f"target-{backend}.bin")
    original, other = random_bytes(70_000, 44), random_bytes(70_000, 45)
    for name, data in ((path, original), (target, other)):
        with open(name, "wb") as f:
            f.write(data.tobytes())
    with AioHandle(backend=backend) as h:
        h.register_file(path)
        os.unlink(path)
        os.symlink(target, path)
        out = np.zeros_like(original)
        h.async_pread(out, path)
        h.wait()
        np.testing.assert_array_equal(out, original)
        h.sync_pwrite(np.zeros(100, np.uint8), path, 0)
        np.testing.assert_array_equal(file_bytes(target, 0, 70_000), other)  # the symlink was not followed
        # Unregistered, the path is opened per request again, never through the symlink now there.
        h.unregister_file(path)
        with pytest.raises(AioError, match="symbolic link") as e:
            h.sync_pwrite(np.zeros(100, np.uint8), path, 0)
        assert e.value.errno == errno.ELOOP and e.value.filename == path
        np.testing.assert_array_equal(file_bytes(target, 0, 70_000), other)


def test_registration_rules(io_dir, monkeypatch):
    path = os.path.join(io_dir, "rules.bin")
    data = random_bytes(10_000, 46)
    fds = open_fds()
    h = AioHandle()
    h.sync_pwrite(data, path)
    monkeypatch.chdir(io_dir)
    h.register_file("./rules.bin", writable=False)  # relative, with "./": the same absolute path
    with pytest.raises(ValueError, match="already registered"):
        h.register_file(os.path.join(io_dir, "", "rules.bin"))
    with pytest.raises(AioError) as info:
        h.sync_pwrite(data, path)  # registered read-only
    assert info.value.errno == errno.EBADF and info.value.filename == path
    out = np.zeros_like(data)
    assert h.sync_pread(out, io_dir + "//rules.bin") == 1
    np.testing.assert_array_equal(out, data)
    h.unregister_file(path)
    with pytest.raises(ValueError, match="not registered"):
        h.unregister_file(path)
    missing = os.path.join(io_dir, "missing.bin")
    with pytest.raises(AioError) as info:
        h.register_file(missing, writable=False)
    assert info.value.errno == errno.ENOENT and info.value.filename == missing and info.value.op == "open"
    h.register_file(os.path.join(io_dir, "new.bin"))  # writable: created, mode 0600, empty
    assert os.stat(os.path.join(io_dir, "new.bin")).st_mode & 0o777 == 0o600
    assert os.path.getsize(os.path.join(io_dir, "new.bin")) == 0
    with pytest.raises(TypeError):
        h.register_file(3)
    h.close()
    with pytest.raises(ValueError, match="the aio Handle is closed"):
        h.register_file(path)
    assert open_fds() == fds


def test_concurrent_handles_in_threads(io_dir):
    errors = []
    shared = os.path.join(io_dir, "shared.bin")
    region = 1 << 20

    def worker(i: int) -> None:
        try:
            backend = BACKENDS[i % len(BACKENDS)]
            src = random_bytes(region - i, 100 + i)
            own = os.path.join(io_dir, f"thread-{i}.bin")
            with AioHandle(256 << 10, 8, intra_op_parallelism=1 + i % 2, backend=backend) as h:
                for _ in range(3):
                    h.async_pwrite(src, own, i)
                    # Disjoint, block-aligned regions of one file (unaligned neighbours that share a block
                    # are test_concurrent_writes_sharing_a_block's subject).
                    h.async_pwrite(src[: region - 4096], shared, i * region)
                    assert h.wait() == 2
                    a, b = np.empty_like(src), np.empty(region - 4096, np.uint8)
                    h.async_pread(a, own, i)
                    h.async_pread(b, shared, i * region)
                    assert h.wait() == 2
                    np.testing.assert_array_equal(a, src, err_msg=f"thread {i} ({backend}), own file")
                    np.testing.assert_array_equal(b, src[: region - 4096], err_msg=f"thread {i}, shared file")
            os.unlink(own)
        except BaseException as e:  # reported to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_threads_sharing_one_handle(io_dir):
    # Every thread's data is in place when its own wait() returns, whichever wait reaped its requests, and
    # the waits together count every request exactly once.
    path = os.path.join(io_dir, "shared-handle.bin")
    n, nthreads, rounds = 300_000, 4, 4
    counts, errors = [], []
    with AioHandle(64 << 10, 8, intra_op_parallelism=2) as h:

        def worker(i: int) -> None:
            try:
                src = random_bytes(n, 300 + i)
                for r in range(rounds):
                    off = (i * rounds + r) * (n + 4096) // 4096 * 4096
                    h.async_pwrite(src, path, off)
                    counts.append(h.wait())
                    dev, host = FakeDevice(n), np.empty(n, np.uint8)
                    h.async_pread(dev, path, off)
                    h.async_pread(host, path, off)
                    counts.append(h.wait())
                    np.testing.assert_array_equal(host, src)
                    np.testing.assert_array_equal(dev.mem.numpy(), src)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts.append(h.wait())
    assert not errors, errors
    assert sum(counts) == nthreads * rounds * 3


# -- bad buffers and arguments -------------------------------------------------------------------------------


def test_non_contiguous_tensor_is_refused(io_dir):
    path = os.path.join(io_dir, "nc.bin")
    t = torch.zeros(64, 64)[:, ::2]
    with AioHandle() as h:
        with pytest.raises(ValueError, match="not contiguous"):
            h.sync_pwrite(t, path)
        with pytest.raises(ValueError, match="not contiguous"):
            h.async_pread(t, path)
        assert h.pending() == 0


def test_non_contiguous_numpy_is_refused(io_dir):
    with AioHandle() as h, pytest.raises(ValueError, match="not C-contiguous"):
        h.sync_pwrite(np.zeros((8, 8))[:, 1], os.path.join(io_dir, "nc2.bin"))


def test_read_into_read_only_buffer_is_refused(io_dir):
    path = os.path.join(io_dir, "rofile.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    ro = np.zeros(100, np.uint8)
    ro.flags.writeable = False
    with AioHandle() as h:
        with pytest.raises(ValueError, match="read-only"):
            h.sync_pread(b"\0" * 100, path)
        with pytest.raises(ValueError, match="read-only"):
            h.async_pread(ro, path)
        assert h.pending() == 0


def test_bad_arguments(io_dir):
    path = os.path.join(io_dir, "args.bin")
    with AioHandle() as h:
        with pytest.raises(TypeError, match="not a usable I/O buffer"):
            h.sync_pwrite(object(), path)
        with pytest.raises(ValueError, match="file_offset must be >= 0"):
            h.sync_pwrite(bytearray(8), path, -1)
        with pytest.raises(TypeError, match="path or an open file descriptor"):
            h.sync_pwrite(bytearray(8), 3.5)
    with pytest.raises(ValueError, match="backend must be one of"):
        AioHandle(backend="spdk")
    with pytest.raises(ValueError, match="direct must be one of"):
        AioHandle(direct="maybe")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        AioHandle(block_size=0)


def test_buffers_are_kept_alive_until_wait(io_dir):
    path = os.path.join(io_dir, "alive.bin")
    random_bytes(1 << 20, 8).tofile(path)
    buf = np.zeros(1 << 20, np.uint8)
    ref = weakref.ref(buf)
    with AioHandle() as h:
        h.async_pread(buf, path)
        del buf  # the caller lets go; the kernel may still be writing into it
        gc.collect()
        assert ref() is not None
        kept = ref()
        h.wait()
        np.testing.assert_array_equal(kept, random_bytes(1 << 20, 8))
        del kept
        gc.collect()
        assert ref() is None  # released once the request was reaped


def test_dropping_a_handle_with_requests_in_flight(io_dir):
    path = os.path.join(io_dir, "dropped.bin")
    data = random_bytes(4 << 20, 12)
    fds = open_fds()
    h = AioHandle(intra_op_parallelism=2)
    for i in range(4):
        h.async_pwrite(data[i << 20 : (i + 1) << 20].copy(), path, i << 20)  # temporaries: only h holds them
    del h  # must finish the writes before it lets go of their buffers
    gc.collect()
    assert open_fds() == fds
    np.testing.assert_array_equal(file_bytes(path, 0, 4 << 20), data)


def test_buffer_cannot_be_resized_while_in_flight(io_dir):
    path = os.path.join(io_dir, "resize.bin")
    buf = bytearray(random_bytes(50_000, 4).tobytes())
    with AioHandle() as h:
        h.async_pwrite(buf, path)
        with pytest.raises(BufferError):
            buf.extend(b"more")  # the handle holds an export of the buffer until wait()
        h.wait()
        buf.extend(b"ok")  # released after wait()
    assert open(path, "rb").read() == bytes(buf[:50_000])


# -- device staging, exercised on CPU through a fake device -------------------------------------------------


def test_device_async_read_lands_after_wait(io_dir):
    n = 777_777
    path = os.path.join(io_dir, "dev.bin")
    data = random_bytes(n, 21)
    data.tofile(path)
    dev = FakeDevice(n)
    before = pinned_bytes_in_use()
    with AioHandle() as h:
        h.async_pread(dev, path)
        assert pinned_bytes_in_use() - before == n  # staged in pinned memory while in flight
        assert dev.from_host == 0 and not dev.mem.any()
        assert h.wait() == 1
        assert dev.from_host == 1
    assert pinned_bytes_in_use() == before
    assert all(a % (2 << 20) == 0 for a in dev.host_addrs)  # the staging buffer is a pinned 2 MiB aligned one
    assert np.array_equal(dev.mem.numpy(), data)


def test_device_sync_read_and_writes_copy_first(io_dir):
    n = 100_003
    path = os.path.join(io_dir, "dev2.bin")
    dev = FakeDevice(n)
    dev.mem.copy_(torch.from_numpy(random_bytes(n, 22)))
    original = dev.mem.clone()
    before = pinned_bytes_in_use()
    with AioHandle() as h:
        h.async_pwrite(dev, path)
        assert dev.to_host == 1  # device -> pinned before the request is queued
        dev.mem.zero_()  # so changing the device afterwards cannot change what is written
        h.wait()
        assert torch.equal(torch.from_numpy(file_bytes(path, 0, n).copy()), original)
        back = FakeDevice(n)
        assert h.sync_pread(back, path) == 1
        assert back.from_host == 1 and torch.equal(back.mem, original)
        h.sync_pwrite(back, path, n)
    assert pinned_bytes_in_use() == before
    np.testing.assert_array_equal(file_bytes(path, n, n), original.numpy())


def test_device_read_failure_leaves_device_untouched_and_frees_staging(io_dir):
    path = os.path.join(io_dir, "short.bin")
    random_bytes(10, 1).tofile(path)
    dev = FakeDevice(4096)
    before = pinned_bytes_in_use()
    with AioHandle() as h:
        with pytest.raises(OSError):
            h.async_pread(dev, path)
        assert h.pending() == 0
    assert dev.from_host == 0
    assert pinned_bytes_in_use() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_roundtrip(io_dir):
    path = os.path.join(io_dir, "cuda.bin")
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    with AioHandle() as h:
        h.async_pwrite(src, path)
        h.wait()
        h.async_pread(dst, path)
        h.wait()
        assert torch.equal(dst, src)
        dst.zero_()
        h.sync_pread(dst, path)
    assert torch.equal(dst, src)


# -- the demo (python -m offload.demo) ---------------------------------------------------------------------


def test_demo_round_trip_cleans_up(io_dir, capsys):
    from offload.demo import main

    before = set(os.listdir(io_dir))
    assert main(["--size", "3MiB", "--dir", io_dir, "--backend", BACKENDS[-1]]) == 0
    out = capsys.readouterr().out
    assert f"backend: {BACKENDS[-1]}" in out and "verified: 3145728 bytes bit-exact" in out
    assert "write:" in out and "read:" in out and "GB/s" in out
    assert set(os.listdir(io_dir)) == before  # its private directory is gone


def test_demo_size_parsing():
    import argparse

    from offload.demo import parse_size

    assert parse_size("1GiB") == 1 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("2 KiB") == 2048
    assert parse_size("1GB") == 10**9
    assert parse_size("4096") == 4096
    for bad in ("", "1 parsec", "-3M", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
