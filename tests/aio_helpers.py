"""Helpers for the async I/O and pinned memory tests: resource snapshots, privilege-dropping children."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from offload.aio import DeviceBuffer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO, "aio_csrc")


def open_fds() -> int:
    """Open fds of this process, counted after CUDA is up: pinned buffers are registered with CUDA when a
    GPU is present, and the first registration opens the driver's device files for the process's life."""
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # creates the context once; a no-op afterwards
    return len(os.listdir("/proc/self/fd"))


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def unaligned(n: int, misalign: int) -> np.ndarray:
    """A writable uint8 array of n bytes whose address is `misalign` bytes past a 4 KiB boundary."""
    base = np.zeros(n + 8192, dtype=np.uint8)
    start = (-base.ctypes.data) % 4096 + misalign
    out = base[start : start + n]
    assert out.ctypes.data % 4096 == misalign % 4096
    return out


def file_bytes(path: str, offset: int, n: int) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(n), dtype=np.uint8)


def run_child(body: str, *, prelude: str = "", timeout: float = 60.0) -> Dict[str, Any]:
    """Run `body` in a fresh Python with the repo importable; it must assign a JSON-able dict to `result`.

    A child process is how the fault tests change credentials or resource limits without touching the test
    process. `prelude` runs first, outside the try (a failure there fails the test loudly). The child reports
    exceptions as {"exc": name, "errno": ..., "str": ...}.
    """
    script = (
        textwrap.dedent(prelude) + "\n"
        "import json, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "result = {}\n"
        "try:\n" + textwrap.indent(textwrap.dedent(body), "    ") + "\n"
        "except BaseException as e:\n"
        "    result = {'exc': type(e).__name__, 'errno': getattr(e, 'errno', None), 'str': str(e),\n"
        "              'filename': getattr(e, 'filename', None), 'op': getattr(e, 'op', None), **result}\n"
        "print('RESULT ' + json.dumps(result))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


# Child-process prelude that makes the kernel refuse io_uring_setup and/or io_setup with ENOSYS (seccomp), as
# a kernel without those syscalls (or with io_uring disabled by sysctl) would. x86_64 syscall numbers.
SECCOMP_DENY = """
import ctypes, platform
assert platform.machine() == "x86_64"
NRS = {"io_uring": 425, "aio": 206}
deny = [NRS[name] for name in DENY]

class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]

class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
ALLOW, ERRNO_ENOSYS = 0x7FFF0000, 0x00050000 | 38
n = len(deny)
prog = [SockFilter(LD_ABS, 0, 0, 4), SockFilter(JEQ, 0, n + 1, 0xC000003E), SockFilter(LD_ABS, 0, 0, 0)]
prog += [SockFilter(JEQ, n - i, 0, nr) for i, nr in enumerate(deny)]
prog += [SockFilter(RET, 0, 0, ALLOW), SockFilter(RET, 0, 0, ERRNO_ENOSYS)]
arr = (SockFilter * len(prog))(*prog)
fprog = SockFprog(len(prog), arr)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS"
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, "PR_SET_SECCOMP: errno %d" % ctypes.get_errno()
"""


class FakeDevice(DeviceBuffer):
    """Device memory simulated by a private CPU tensor; records the staging copies."""

    def __init__(self, nbytes: int) -> None:
        self.mem = torch.zeros(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.to_host = 0
        self.from_host = 0
        self.host_addrs = []

    def copy_to_host(self, host: torch.Tensor) -> None:
        assert host.dtype == torch.uint8 and host.numel() == self.nbytes
        self.host_addrs.append(host.data_ptr())
        host.copy_(self.mem)
        self.to_host += 1

    def copy_from_host(self, host: torch.Tensor) -> None:
        assert host.dtype == torch.uint8 and host.numel() == self.nbytes
        self.host_addrs.append(host.data_ptr())
        self.mem.copy_(host)
        self.from_host += 1


def build_core_program(tmp_path: Any, main_source: str, sanitize_flags: List[str]) -> str:
    """The C++ core (without its Python bindings) and `main_source`, built with `sanitize_flags` into
    `tmp_path`; skips when g++ is missing (or, for ThreadSanitizer, when this toolchain cannot link it)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot build the sanitizer test program")
    flags = ["-std=c++17", *sanitize_flags, "-fno-omit-frame-pointer", "-g", "-O1", "-pthread", "-I", CSRC]
    sources = [s for s in sorted(glob.glob(os.path.join(CSRC, "*.cpp"))) if not s.endswith("bindings.cpp")]
    sources.append(main_source)

    def compile_one(src: str) -> str:
        obj = str(tmp_path / (os.path.basename(src) + ".o"))
        res = subprocess.run([gxx, *flags, "-c", src, "-o", obj], capture_output=True, text=True)
        assert res.returncode == 0, f"compiling {src} failed:\n{res.stderr}"
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, sources))
    exe = str(tmp_path / os.path.splitext(os.path.basename(main_source))[0])
    res = subprocess.run([gxx, *flags, *objects, "-o", exe], capture_output=True, text=True)
    if res.returncode != 0 and "tsan" in res.stderr.lower():
        pytest.skip(f"this toolchain cannot link a ThreadSanitizer program:\n{res.stderr[-2000:]}")
    assert res.returncode == 0, f"linking failed:\n{res.stderr}"
    return exe
