"""Bandwidth of the other links of the tier chain: pinned host memory copies, and host <-> GPU copies."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

GB = 1e9


@dataclass
class CopyResults:
    """Measured copy bandwidths in GB/s (None where not measured: no GPU), the GPU's memory size, notes."""

    host_copy_gbps: Optional[float] = None
    h2d_gbps: Optional[float] = None
    d2h_gbps: Optional[float] = None
    h2d_pageable_gbps: Optional[float] = None
    d2h_pageable_gbps: Optional[float] = None
    gpu_bytes: int = 0
    gpu_name: Optional[str] = None
    notes: List[str] = field(default_factory=list)


def _median_seconds(run: Callable[[], float], repeats: int) -> float:
    run()  # first touch of pages and lazy CUDA setup are not bandwidth
    return statistics.median(run() for _ in range(max(1, repeats)))


def measure_host_copy(nbytes: int, repeats: int) -> float:
    """GB/s of copying between two of our pinned buffers (the staging -> optimizer-state hop).

    Bytes are counted once (not read + write), so the number compares directly with the I/O bandwidths.
    """
    import torch

    from offload.pinned import PinnedPool

    pool = PinnedPool(2 * nbytes)
    src = pool.allocate(nbytes, torch.uint8)
    dst = pool.allocate(nbytes, torch.uint8)
    try:
        src.fill_(7)
        dst.zero_()

        def run() -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

        seconds = _median_seconds(run, repeats)
        if not torch.equal(dst[:: 1 << 16], src[:: 1 << 16]):
            raise RuntimeError("host copy between pinned buffers did not copy the data")
        return nbytes / seconds / GB
    finally:
        pool.free(src)
        pool.free(dst)


def measure_cuda_copies(nbytes: int, repeats: int, results: CopyResults) -> None:
    """Host -> GPU and GPU -> host GB/s, from pinned and from pageable host memory (CUDA events)."""
    import torch

    if not torch.cuda.is_available():
        results.notes.append("no CUDA device: host<->GPU copies not measured (gpu_bytes 0)")
        return
    from offload.pinned import PinnedPool

    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    results.gpu_bytes = int(props.total_memory)
    results.gpu_name = props.name
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pool = PinnedPool(nbytes)
    ours = pool.allocate(nbytes, torch.uint8)
    try:
        pinned = ours
        if not ours.is_pinned():
            # Page-locked for the kernel but not registered with CUDA: the driver would stage it like
            # pageable memory, so measure the pinned path with a CUDA-registered buffer and say so.
            results.notes.append(
                "our pinned buffers are not CUDA-registered: pinned copies used torch pin_memory"
            )
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pinned.fill_(3)
        pageable.fill_(5)
        stream = torch.cuda.current_stream(device)

        def timed(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
            def run() -> float:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                # Asynchronous only from/to pinned memory; from pageable memory the copy is synchronous
                # anyway, and a non-blocking copy into pageable memory could be read before it lands.
                dst.copy_(src, non_blocking=dst.is_pinned() or src.is_pinned())
                end.record(stream)
                end.synchronize()
                return start.elapsed_time(end) / 1e3

            return run

        rates: Dict[str, float] = {}
        for name, dst, src in (
            ("h2d_gbps", gpu, pinned),
            ("d2h_gbps", pinned, gpu),
            ("h2d_pageable_gbps", gpu, pageable),
            ("d2h_pageable_gbps", pageable, gpu),
        ):
            rates[name] = nbytes / _median_seconds(timed(dst, src), repeats) / GB
        for name, value in rates.items():
            setattr(results, name, value)
    finally:
        del gpu
        pool.free(ours)
        torch.cuda.empty_cache()


def measure_copies(nbytes: int, repeats: int) -> CopyResults:
    """Host-to-host and, with a GPU, pinned and pageable host<->device copy bandwidths of `nbytes`, best of
    `repeats`."""
    results = CopyResults()
    results.host_copy_gbps = measure_host_copy(nbytes, repeats)
    measure_cuda_copies(nbytes, repeats, results)
    return results
