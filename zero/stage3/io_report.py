"""ParamIOReport: what the stage-3 parameter tier read, wrote, prefetched and gathered over an interval.

`take_io_report(part)` (Stage3Partitioner.take_io_report) collects the counts of the partitioner, its
store, gradient reduction and hooks, and starts them afresh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

__all__ = ["ParamIOReport", "take_io_report"]


@dataclass
class ParamIOReport:
    """The parameter tier's counts over one interval (`Stage3Partitioner.take_io_report`)."""

    param_nvme_read_bytes: int = 0
    param_nvme_write_bytes: int = 0
    param_cpu_read_bytes: int = 0  # read from partitions in host memory (cpu tier, nvme's max_in_cpu share)
    param_reads: int = 0  # partition reads from NVMe (prefetched or on demand)
    param_prefetches: int = 0
    param_prefetch_hits: int = 0  # gathers that found their prefetch done or in flight
    gathers: int = 0  # units made whole
    peak_full_bytes: int = 0  # most bytes of whole (gathered) units alive at once, over the interval
    device_to_host_bytes: int = 0  # gradients copied to the host partition parameter by parameter
    host_to_device_bytes: int = 0  # partitions copied from host memory (tier or staging slot) to a GPU
    peak_prefetch_depth: int = 0  # most prefetches in flight at once over the interval
    peak_read_ahead_bytes: int = 0  # most bytes of host partitions copied ahead to the device at once
    param_staged_bytes: int = 0  # NVMe bytes copied out of a staging slot into a gathered buffer
    param_in_place_bytes: int = 0  # NVMe bytes used where they landed: viewed (or decoded) in a staging slot
    param_direct_bytes: int = 0  # NVMe bytes read straight into a gathered buffer in host memory
    param_read_wait_s: float = 0.0  # seconds gathers blocked on NVMe reads (not hidden by a prefetch)
    # partition writes left in flight (zero.stage3.write_back): bytes queued without waiting, most at once,
    # still in flight when the report was taken (after a step: the ones the next forward overlaps), seconds
    # spent waiting for them, and failed ones written again
    param_async_write_bytes: int = 0
    param_peak_writes_in_flight: int = 0
    param_writes_in_flight: int = 0
    param_write_wait_s: float = 0.0
    param_write_retries: int = 0
    quantized_matmuls: int = 0  # Linear/Conv1D/Embedding forwards computed from quantized codes (fused.py)
    quantized_block_matmuls: int = 0  # of those, Linear/Conv1D forwards decoded block by block for a GEMM
    transposed_linears: int = 0  # fp32 Linear forwards computed as (W x^T)^T, same bits (linear_layout.py)

    def as_dict(self) -> Dict[str, Any]:
        """The counts by field name."""
        return asdict(self)


def take_io_report(part: Any) -> ParamIOReport:
    """`part`'s (a Stage3Partitioner's) counts since the last call (or since construction), and start
    counting afresh."""
    st = part.store.stats
    layouts = part.hooks.layouts if part.hooks is not None else None
    report = ParamIOReport(
        param_nvme_read_bytes=st.bytes_read,
        param_nvme_write_bytes=st.bytes_written,
        param_cpu_read_bytes=st.cpu_bytes_read,
        param_reads=st.reads,
        param_prefetches=st.prefetches,
        param_prefetch_hits=st.prefetch_hits,
        gathers=part.gathers,
        peak_full_bytes=part.peak_full_bytes,
        device_to_host_bytes=part.grads.device_to_host_bytes,
        host_to_device_bytes=part.host_to_device_bytes,
        peak_prefetch_depth=st.peak_inflight,
        peak_read_ahead_bytes=st.peak_ahead_bytes,
        param_staged_bytes=st.staged_bytes,
        param_in_place_bytes=st.in_place_bytes,
        param_direct_bytes=st.direct_bytes,
        param_read_wait_s=st.read_wait_s,
        param_async_write_bytes=st.async_bytes_written,
        param_peak_writes_in_flight=st.peak_writes_in_flight,
        param_writes_in_flight=part.store.write_back.in_flight,
        param_write_wait_s=st.write_wait_s,
        param_write_retries=st.write_retries,
        quantized_matmuls=part.hooks.fused.forwards if part.hooks is not None else 0,
        quantized_block_matmuls=part.hooks.fused.block_forwards if part.hooks is not None else 0,
        transposed_linears=layouts.transposed if layouts is not None else 0,
    )
    st.bytes_read = st.bytes_written = st.reads = st.prefetches = st.prefetch_hits = st.cpu_bytes_read = 0
    st.staged_bytes = st.in_place_bytes = st.direct_bytes = 0
    st.read_wait_s = st.write_wait_s = 0.0
    st.async_writes = st.async_bytes_written = st.write_retries = 0
    st.peak_writes_in_flight = part.store.write_back.in_flight
    st.peak_inflight = len([u for u in part.units if part.store.prefetching(u)])
    st.peak_ahead_bytes = st.ahead_bytes
    part.gathers = part.grads.device_to_host_bytes = part.host_to_device_bytes = 0
    if part.hooks is not None:
        part.hooks.fused.forwards = part.hooks.fused.block_forwards = 0
    if layouts is not None:
        layouts.transposed = 0
    part.peak_full_bytes = part.live_full_bytes
    return report
