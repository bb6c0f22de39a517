"""AioHandle against misuse and hostile files: files named relative to a held directory, NUL bytes in names,
meta tensors, and memory released while a request into it is in flight."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from offload import _aio
from offload.aio import AioError, AioHandle, FileInDir
from tests.aio_helpers import file_bytes, random_bytes, run_child

BACKENDS = _aio.available_backends()


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_of_a_held_directory_survive_its_replacement(tmp_path, backend):
    """The directory renamed away and one of symlinks (named like its files) put in its place: reads and
    writes, registered or not, still reach the files of the directory held open."""
    d, victim = tmp_path / "private", tmp_path / "victim"
    d.mkdir(mode=0o700)
    victim_bytes = random_bytes(50_000, 1)
    victim.write_bytes(victim_bytes.tobytes())
    data = random_bytes(50_000, 2)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        a, b = FileInDir(dfd, "a", str(d / "a")), FileInDir(dfd, "b", str(d / "b"))
        with AioHandle(backend=backend) as h:
            h.sync_pwrite(data, a, 0)
            h.sync_pwrite(data, b, 0)
            h.register_file(b)
            os.rename(d, tmp_path / "moved")
            d.mkdir()
            for name in ("a", "b"):
                os.symlink(victim, d / name)
            patch = random_bytes(1000, 3)
            h.sync_pwrite(patch, a, 7)  # unaligned: read-modify-write of the held file
            h.async_pwrite(patch, b, 7)
            h.wait()
            want = data.copy()
            want[7:1007] = patch
            out = np.zeros_like(data)
            h.sync_pread(out, a, 0)
            np.testing.assert_array_equal(out, want)
            h.unregister_file(b)
            # A symlink inside the held directory itself is refused, never followed.
            os.symlink(victim, tmp_path / "moved" / "link")
            with pytest.raises(AioError, match="symbolic link") as e:
                h.sync_pwrite(patch, FileInDir(dfd, "link", "link"), 0)
            assert e.value.errno == errno.ELOOP
    finally:
        os.close(dfd)
    np.testing.assert_array_equal(file_bytes(str(tmp_path / "moved" / "a"), 0, 50_000), want)
    np.testing.assert_array_equal(file_bytes(str(tmp_path / "moved" / "b"), 0, 50_000), want)
    np.testing.assert_array_equal(file_bytes(str(victim), 0, 50_000), victim_bytes)


def test_names_with_a_nul_byte_are_refused(tmp_path):
    """A NUL would cut the name short in the kernel (a different file): ValueError, nothing created."""
    path = str(tmp_path / "real")
    buf = np.zeros(10, np.uint8)
    with AioHandle() as h:
        for target in (path + "\0.tmp", os.fsencode(path) + b"\0x"):
            with pytest.raises(ValueError, match="NUL byte"):
                h.sync_pwrite(buf, target, 0)
            with pytest.raises(ValueError, match="NUL byte"):
                h.register_file(target)
        # The core checks too, whoever calls it.
        with pytest.raises(ValueError, match="NUL byte"):
            h._h.pwrite(buf.ctypes.data, 10, path + "\0.tmp", 0, False)
        with pytest.raises(ValueError, match="plain file name"):
            h.sync_pwrite(buf, FileInDir(os.open(tmp_path, os.O_RDONLY), "a\0b"), 0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("op", ["sync_pread", "async_pread", "sync_pwrite", "async_pwrite"])
def test_meta_tensors_are_refused(tmp_path, op):
    path = tmp_path / "f"
    path.write_bytes(b"\1" * 64)
    with AioHandle() as h:
        with pytest.raises(ValueError, match="meta tensor"):
            getattr(h, op)(torch.empty(16, dtype=torch.float32, device="meta"), str(path), 0)
        assert h.wait() == 0
    assert path.read_bytes() == b"\1" * 64


RELEASE_IN_FLIGHT = """
import os
import numpy as np
from offload import _aio
from offload.aio import AioHandle
from offload.pinned import alloc_host_buffer
path, n = PATH, 1 << 20
want = np.frombuffer(open(path, "rb").read(), np.uint8)
h = AioHandle(backend=BACKEND)
h._h._set_paused(True)  # the request stays queued until released below
if KIND == "pinned":
    mem = _aio.alloc_pinned(n + 4096, 4096, False, False, "none")
    h.async_pread(memoryview(mem)[1 : n + 1], path, 0)  # unaligned: copied out of a bounce buffer
    view = lambda: np.frombuffer(memoryview(mem), np.uint8)[1 : n + 1]
else:
    mem = alloc_host_buffer(n + 4096, lock=False)
    arr = mem.as_ctypes()
    h.async_pread(memoryview(arr)[1 : n + 1], path, 0)
    view = lambda: np.frombuffer(arr, np.uint8)[1 : n + 1]
mem.release()  # still in flight: the memory stays until the request is done
result["released"] = bool(mem.released)
h._h._set_paused(False)
result["done"] = h.wait()
h.close()
result["survived"] = True
"""


@pytest.mark.parametrize("kind", ["pinned", "host"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_releasing_pinned_memory_while_a_read_is_in_flight(tmp_path, kind, backend):
    """release() of a PinnedBuffer / HostBuffer whose memory a queued read targets: the process survives and
    the read completes (the memory is unmapped once it is done)."""
    path = tmp_path / "data"
    path.write_bytes(random_bytes(1 << 20, 4).tobytes())
    body = RELEASE_IN_FLIGHT.replace("PATH", repr(str(path))).replace("BACKEND", repr(backend))
    got = run_child(body.replace("KIND", repr(kind)))
    assert got == {"released": True, "done": 1, "survived": True}


def test_a_held_pinned_buffer_is_unmapped_once_the_hold_ends():
    mem = _aio.alloc_pinned(1 << 16, 4096, False, False, "none")
    mem.hold_io()
    mem.release()
    assert mem.released
    with pytest.raises(BufferError):  # no new request can target it
        memoryview(mem)
    with pytest.raises(ValueError, match="released"):
        mem.hold_io()
    mem.unhold_io()
    with pytest.raises(ValueError, match="without a matching hold_io"):
        mem.unhold_io()
