"""fio as the reference: the same parameters on the same file, interleaved with our runs.

Parameter mapping (ours -> fio): block_size -> bs, queue_depth -> iodepth (per job), intra_op_parallelism ->
numjobs (each job one contiguous slice of the file, like our threads), backend io_uring/aio/psync ->
ioengine io_uring/libaio/psync, single_submit -> iodepth_batch_submit=1 (else the whole queue at once).
overlap_events has no fio equivalent. fio's buffers are huge-page shared memory (--iomem=shmhuge) when
the system can provide the pages; vm.nr_hugepages is raised for the comparison and restored afterwards:
at the end of the comparison, on any error, and on SIGTERM/SIGHUP (through offload.cleanup). A fio still
running when the bench is terminated is killed, so it cannot go on writing after the bench has gone.

DS_NVME_BENCH_NR_HUGEPAGES names another file to use as the vm.nr_hugepages control (tests point it at a
scratch file; the default is /proc/sys/vm/nr_hugepages).
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import resource
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from offload.cleanup import Registration, register

from .grid import AioParams

GB = 1e9
FIO_ENGINES = {"io_uring": "io_uring", "aio": "libaio", "psync": "psync"}
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
NR_HUGEPAGES_ENV = "DS_NVME_BENCH_NR_HUGEPAGES"


class FioError(RuntimeError):
    """fio failed to run or its output could not be read; the message says which."""

    pass


def fio_executable() -> Optional[str]:
    """The path of the `fio` executable on PATH, or None when it is not installed."""
    return shutil.which("fio")


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def nr_hugepages_path() -> str:
    """The vm.nr_hugepages control file: DS_NVME_BENCH_NR_HUGEPAGES if set, else /proc/sys/vm/nr_hugepages."""
    return os.environ.get(NR_HUGEPAGES_ENV) or NR_HUGEPAGES


def _read_count(path: str) -> int:
    with open(path) as f:
        text = f.read()
    try:
        return int(text.strip())
    except ValueError:
        raise OSError(errno_mod.EINVAL, f"not a number: {text.strip()[:40]!r}", path) from None


def _write_count(path: str, value: int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def hugepage_bytes() -> int:
    """Bytes of the system's default huge page (from /proc/meminfo; 2 MiB when unknown)."""
    return _meminfo("Hugepagesize") * 1024 or (2 << 20)


def fio_hugepages_needed(params: AioParams) -> int:
    """fio allocates one buffer of bs * iodepth per job plus alignment slack: measured, 16 pages of data
    need 18 huge pages; keep 2 more in reserve for whatever else maps huge pages meanwhile."""
    per_job = params.block_size * (1 if params.backend == "psync" else params.queue_depth)
    page = hugepage_bytes()
    return params.intra_op_parallelism * (-(-per_job // page) + 2) + 2


@dataclass
class HugePages:
    """Make `needed` huge pages free for the duration of a `with` block, restoring vm.nr_hugepages after.

    The original value is written back when the block ends, when anything in between raises (KeyboardInterrupt
    included), and on SIGTERM/SIGHUP through offload.cleanup; `sysctl` is the control file to use.
    """

    needed: int
    sysctl: str = field(default_factory=nr_hugepages_path)
    available: bool = False
    note: str = ""
    _original: Optional[int] = None
    _registration: Optional[Registration] = None

    def __enter__(self) -> HugePages:
        try:
            free = _meminfo("HugePages_Free")
            if free >= self.needed:
                self.available = True
                return self
            if not os.access(self.sysctl, os.W_OK):
                why = (
                    "raising vm.nr_hugepages needs root"
                    if os.geteuid() != 0
                    else f"{self.sysctl} is read-only"
                )
                self.note = f"huge pages unavailable ({free} free, {self.needed} needed; {why})"
                return self
            original = _read_count(self.sysctl)
            # Registered before the write: from the moment the value may differ, every way out restores it.
            self._original = original
            self._registration = register(self._restore)
            _write_count(self.sysctl, original + self.needed - free)
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
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        """Write the original value back (once); a failure is reported on stderr with the fix."""
        original, self._original = self._original, None
        registration, self._registration = self._registration, None
        if registration is not None:
            registration.cancel()
        if original is None:
            return
        try:
            _write_count(self.sysctl, original)
        except OSError as e:
            message = (
                f"ds-nvme-bench: warning: could not restore vm.nr_hugepages to {original} "
                f"({self.sysctl}: {e.strerror}); set it back with: sysctl -w vm.nr_hugepages={original}\n"
            )
            try:
                os.write(2, message.encode())  # not print(): this may run inside a signal handler
            except OSError:
                pass

    def __exit__(self, *exc: object) -> None:
        self._restore()


@dataclass
class FioSample:
    """One fio run: bandwidth and CPU time per GB of the job."""

    gbps: float
    cpu_s_per_gb: float


def fio_command(
    fio: str, params: AioParams, op: str, path: str, size: int, direct: bool, iomem: str
) -> List[str]:
    """The fio command line that does what our bench does for these parameters (file, size, block size,
    queue depth, O_DIRECT)."""
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


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except OSError:
        pass


def run_fio(cmd: List[str], op: str, timeout: float = 600.0) -> FioSample:
    """Run one fio command for `op` (read or write) and parse its JSON output; FioError on failure or
    timeout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # A SIGTERM to the bench must not leave fio writing the test file (or recreating it after its removal).
    stop = register(lambda: _kill(proc))
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise FioError(f"fio did not finish within {timeout:.0f} s") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    finally:
        stop.cancel()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        lines = [ln for ln in (stderr + stdout).splitlines() if ln.strip()]
        raise FioError(f"fio exited with {proc.returncode}: {lines[-1] if lines else 'no output'}")
    text = stdout
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
    """Ours against fio for one operation and parameter set: bandwidths and CPU seconds per GB of each run."""

    op: str
    params: AioParams
    iomem: str
    ours_gbps: List[float] = field(default_factory=list)
    ours_cpu_s_per_gb: List[float] = field(default_factory=list)
    fio_gbps: List[float] = field(default_factory=list)
    fio_cpu_s_per_gb: List[float] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        """The comparison as JSON-ready values: the aio settings and the median GB/s of ours and of fio."""
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
