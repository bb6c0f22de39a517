"""Short measurements of this machine that the planner (offload.estimate.plan) predicts step times with:
the CPU optimizer's update rate, the compute device's matmul rate at the model's shapes, and on a GPU the
host<->device copy bandwidth. Each probe runs for well under a second; `probe_machine` runs them all.

The disk's bandwidths come from a machine profile written by `ds-nvme-bench --json`
(offload.estimate.machine); a `ComputeProfile` saved as JSON (`to_dict`) can be given back to the planner
instead of probing again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Optional

__all__ = [
    "ComputeProfile",
    "load_compute_profile",
    "probe_cpu_optimizer",
    "probe_host_copy",
    "probe_host_device",
    "probe_machine",
    "probe_matmul",
]


@dataclass(frozen=True)
class ComputeProfile:
    """Measured rates: `cpu_optimizer_elems_per_s` (fused AdamW elements updated per second on the CPU),
    `matmul_flops` (FLOP/s of a matmul of the model's shape on `device`, in `dtype`), and on a GPU the
    host-to-device and device-to-host copy bandwidths (decimal GB/s, pinned memory)."""

    cpu_optimizer_elems_per_s: float
    matmul_flops: float
    device: str = "cpu"
    dtype: str = "fp32"
    h2d_gbps: Optional[float] = None
    d2h_gbps: Optional[float] = None
    host_copy_gbps: Optional[float] = None  # host memory to host memory (a stage-3 gather's copy)
    threads: int = 1
    sources: Dict[str, str] = field(default_factory=dict, compare=False)

    def to_dict(self) -> Dict[str, Any]:
        """The fields by name (what `load_compute_profile` reads back)."""
        return asdict(self)


def load_compute_profile(data: Dict[str, Any]) -> ComputeProfile:
    """A ComputeProfile from `to_dict`'s output; ValueError naming a missing or non-positive rate."""
    for name in ("cpu_optimizer_elems_per_s", "matmul_flops"):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"compute profile: {name} must be a positive number, got {value!r}")
    known = {k: v for k, v in data.items() if k in ComputeProfile.__dataclass_fields__}
    return ComputeProfile(**known)


def _best_of(fn: Callable[[], None], seconds: float, sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds of one call of `fn`, over calls for about `seconds` (after one warm-up)."""
    fn()
    sync()
    times = []
    deadline = time.perf_counter() + seconds
    while not times or (time.perf_counter() < deadline and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_cpu_optimizer(numel: int = 1 << 22, seconds: float = 0.3) -> float:
    """Elements per second the CPU AdamW kernel (offload.ops) updates: fp32 master, two fp32 states."""
    import torch

    from offload.ops.adam import CPUAdamW

    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    opt = CPUAdamW([p], lr=1e-4)
    return numel / _best_of(opt.step, seconds)


def probe_matmul(
    m: int, k: int, n: int, device: str = "cpu", dtype: str = "fp32", seconds: float = 0.3
) -> float:
    """FLOP/s of a (m x k) @ (k x n) matmul on `device` in `dtype` ("fp32", "bf16", "fp16")."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(m, k, device=device).to(dt)
    b = torch.randn(k, n, device=device).to(dt)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return 2.0 * m * k * n / _best_of(lambda: torch.mm(a, b), seconds, sync)


def probe_host_copy(nbytes: int = 64 << 20, seconds: float = 0.2) -> float:
    """Host memory copy bandwidth (decimal GB/s): one `nbytes` tensor into another."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    return nbytes / _best_of(lambda: dst.copy_(src), seconds) / 1e9


def probe_host_device(nbytes: int = 256 << 20, seconds: float = 0.3) -> Dict[str, float]:
    """Pinned host <-> CUDA device 0 copy bandwidth, {"h2d_gbps", "d2h_gbps"} in decimal GB/s."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = nbytes / _best_of(lambda: dev.copy_(host, non_blocking=True), seconds, sync) / 1e9
    d2h = nbytes / _best_of(lambda: host.copy_(dev, non_blocking=True), seconds, sync) / 1e9
    return {"h2d_gbps": h2d, "d2h_gbps": d2h}


def probe_machine(
    tokens: int = 512, hidden: int = 1024, dtype: str = "fp32", device: Optional[str] = None
) -> ComputeProfile:
    """Every probe, in about two seconds: the CPU optimizer, a host memory copy, a matmul of a transformer
    MLP's shape (`tokens` x `hidden` by `hidden` x 4 `hidden`) on the compute device (CUDA device 0 when
    there is one, else the CPU), and on a GPU the host<->device copies."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rate = probe_cpu_optimizer()
    flops = probe_matmul(max(1, tokens), hidden, 4 * hidden, device, dtype)
    sources = {
        "cpu_optimizer_elems_per_s": "probe: CPUAdamW on 4M elements",
        "matmul_flops": f"probe: {tokens}x{hidden} @ {hidden}x{4 * hidden} {dtype} on {device}",
    }
    copies: Dict[str, Optional[float]] = {"h2d_gbps": None, "d2h_gbps": None}
    copies["host_copy_gbps"] = probe_host_copy()
    sources["host_copy_gbps"] = "probe: 64 MiB host copy"
    if device.startswith("cuda"):
        copies.update(probe_host_device())
        sources["h2d_gbps"] = sources["d2h_gbps"] = "probe: 256 MiB pinned copies"
    return ComputeProfile(
        cpu_optimizer_elems_per_s=rate,
        matmul_flops=flops,
        device="cuda" if device.startswith("cuda") else "cpu",
        dtype=dtype,
        threads=torch.get_num_threads(),
        sources=sources,
        **copies,
    )
