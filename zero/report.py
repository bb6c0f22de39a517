"""The per-step report: where one optimizer step's time went and how many bytes moved between tiers; and the
inference report: forwards, tokens and bytes streamed since the last call (`ForwardMeter`, `InferenceReport`).

The engine always counts (perf_counter and integer adds cost nothing next to a training step); it prints a
report when the config asks (`zero_offload.report` or DeepSpeed's `wall_clock_breakdown`). Times cover a
whole accumulation window: all micro-batches' forward and backward, then the optimizer step.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

__all__ = [
    "ForwardMeter",
    "InferenceReport",
    "PhaseClock",
    "StepReport",
    "format_bytes",
    "inference_report",
    "read_ceiling",
]


def format_bytes(n: float) -> str:
    """`n` bytes with a binary unit (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class StepReport:
    """One optimizer step (one accumulation window)."""

    step: int = 0
    micro_batches: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0  # waiting for gradient reduction / parameter all-gather
    optimizer_s: float = 0.0  # the whole optimizer phase, I/O included
    optimizer_compute_s: float = 0.0  # inside the fused kernels (and parameter copy-out)
    io_wait_s: float = 0.0  # blocked on NVMe reads/writes during the optimizer phase
    # optimizer steps overlapped with backward (offload_optimizer.pipeline_*): how long that pass waited
    # for gradients; its compute and I/O wait above then ran during backward_s, not after it
    gradient_wait_s: float = 0.0
    optimizer_chunks: int = 0  # chunks (sub-groups) the optimizer pass updated
    optimizer_chunks_in_backward: int = 0  # of those, updated while backward still ran (overlap)
    # chunks stepped during backward with clipping coefficient 1 and redone after it because clipping
    # triggered (zero.optimizer.speculative)
    optimizer_chunks_redone: int = 0
    # zero_offload.delayed_update: the host pass of the previous step, applied in this step's window
    host_step_s: float = 0.0  # how long the host optimizer pass(es) applied in this window ran
    host_step_hidden_s: float = 0.0  # of that, what ran while forward/backward did (off the critical path)
    optimizer_chunks_hidden: int = 0  # chunks that pass had updated before the engine waited for it
    delayed_updates: int = 0  # delayed passes applied in this window (0 or 1)
    # the pass was started during backward (the overlap) and finished by step(); False: it ran after backward
    optimizer_overlapped: bool = False
    nvme_read_bytes: int = 0
    nvme_write_bytes: int = 0
    device_to_host_bytes: int = 0  # gradients to the host tier
    host_to_device_bytes: int = 0  # updated parameters back to the device
    comm_bytes: int = 0
    pinned_bytes_in_use: int = 0
    nvme_bytes_in_use: int = 0
    loss_scale: float = 1.0
    skipped: bool = False
    # activation checkpointing in this window (zero.checkpointing.CheckpointingReport fields); empty if none
    activations: Dict[str, Any] = field(default_factory=dict)
    predicted_s: Optional[float] = None  # the plan's step time (zero_offload.predicted_seconds)

    @property
    def step_s(self) -> float:
        """Seconds of the whole window: forward, backward, communication and optimizer phases."""
        return self.forward_s + self.backward_s + self.comm_s + self.optimizer_s

    @property
    def nvme_gbps(self) -> float:
        """NVMe bytes moved per second of optimizer phase (read + write)."""
        moved = self.nvme_read_bytes + self.nvme_write_bytes
        return moved / self.optimizer_s / 1e9 if self.optimizer_s > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        """The fields as a dict, with step_s and nvme_gbps added."""
        d = asdict(self)
        d["step_s"] = self.step_s
        d["nvme_gbps"] = self.nvme_gbps
        return d

    def format(self) -> str:
        """One log line: phase times, NVMe traffic, pinned and swap bytes, checkpointing, a skipped step."""
        parts = [
            f"step {self.step}",
            f"fwd {self.forward_s * 1e3:.1f} ms",
            f"bwd {self.backward_s * 1e3:.1f} ms",
            f"opt {self.optimizer_s * 1e3:.1f} ms (kernel {self.optimizer_compute_s * 1e3:.1f}, "
            f"io-wait {self.io_wait_s * 1e3:.1f})",
        ]
        if self.comm_s:
            parts.append(f"comm {self.comm_s * 1e3:.1f} ms")
        if self.delayed_updates:
            parts.append(
                f"host step {self.host_step_s * 1e3:.1f} ms ({self.host_step_hidden_s * 1e3:.1f} hidden)"
            )
        if self.nvme_read_bytes or self.nvme_write_bytes:
            parts.append(
                f"nvme r {format_bytes(self.nvme_read_bytes)} w {format_bytes(self.nvme_write_bytes)} "
                f"{self.nvme_gbps:.2f} GB/s"
            )
        parts.append(f"pinned {format_bytes(self.pinned_bytes_in_use)}")
        if self.nvme_bytes_in_use:
            parts.append(f"nvme files {format_bytes(self.nvme_bytes_in_use)}")
        if self.activations:
            a = self.activations
            text = (
                f"ckpt {a['checkpoints']} (off {format_bytes(a['offloaded_bytes'])}, "
                f"back {format_bytes(a['restored_bytes'])}"
            )
            if a["offload_s"] or a["restore_wait_s"]:  # activation_checkpointing.profile
                text += f", offload {a['offload_s'] * 1e3:.1f} ms, wait {a['restore_wait_s'] * 1e3:.1f} ms"
            parts.append(text + ")")
        if self.predicted_s is not None:
            parts.append(f"plan predicted {self.predicted_s:.3f} s, measured {self.step_s:.3f} s")
        if self.skipped:
            parts.append(f"SKIPPED (overflow, loss scale now {self.loss_scale:g})")
        return " | ".join(parts)


class PhaseClock:
    """Adds wall time into a StepReport field; synchronizes the device first when asked (exact GPU times)."""

    def __init__(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.current = StepReport()
        self._sync = sync

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the `with` block to the current report's field `name`."""
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            setattr(self.current, name, getattr(self.current, name) + time.perf_counter() - t0)

    def finish(self) -> StepReport:
        """The current report, replaced by a fresh one."""
        done, self.current = self.current, StepReport()
        return done


@dataclass
class InferenceReport:
    """The forwards of an engine without an optimizer since the last report (`engine.inference_report()`).

    `forward_s` is wall time from each root forward's start to its return, summed (on CUDA: kernels queued by
    then may still run; generation reads each step's logits, which waits for them). Bytes are the parameter
    tier's: `nvme_read_bytes` from the swap files, `host_to_device_bytes` from host memory (a `cpu` tier or
    an NVMe staging slot) to a GPU (0 when the compute device is the CPU). `read_wait_s`, part of
    `forward_s`: time the forwards waited for the disk (a read on demand, a prefetch not finished): near
    `forward_s` the stream is disk-bound, near 0 compute (or copies) bound."""

    forwards: int = 0
    tokens: int = 0  # input positions processed: batch x sequence length of each forward, summed
    forward_s: float = 0.0
    nvme_read_bytes: int = 0
    nvme_write_bytes: int = 0  # weights are never written back in inference: stays 0
    host_to_device_bytes: int = 0
    param_reads: int = 0
    param_prefetches: int = 0
    param_prefetch_hits: int = 0
    peak_prefetch_depth: int = 0
    peak_read_ahead_bytes: int = 0  # most bytes of host partitions copied ahead to a GPU at once
    gathers: int = 0
    read_wait_s: float = 0.0  # of forward_s, time spent waiting for NVMe reads no prefetch had finished
    read_ceiling_gbs: Optional[float] = None  # the disk's sequential read bandwidth, decimal GB/s
    read_ceiling_source: str = "none"
    predicted_s_per_forward: Optional[float] = None  # the plan's (zero_offload.predicted_seconds)

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of forward time (0 before any forward)."""
        return self.tokens / self.forward_s if self.forward_s > 0 else 0.0

    @property
    def s_per_forward(self) -> float:
        """Seconds per forward (0 before any forward)."""
        return self.forward_s / self.forwards if self.forwards else 0.0

    @property
    def nvme_read_bytes_per_forward(self) -> float:
        """NVMe bytes read per forward (0 before any forward)."""
        return self.nvme_read_bytes / self.forwards if self.forwards else 0.0

    @property
    def host_to_device_bytes_per_forward(self) -> float:
        """Host-to-device bytes per forward (0 before any forward)."""
        return self.host_to_device_bytes / self.forwards if self.forwards else 0.0

    @property
    def nvme_read_gbps(self) -> float:
        """NVMe bytes read per second of forward time (decimal GB/s)."""
        return self.nvme_read_bytes / self.forward_s / 1e9 if self.forward_s > 0 else 0.0

    @property
    def read_ceiling_fraction(self) -> Optional[float]:
        """`nvme_read_gbps` over the disk's read ceiling (None without a ceiling)."""
        if not self.read_ceiling_gbs:
            return None
        return self.nvme_read_gbps / self.read_ceiling_gbs

    def as_dict(self) -> Dict[str, Any]:
        """The fields and the derived rates by name."""
        d = asdict(self)
        for name in (
            "tokens_per_s",
            "s_per_forward",
            "nvme_read_bytes_per_forward",
            "host_to_device_bytes_per_forward",
            "nvme_read_gbps",
            "read_ceiling_fraction",
        ):
            d[name] = getattr(self, name)
        return d

    def format(self) -> str:
        """One line for a log."""
        text = (
            f"{self.forwards} forwards, {self.tokens} tokens, {self.tokens_per_s:.2f} tokens/s, "
            f"{self.s_per_forward * 1e3:.1f} ms/forward, "
            f"nvme r {format_bytes(self.nvme_read_bytes_per_forward)}/forward ({self.nvme_read_gbps:.3f} GB/s"
        )
        frac = self.read_ceiling_fraction
        if frac is not None:
            text += f", {frac:.0%} of {self.read_ceiling_gbs:g} GB/s"
        text += f"), h2d {format_bytes(self.host_to_device_bytes_per_forward)}/forward"
        if self.peak_read_ahead_bytes:
            text += f" (copied ahead: at most {format_bytes(self.peak_read_ahead_bytes)})"
        if self.forwards:
            text += f", read wait {self.read_wait_s / self.forwards * 1e3:.1f} ms/forward"
        if self.predicted_s_per_forward is not None:
            text += f", plan predicted {self.predicted_s_per_forward * 1e3:.1f} ms/forward"
        return text


def read_ceiling(
    read_ceiling_gbs: Optional[float] = None, machine_profile: Optional[str] = None
) -> Tuple[Optional[float], str]:
    """(the disk's read ceiling in GB/s, where it came from): `read_ceiling_gbs` if given; else
    `nvme_read_gbps` of a machine profile (what `ds-nvme-bench --json OUT` writes); else (None, "none")."""
    if read_ceiling_gbs is not None:
        if not read_ceiling_gbs > 0:
            raise ValueError(f"read_ceiling_gbs must be positive, got {read_ceiling_gbs!r}")
        return float(read_ceiling_gbs), "argument"
    if machine_profile is not None:
        try:
            with open(machine_profile) as f:
                value = json.load(f).get("nvme_read_gbps")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"machine profile {machine_profile}: cannot read nvme_read_gbps: {e}") from None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"machine profile {machine_profile}: nvme_read_gbps is {value!r}, not a bandwidth"
            )
        return float(value), f"ds-nvme-bench profile {machine_profile}"
    return None, "none"


def _tokens_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
    """Input positions of one forward: batch x sequence of `input_ids` (or `inputs_embeds`, or the first
    tensor argument); 0 when there is none."""
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor):
            return int(t.shape[0] * t.shape[1]) if t.dim() >= 2 else int(t.numel())
    for t in args:
        if isinstance(t, torch.Tensor):
            return int(t.shape[0] * t.shape[1]) if t.dim() >= 2 else int(t.numel())
    return 0


class ForwardMeter:
    """Counts the root module's forwards, their input tokens and their wall time (forward pre- and post-hooks
    on the root module; a forward that raises is not counted). Nested calls of the root count once.

    With an accelerator `device` (a GPU) the device is synchronized as a forward starts and as it returns,
    so that its time is the work it queued, not only the time to queue it."""

    def __init__(self, module: nn.Module, device: Optional[torch.device] = None) -> None:
        self._sync = _synchronizer(device)
        self.forwards = 0
        self.tokens = 0
        self.forward_s = 0.0
        self._start: Optional[float] = None
        self._pending_tokens = 0
        self._depth = 0
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self._depth += 1
        if self._depth == 1:
            self._pending_tokens = _tokens_of(args, kwargs)
            self._sync()
            self._start = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._start is not None and output is not None:  # None: it raised
            self._sync()
            self.forward_s += time.perf_counter() - self._start
            self.forwards += 1
            self.tokens += self._pending_tokens
        if self._depth == 0:
            self._start = None

    def take(self) -> Tuple[int, int, float]:
        """(forwards, tokens, seconds) since the last call; starts counting afresh."""
        out = (self.forwards, self.tokens, self.forward_s)
        self.forwards = self.tokens = 0
        self.forward_s = 0.0
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _synchronizer(device: Optional[torch.device]) -> Callable[[], None]:
    """A call that waits for the work queued on `device`; a no-op for the CPU (or None)."""
    if device is None or device.type == "cpu":
        return lambda: None
    backend = getattr(torch, device.type)
    return lambda: backend.synchronize(device)


def inference_report(
    meter: ForwardMeter,
    take_param_io: Callable[[], Optional[Dict[str, int]]],
    read_ceiling_gbs: Optional[float] = None,
    machine_profile: Optional[str] = None,
) -> InferenceReport:
    """The report over the forwards `meter` counted and the parameter I/O `take_param_io()` returns (both
    since their last call; None: no parameter tier). The ceiling is checked before anything is taken."""
    ceiling, source = read_ceiling(read_ceiling_gbs, machine_profile)
    forwards, tokens, seconds = meter.take()
    io = take_param_io() or {}
    return InferenceReport(
        forwards=forwards,
        tokens=tokens,
        forward_s=seconds,
        nvme_read_bytes=io.get("param_nvme_read_bytes", 0),
        nvme_write_bytes=io.get("param_nvme_write_bytes", 0),
        host_to_device_bytes=io.get("host_to_device_bytes", 0),
        param_reads=io.get("param_reads", 0),
        param_prefetches=io.get("param_prefetches", 0),
        param_prefetch_hits=io.get("param_prefetch_hits", 0),
        peak_prefetch_depth=io.get("peak_prefetch_depth", 0),
        peak_read_ahead_bytes=io.get("peak_read_ahead_bytes", 0),
        gathers=io.get("gathers", 0),
        read_wait_s=io.get("param_read_wait_s", 0.0),
        read_ceiling_gbs=ceiling,
        read_ceiling_source=source,
    )
