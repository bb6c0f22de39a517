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
from typing import Any, Callable, Dict, List, Optional

__all__ = [
    "ComputeProfile",
    "load_compute_profile",
    "probe_cpu_optimizer",
    "probe_device_optimizer",
    "probe_host_copy",
    "probe_host_device",
    "probe_machine",
    "probe_matmul",
    "probe_training_block",
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
    # FLOP/s of one transformer block's forward + backward at the model's shape (probe_training_block):
    # the matmul rate less what norms, activations, attention and autograd cost around the matmuls
    train_flops: Optional[float] = None
    # elements per second the device's fused AdamW updates (a GPU; None: not probed): the device share of
    # offload_optimizer.ratio below 1 steps at this rate
    device_optimizer_elems_per_s: Optional[float] = None
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


def _best_of(
    fn: Callable[[], None], seconds: float, sync: Callable[[], None] = lambda: None, min_calls: int = 1
) -> float:
    """Median seconds of one call of `fn`, over calls for about `seconds` and at least `min_calls` (after
    one warm-up)."""
    fn()
    sync()
    times: List[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_calls or (time.perf_counter() < deadline and len(times) < 50):
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


def block_flops_per_token(hidden: int, seq_len: int) -> float:
    """Matmul FLOPs of one pre-LN transformer block's forward for one token: 2 per weight (12 hidden^2:
    QKV, output projection, a 4x MLP) plus attention's 4 x seq x hidden."""
    return 2.0 * 12 * hidden * hidden + 4.0 * seq_len * hidden


def probe_training_block(
    tokens: int,
    hidden: int,
    seq_len: int,
    heads: Optional[int] = None,
    device: str = "cpu",
    dtype: str = "fp32",
    max_flops: float = 2e10,
) -> float:
    """FLOP/s (counted as `block_flops_per_token` x 3 per token) of a pre-LN transformer block's forward +
    backward at the model's shape (`hidden`, `seq_len`, `heads`; sequences of `seq_len` making up about
    `tokens`, fewer when one pass would exceed `max_flops`), on `device` in `dtype`: the rate a training
    step's compute runs at, norms, GELU, softmax and autograd included."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    heads = heads or max(1, hidden // 64)
    per_token = 3.0 * block_flops_per_token(hidden, seq_len)
    seq = max(1, min(seq_len, int(max_flops // per_token)))  # a shorter sequence when one is too long
    seqs = max(1, min(max(1, tokens // seq), int(max_flops // (per_token * seq))))
    kw = {"device": device, "dtype": dt}
    ln1, ln2 = torch.nn.LayerNorm(hidden, **kw), torch.nn.LayerNorm(hidden, **kw)
    qkv, proj = torch.nn.Linear(hidden, 3 * hidden, **kw), torch.nn.Linear(hidden, hidden, **kw)
    up, down = torch.nn.Linear(hidden, 4 * hidden, **kw), torch.nn.Linear(4 * hidden, hidden, **kw)
    x = torch.randn(seqs, seq, hidden, **kw, requires_grad=True)

    def step() -> None:
        q, k, v = qkv(ln1(x)).view(seqs, seq, 3, heads, hidden // heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = x + proj(a.transpose(1, 2).reshape(seqs, seq, hidden))
        out = h + down(torch.nn.functional.gelu(up(ln2(h))))
        out.float().square().mean().backward()

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    seconds = _best_of(step, 0.3, sync, min_calls=3)  # a step of its own takes longer: the median of 3
    return 3.0 * block_flops_per_token(hidden, seq) * seqs * seq / seconds


def probe_device_optimizer(device: str = "cuda", numel: int = 1 << 24, seconds: float = 0.3) -> float:
    """Elements per second torch's fused AdamW updates on `device` (fp32 parameter, two fp32 states)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(numel, device=device))
    p.grad = torch.full((numel,), 1e-3, device=device)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return numel / _best_of(opt.step, seconds, torch.cuda.synchronize)


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
    tokens: int = 512,
    hidden: int = 1024,
    dtype: str = "fp32",
    device: Optional[str] = None,
    seq_len: Optional[int] = None,
    heads: Optional[int] = None,
) -> ComputeProfile:
    """Every probe, in a few seconds: the CPU optimizer, a host memory copy, a matmul of a transformer
    MLP's shape (`tokens` x `hidden` by `hidden` x 4 `hidden`) on the compute device (CUDA device 0 when
    there is one, else the CPU), with `seq_len` a transformer block's forward + backward
    (`probe_training_block`), and on a GPU the host<->device copies."""
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
    if seq_len is not None:
        copies["train_flops"] = probe_training_block(tokens, hidden, seq_len, heads, device, dtype)
        sources["train_flops"] = f"probe: a transformer block's forward + backward, {hidden} x {seq_len}"
    if device.startswith("cuda"):
        copies["device_optimizer_elems_per_s"] = probe_device_optimizer(device)
        sources["device_optimizer_elems_per_s"] = "probe: torch AdamW(fused) on 16M elements"
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
