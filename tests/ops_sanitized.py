"""Builds a C++ test program against the CPU kernels (every ops_csrc/*.cpp but the bindings) with
AddressSanitizer + UndefinedBehaviorSanitizer, runs it, and fails the calling test on any sanitizer report,
a non-zero exit or a missing "ALL OK"; returns the program's stdout."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

OPS_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops_csrc")
FLAGS = ["-std=c++17", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
FLAGS += ["-g1", "-O1", "-pthread", "-I", OPS_CSRC]


def run_sanitized(program: str, tmp_path) -> str:
    """`program`: a file name under ops_csrc/tests."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot build the sanitizer test program")
    sources = [
        s for s in sorted(glob.glob(os.path.join(OPS_CSRC, "*.cpp"))) if not s.endswith("bindings.cpp")
    ]
    sources.append(os.path.join(OPS_CSRC, "tests", program))

    def compile_one(src: str) -> str:
        obj = str(tmp_path / (os.path.basename(src) + ".o"))
        res = subprocess.run([gxx, *FLAGS, "-c", src, "-o", obj], capture_output=True, text=True)
        assert res.returncode == 0, f"compiling {src} failed:\n{res.stderr[-4000:]}"
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, sources))
    exe = str(tmp_path / os.path.splitext(program)[0])
    res = subprocess.run([gxx, *FLAGS, *objects, "-o", exe], capture_output=True, text=True)
    assert res.returncode == 0, f"linking failed:\n{res.stderr[-4000:]}"
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0:exitcode=66"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    run = subprocess.run([exe], capture_output=True, text=True, timeout=600, env=env)
    report = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-8000:]}"
    for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer"):
        assert marker not in run.stderr, report
    assert run.returncode == 0, report
    assert "ALL OK" in run.stdout, report
    return run.stdout
