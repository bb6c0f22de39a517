"""Build the two torch-free C++ extensions: the async I/O core and the CPU optimizer kernels.

Only a C++17 compiler and the Python headers are required. Nothing here imports torch, links a system
library beyond libc/libpthread, or uses -march=native: ISA-specific kernels select themselves at run time.

The translation units of both extensions compile in one pool of ZO_BUILD_JOBS jobs (default: one per
core), the slowest first, so that no core idles while another finishes a long unit; the links follow.
"""

import glob
import json
import logging
import os
import subprocess
import threading
import time
from multiprocessing.pool import ThreadPool

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

COMMON_ARGS = ["-O3", "-fvisibility=hidden", "-fno-strict-aliasing", "-Wall", "-Wextra", "-pthread"]


# Flags appended for one translation unit after COMMON_ARGS (the last -O wins), measured in
# benchmarks/RESULTS.md ("Setup and build times"). The pybind11 glue converts arguments around calls that
# release the GIL: -O1 compiles it faster at the same per-call cost (-O0 triples the cost of a call). The
# AVX2 and AVX-512 optimizer kernels are explicit intrinsics, so -O3's extra loop passes buy them no
# measurable speed: -O2 compiles them faster. The scalar kernels keep -O3 (at -O2 the combinations that
# write a 16-bit param copy ran about 25% slower), as does everything else.
SIMD_KERNELS = ("kernels_avx2.cpp", "kernels_avx512.cpp")
OPTIMIZER_KERNELS = SIMD_KERNELS + ("kernels_scalar.cpp",)


def _unit_args(source: str) -> list:
    name = os.path.basename(source)
    if name == "bindings.cpp":
        return ["-O1"]
    if name in SIMD_KERNELS:
        return ["-O2"]
    return []


def _cost_rank(source: str) -> int:
    """Compile order, highest first: the bindings and the optimizer kernels (the longest units), the rest."""
    name = os.path.basename(source)
    return 2 if name == "bindings.cpp" else 1 if name in OPTIMIZER_KERNELS else 0


def _sources(directory: str) -> list:
    # Sanitizer test programs live in tests/ subfolders and are built by the test suite, not here.
    return sorted(glob.glob(os.path.join(directory, "*.cpp")))


def _jobs() -> int:
    jobs = int(os.environ.get("ZO_BUILD_JOBS", "0"))
    return jobs if jobs > 0 else (os.cpu_count() or 1)


def _run_measured(cmd, env=None) -> dict:
    """Runs one compiler command; returns its exit code, CPU seconds (user + system, of the compiler and
    its own children) and wall seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "wall_s": round(time.monotonic() - start, 2),
    }


class BuildExt(build_ext):
    """Runs every extension's compile step in one job pool, then every link.

    build_extension is run first with the compiler's compile and link recorded instead of run (the
    arguments are the ones setuptools computes for each extension); the recorded units then compile in
    one pool, slowest first, and the links run in order. Each unit's compile CPU and wall time are printed
    and written to <build_temp>/compile_times.json.
    """

    def build_extensions(self) -> None:
        compiler = self.compiler
        units, links = [], []

        def record_compile(
            sources,
            output_dir=None,
            macros=None,
            include_dirs=None,
            debug=False,
            extra_preargs=None,
            extra_postargs=None,
            depends=None,
        ):
            macros, objects, postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs
            )
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            for obj in objects:
                src, ext = build[obj]
                extra = postargs + _unit_args(src)
                units.append((obj, src, ext, cc_args, extra, pp_opts))
            return objects

        def record_link(*args, **kwargs):
            links.append((args, kwargs))

        compiler.compile = record_compile
        compiler.link_shared_object = record_link
        try:
            super().build_extensions()
        finally:
            del compiler.compile, compiler.link_shared_object
        units.sort(key=lambda unit: _cost_rank(unit[1]), reverse=True)
        times, lock = {}, threading.Lock()
        # setuptools runs a compile through compiler.call (newer) or compiler.spawn (older); either is
        # replaced by a measured run that fails the same way.
        runner = "call" if hasattr(compiler, "call") else "spawn"

        def measured(cmd, env=None, **kwargs):
            cmd = [str(arg) for arg in cmd]
            source = next((arg for arg in cmd if arg.endswith(".cpp")), cmd[0])
            self.announce(subprocess.list2cmdline(cmd), level=logging.INFO)  # as setuptools logs it
            result = _run_measured(cmd, env=env)
            if result["rc"] != 0:
                if runner == "call":
                    raise subprocess.CalledProcessError(result["rc"], cmd)
                from setuptools.errors import ExecError

                raise ExecError(f"command {cmd[0]!r} failed with exit code {result['rc']}")
            with lock:
                times[os.path.relpath(source)] = {"cpu_s": result["cpu_s"], "wall_s": result["wall_s"]}

        start = time.monotonic()
        setattr(compiler, runner, measured)
        try:
            with ThreadPool(min(_jobs(), max(len(units), 1))) as pool:
                for _ in pool.imap_unordered(lambda unit: compiler._compile(*unit), units):
                    pass
        finally:
            delattr(compiler, runner)
        wall = time.monotonic() - start
        for args, kwargs in links:
            compiler.link_shared_object(*args, **kwargs)
        if times:
            self._report_times(times, wall)

    def _report_times(self, times: dict, wall: float) -> None:
        total = sum(t["cpu_s"] for t in times.values())
        for source, t in sorted(times.items(), key=lambda item: -item[1]["cpu_s"]):
            print(f"compile {source}: {t['cpu_s']:.1f} s CPU, {t['wall_s']:.1f} s wall")
        print(f"compile total: {total:.1f} s CPU, {wall:.1f} s wall, {len(times)} units, {_jobs()} jobs")
        os.makedirs(self.build_temp, exist_ok=True)
        with open(os.path.join(self.build_temp, "compile_times.json"), "w") as f:
            json.dump({"units": times, "cpu_s": round(total, 2), "wall_s": round(wall, 2)}, f, indent=1)


EXTENSIONS = {
    "aio": Pybind11Extension(
        "offload._aio",
        _sources("aio_csrc"),
        include_dirs=["aio_csrc"],
        cxx_std=17,
        extra_compile_args=COMMON_ARGS,
        extra_link_args=["-pthread"],
    ),
    "ops": Pybind11Extension(
        "offload._cpu_optim",
        _sources("ops_csrc"),
        include_dirs=["ops_csrc"],
        cxx_std=17,
        extra_compile_args=COMMON_ARGS,
        extra_link_args=["-pthread"],
    ),
}

# Developers may rebuild one extension while another is mid-edit: ZO_BUILD_ONLY=aio or ZO_BUILD_ONLY=ops.
_only = os.environ.get("ZO_BUILD_ONLY")
ext_modules = [EXTENSIONS[_only]] if _only else list(EXTENSIONS.values())

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
