"""This machine's memory tiers, a saved machine profile, and which configurations fit on it.

A machine profile is a JSON object with any of the fields ram_bytes, gpu_bytes, nvme_free_bytes,
nvme_read_gbps, nvme_write_gbps (bandwidths in GB/s, 1e9 bytes per second); the NVMe benchmark writes
one. Fields it leaves out are detected here.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Sequence

from .counting import read_json_file
from .errors import EstimateInputError
from .result import MemoryEstimate

_TIER_RANK = {"none": 0, "cpu": 1, "nvme": 2}
_PROFILE_FIELDS = ("ram_bytes", "gpu_bytes", "nvme_free_bytes", "nvme_read_gbps", "nvme_write_gbps")


@dataclass(frozen=True)
class MachineProfile:
    """The machine the estimate is checked against: RAM, GPU memory, disk and NVMe bandwidth."""

    gpu_bytes: Optional[int] = None  # memory of one GPU
    ram_bytes: Optional[int] = None  # host memory of one node usable for training
    nvme_free_bytes: Optional[int] = None  # free space where the swap files go
    nvme_read_gbps: Optional[float] = None  # GB/s (1e9 bytes/s)
    nvme_write_gbps: Optional[float] = None
    sources: Dict[str, str] = field(default_factory=dict, compare=False)  # field -> where it came from
    # no GPU: the training device is the CPU, and what the estimate puts "per GPU" lives in host memory
    cpu_only: bool = False

    def merged_over(self, base: MachineProfile) -> MachineProfile:
        """This profile's fields, falling back to base's where this one has none."""
        values = {}
        sources = dict(base.sources)
        for name in _PROFILE_FIELDS:
            mine = getattr(self, name)
            values[name] = mine if mine is not None else getattr(base, name)
            if mine is not None:
                sources[name] = self.sources.get(name, "given")
        # a GPU either side found wins: a profile written without CUDA says nothing against a detected one
        cpu_only = values["gpu_bytes"] is None and (self.cpu_only or base.cpu_only)
        return MachineProfile(**values, sources=sources, cpu_only=cpu_only)


def detect_machine(nvme_path: str = ".") -> MachineProfile:
    """GPU memory through torch (CUDA device 0), available RAM through psutil, free space at nvme_path."""
    import psutil
    import torch

    sources: Dict[str, str] = {}
    gpu_bytes = None
    if torch.cuda.is_available():
        gpu_bytes = int(torch.cuda.get_device_properties(0).total_memory)
        sources["gpu_bytes"] = f"torch.cuda device 0 ({torch.cuda.get_device_name(0)})"
    # available, not total: memory other processes hold now is not ours to plan with.
    ram_bytes = int(psutil.virtual_memory().available)
    sources["ram_bytes"] = "psutil available memory"
    if not os.path.isdir(nvme_path):
        raise EstimateInputError(f"--nvme-path {nvme_path}: no such directory")
    nvme_free = int(shutil.disk_usage(nvme_path).free)
    sources["nvme_free_bytes"] = f"free space of {os.path.abspath(nvme_path)}"
    return MachineProfile(
        gpu_bytes=gpu_bytes,
        ram_bytes=ram_bytes,
        nvme_free_bytes=nvme_free,
        sources=sources,
        cpu_only=gpu_bytes is None,
    )


def load_machine_profile(path: str) -> MachineProfile:
    """Read a machine profile JSON; every field optional, each a non-negative number."""
    data = read_json_file(path, "--machine-profile")
    if not isinstance(data, dict):
        raise EstimateInputError(f"--machine-profile {path}: expected a JSON object")
    values = {}
    cpu_only = False
    for name in _PROFILE_FIELDS:
        if name not in data or data[name] is None:
            continue
        value = data[name]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise EstimateInputError(
                f"--machine-profile {path}: {name} must be a non-negative number, got {value!r}"
            )
        if name == "gpu_bytes" and value == 0:
            cpu_only = True  # the NVMe bench writes 0 when it found no CUDA device: the CPU is the device
            continue
        values[name] = value if name.endswith("_gbps") else int(value)
    for name in ("nvme_read_gbps", "nvme_write_gbps"):
        if values.get(name) == 0:
            raise EstimateInputError(f"--machine-profile {path}: {name} must be positive, got 0")
    return MachineProfile(
        **values, sources=dict.fromkeys(values, f"machine profile {path}"), cpu_only=cpu_only
    )


@dataclass(frozen=True)
class FitCheck:
    """Per tier: True fits, False does not, None unknown (the machine has no figure for it)."""

    gpu: Optional[bool]
    cpu: Optional[bool]
    nvme: Optional[bool]
    nvme_io_seconds: Optional[float]
    device: str = "gpu"  # "cpu" on a machine without a GPU: the per-GPU bytes were checked in host memory

    @property
    def fits(self) -> bool:
        """Whether no tier is known to be too small."""
        return self.gpu is not False and self.cpu is not False and self.nvme is not False

    @property
    def label(self) -> str:
        """The fit as a table cell: yes, no (the tiers too small) or yes? (the tiers not known)."""
        if not self.fits:
            short = [tier for tier in ("gpu", "cpu", "nvme") if getattr(self, tier) is False]
            return "no (" + ", ".join(short) + ")"
        tiers = ("gpu", "cpu", "nvme") if self.device == "gpu" else ("cpu", "nvme")
        unknown = [tier for tier in tiers if getattr(self, tier) is None]
        return "yes" if not unknown else "yes? (" + ", ".join(unknown) + " unknown)"

    def to_dict(self) -> Dict[str, object]:
        """The fit as JSON-ready values."""
        return {
            "fits": self.fits,
            "gpu": self.gpu,
            "cpu": self.cpu,
            "nvme": self.nvme,
            "nvme_io_seconds_per_step": self.nvme_io_seconds,
            "device": self.device,
        }


def nvme_io_seconds(estimate: MemoryEstimate, machine: MachineProfile) -> Optional[float]:
    """One optimizer step's NVMe time: bytes read / read bandwidth + bytes written / write bandwidth.

    Reads and writes share the device, so they are added rather than overlapped; compute overlaps them
    in the engine, so this is the step's I/O floor, not its total. None without bandwidth figures.
    """
    read, write = estimate.nvme_read_bytes_per_step, estimate.nvme_write_bytes_per_step
    if read == 0 and write == 0:
        return 0.0
    if not machine.nvme_read_gbps or not machine.nvme_write_gbps:
        return None
    return read / (machine.nvme_read_gbps * 1e9) + write / (machine.nvme_write_gbps * 1e9)


def _within(need: int, have: Optional[int]) -> Optional[bool]:
    return None if have is None else need <= have


def host_bytes(estimate: MemoryEstimate, machine: MachineProfile, ranks_per_node: int = 1) -> int:
    """Host memory one node needs: its CPU bytes and, on a machine without a GPU (the CPU is the
    device), the per-GPU bytes of each of its `ranks_per_node` ranks as well."""
    device = estimate.per_gpu_bytes * ranks_per_node if machine.cpu_only else 0
    return estimate.per_cpu_bytes + device


def check_fit(estimate: MemoryEstimate, machine: MachineProfile, ranks_per_node: int = 1) -> FitCheck:
    """Whether `estimate` fits on `machine`, tier by tier, with the margin left or missing. Without a GPU
    (`machine.cpu_only`) the device's bytes are host memory: checked with the CPU's (`host_bytes`)."""
    return FitCheck(
        gpu=None if machine.cpu_only else _within(estimate.per_gpu_bytes, machine.gpu_bytes),
        cpu=_within(host_bytes(estimate, machine, ranks_per_node), machine.ram_bytes),
        # stage 3 runs with one copy of the NVMe optimizer state when two do not fit (nvme_min_bytes)
        nvme=_within(estimate.nvme_min_bytes, machine.nvme_free_bytes) if estimate.nvme_bytes else True,
        nvme_io_seconds=nvme_io_seconds(estimate, machine),
        device="cpu" if machine.cpu_only else "gpu",
    )


def speed_rank(estimate: MemoryEstimate) -> tuple:
    """Sort key, fastest first: the slowest tier used, then total offload, then parameter offload
    (it moves parameters every forward and backward), then the stage (less partitioning, less
    communication)."""
    opt = _TIER_RANK[estimate.offload_optimizer]
    par = _TIER_RANK[estimate.offload_param]
    return (max(opt, par), opt + par, par, estimate.stage)


def recommend(estimates: Iterable[MemoryEstimate], checks: Sequence[FitCheck]) -> Optional[MemoryEstimate]:
    """The fitting configuration with the least offload, or None when nothing fits."""
    fitting = [est for est, check in zip(estimates, checks) if check.fits]
    return min(fitting, key=speed_rank) if fitting else None
