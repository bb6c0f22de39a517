"""Run-time switches of the C++ kernels: SIMD level, thread count, non-temporal store policy.

Imported once by offload.ops: it sets the thread count to torch's intra-op thread count (so the optimizer
uses the cores torch was told to use) and applies ZO_SIMD when set, so a test or a user can force one
ISA path for the whole process.
"""

from __future__ import annotations

import os

import torch

from offload import _cpu_optim

SIMD_LEVELS = ("scalar", "avx2", "avx512")


def simd_level() -> str:
    """The instruction set the kernels use now: "avx512", "avx2" or "scalar"."""
    return _cpu_optim.simd_level()


def best_simd_level() -> str:
    """The best instruction set this CPU supports (what "auto" selects)."""
    return _cpu_optim.best_simd_level()


def available_simd_levels() -> list[str]:
    """Every level this CPU can run, from "scalar" up to best_simd_level()."""
    return list(SIMD_LEVELS[: SIMD_LEVELS.index(best_simd_level()) + 1])


def force_simd_level(level: str | None) -> str:
    """Use one ISA path ("scalar", "avx2", "avx512") for all later steps; None or "auto" picks the best.

    Raises ValueError for an unknown name or a level this CPU cannot run. Returns the previous level, so
    a caller can restore it.
    """
    previous = simd_level()
    _cpu_optim.set_simd_level("auto" if level is None else str(level))
    return previous


STREAM_POLICIES = ("none", "copy", "all")


def stream_policy() -> str:
    """Which stores go out non-temporal: "none" (the default), "copy" or "all"."""
    return _cpu_optim.stream_policy()


def set_stream_policy(policy: str) -> str:
    """Choose the non-temporal store policy for later steps; returns the previous one.

    "none" (the default) streams nothing; "copy" streams the write-only 16-bit param copy; "all" also
    streams the param and the states, which is much slower on the machines measured (a streaming store to
    a line just read evicts it). The other two exist for benchmarks; results are bit-identical under all
    three. Raises ValueError for another name.
    """
    previous = stream_policy()
    _cpu_optim.set_stream_policy(str(policy))
    return previous


def set_num_threads(n: int) -> None:
    """Threads used by every optimizer step (the calling thread counts as one). Takes effect at once."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"num_threads must be an int, got {type(n).__name__}")
    _cpu_optim.set_num_threads(n)


def get_num_threads() -> int:
    return _cpu_optim.get_num_threads()


def _init_from_environment() -> None:
    set_num_threads(max(1, torch.get_num_threads()))
    forced = os.environ.get("ZO_SIMD")
    if forced:
        try:
            force_simd_level(forced)
        except ValueError as exc:
            raise ValueError(f"ZO_SIMD={forced!r}: {exc}") from None


_init_from_environment()
