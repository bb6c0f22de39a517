"""fio as the reference: the same parameters on the same file, interleaved with our runs.

Parameter mapping (ours -> fio): block_size -> bs, queue_depth -> iodepth (per job), intra_op_parallelism ->
numjobs (each job one contiguous slice of the file, like our threads), backend io_uring/aio/psync ->
ioengine io_uring/libaio/psync, single_submit -> iodepth_batch_submit=1 (else the whole queue at once).
overlap_events has no fio equivalent. fio's buffers are huge-page shared memory (--iomem=shmhuge) when
the system can provide the pages; vm.nr_hugepages is raised for the comparison and restored afterwards.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .grid import AioParams

GB = 1e9
FIO_ENGINES = {"io_uring": "io_uring", "aio": "libaio", "psync": "psync"}
_NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class FioError(RuntimeError):
    pass


def fio_executable() -> Optional[str]:
    return shutil.which("fio")


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def hugepage_bytes() -> int:
    return _meminfo("Hugepagesize") * 1024 or (2 << 20)


def fio_hugepages_needed(params: AioParams) -> int:
    """fio allocates one buffer of bs * iodepth per job plus alignment slack: measured, 16 pages of data
    need 18 huge pages; keep 2 more in reserve for whatever else maps huge pages meanwhile."""
    per_job = params.block_size * (1 if params.backend == "psync" else params.queue_depth)
    page = hugepage_bytes()
    return params.intra_op_parallelism * (-(-per_job // page) + 2) + 2


@dataclass
class HugePages:
    """Make `needed` huge pages free for the duration of a `with` block, restoring vm.nr_hugepages after."""

    needed: int
    available: bool = False
    note: str = ""
    _original: Optional[int] = None

    def __enter__(self) -> HugePages:
        try:
            free = _meminfo("HugePages_Free")
            if free >= self.needed:
                self.available = True
                return self
            if os.geteuid() != 0:
                self.note = (
                    f"huge pages unavailable ({free} free, {self.needed} needed; "
                    "raising vm.nr_hugepages needs root)"
                )
                return self
            with open(_NR_HUGEPAGES) as f:
                self._original = int(f.read())
            with open(_NR_HUGEPAGES, "w") as f:
                f.write(str(self._original + self.needed - free))
            granted = _meminfo("HugePages_Free")
            if granted >= self.needed:
                self.available = True
            else:
                self.note = (
                    f"huge pages unavailable (kernel granted {granted} of {self.needed}: memory fragmented)"
                )
                self._restore()
        except OSError as e:
            self.note = f"huge pages unavailable (vm.nr_hugepages: {e.strerror})"
            self._restore()
        return self

    def _restore(self) -> None:
        if self._original is not None:
            with open(_NR_HUGEPAGES, "w") as f:
                f.write(str(self._original))
            self._original = None

    def __exit__(self, *exc: object) -> None:
        self._restore()


@dataclass
class FioSample:
    gbps: float
    cpu_s_per_gb: float


def fio_command(
    fio: str, params: AioParams, op: str, path: str, size: int, direct: bool, iomem: str
) -> List[str]:
    jobs = params.intra_op_parallelism
    per_job = max(params.block_size, size // jobs // params.block_size * params.block_size)
    cmd = [
        fio,
        "--name=ds-nvme-bench",
        f"--filename={path}",
        f"--rw={op}",
        f"--bs={params.block_size}",
        f"--ioengine={FIO_ENGINES[params.backend]}",
        f"--direct={1 if direct else 0}",
        f"--size={per_job}",
        f"--numjobs={jobs}",
        f"--offset_increment={per_job}",
        f"--iomem={iomem}",
        "--thread",
        "--group_reporting",
        "--invalidate=1",
        "--output-format=json",
    ]
    if params.backend != "psync":
        cmd += [f"--iodepth={params.queue_depth}"]
        cmd += [f"--iodepth_batch_submit={1 if params.single_submit else params.queue_depth}"]
    if op == "write" and not direct:
        cmd += ["--end_fsync=1"]  # as our buffered writes: the time includes reaching the disk
    return cmd


def run_fio(cmd: List[str], op: str, timeout: float = 600.0) -> FioSample:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FioError(f"fio did not finish within {timeout:.0f} s") from None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        raise FioError(f"fio exited with {proc.returncode}: {lines[-1] if lines else 'no output'}")
    text = proc.stdout
    start = text.find("{")
    try:
        report: Dict[str, Any] = json.loads(text[start:])
        job = report["jobs"][0][op]
        nbytes = int(job["io_bytes"])
        bw = float(job["bw_bytes"])
    except (ValueError, KeyError, IndexError) as e:
        raise FioError(f"cannot parse fio's JSON report: {e}") from None
    if nbytes <= 0 or bw <= 0:
        raise FioError("fio moved no data")
    # fio's own account of its job threads' CPU (percent of the summed job run time) leaves out its
    # start-up, which would dominate short runs; the process's rusage is the fallback.
    try:
        stats = report["jobs"][0]
        cpu = (float(stats["usr_cpu"]) + float(stats["sys_cpu"])) / 100.0 * float(stats["job_runtime"]) / 1e3
    except (KeyError, ValueError, TypeError):
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return FioSample(gbps=bw / GB, cpu_s_per_gb=cpu / (nbytes / GB))


@dataclass
class Comparison:
    op: str
    params: AioParams
    iomem: str
    ours_gbps: List[float] = field(default_factory=list)
    ours_cpu_s_per_gb: List[float] = field(default_factory=list)
    fio_gbps: List[float] = field(default_factory=list)
    fio_cpu_s_per_gb: List[float] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        ours = statistics.median(self.ours_gbps) if self.ours_gbps else None
        theirs = statistics.median(self.fio_gbps) if self.fio_gbps else None
        return {
            "op": self.op,
            "aio": self.params.as_dict(),
            "fio_iomem": self.iomem,
            "ours_gbps": ours,
            "fio_gbps": theirs,
            "ratio_ours_to_fio": (ours / theirs) if ours and theirs else None,
            "ours_cpu_s_per_gb": statistics.median(self.ours_cpu_s_per_gb)
            if self.ours_cpu_s_per_gb
            else None,
            "fio_cpu_s_per_gb": statistics.median(self.fio_cpu_s_per_gb) if self.fio_cpu_s_per_gb else None,
            "ours_samples_gbps": [round(v, 4) for v in self.ours_gbps],
            "fio_samples_gbps": [round(v, 4) for v in self.fio_gbps],
        }


def compare_with_fio(
    bench: Any, params: AioParams, op: str, repeats: int, fio: str, iomem: str, on_step: Any
) -> Comparison:
    """Alternate ours and fio (A B A B ...) on the same file so that background load hits both alike."""
    comparison = Comparison(op=op, params=params, iomem=iomem)
    what = params.label()
    with bench.handle(params) as h:
        for _ in range(repeats):
            ours = bench.read(h, what) if op == "read" else bench.write(h)
            comparison.ours_gbps.append(ours.gbps)
            comparison.ours_cpu_s_per_gb.append(ours.cpu_s_per_gb)
            cmd = fio_command(fio, params, op, bench.path, bench.size, bench.direct, iomem)
            theirs = run_fio(cmd, op)
            comparison.fio_gbps.append(theirs.gbps)
            comparison.fio_cpu_s_per_gb.append(theirs.cpu_s_per_gb)
            on_step(f"fio {op} {what}: ours {ours.gbps:.2f} GB/s, fio {theirs.gbps:.2f} GB/s")
    return comparison
