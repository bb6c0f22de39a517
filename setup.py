"""Build the two torch-free C++ extensions: the async I/O core and the CPU optimizer kernels.

Only a C++17 compiler and the Python headers are required. Nothing here imports torch, links a system
library beyond libc/libpthread, or uses -march=native: ISA-specific kernels select themselves at run time.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Each extension's translation units compile in parallel: ZO_BUILD_JOBS=N jobs (default: one per core).
ParallelCompile("ZO_BUILD_JOBS", default=0).install()

COMMON_ARGS = ["-O3", "-fvisibility=hidden", "-fno-strict-aliasing", "-Wall", "-Wextra", "-pthread"]


def _sources(directory: str) -> list:
    # Sanitizer test programs live in tests/ subfolders and are built by the test suite, not here.
    return sorted(glob.glob(os.path.join(directory, "*.cpp")))


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

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
