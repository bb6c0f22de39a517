"""AioHandle read/write GB/s per backend against fio on the same file, block size and queue depth.

    .venv/bin/python -m benchmarks.bench_aio [--size 1GiB] [--dir /var/tmp] [--repeats 3] [--no-fio]

Both sides use O_DIRECT, so reads come from the disk, not the page cache (the file is also dropped from the
cache with POSIX_FADV_DONTNEED before every read). fio gets huge-page buffers (--iomem=shmhuge, with
vm.nr_hugepages raised for the run and restored afterwards) so that it measures the disk, not its buffer
layout; our side reads into and writes from a 2 MiB aligned pinned buffer. Runs alternate A B A B; the
table gives medians, the ratio ours/fio, and CPU seconds per GB moved (user + system: getrusage of this
process around each call for ours, fio's own usr/sys figures for its I/O phase). Engines compared:
io_uring <-> fio io_uring, aio <-> fio libaio, psync <-> fio psync (one request at a time per thread on both
sides).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from benchmarks.harness import interleave, markdown_table, write_outputs
from offload.aio import AioHandle, available_backends
from offload.demo import parse_size
from offload.pinned import alloc_host_buffer

FIO_ENGINE = {"io_uring": "io_uring", "aio": "libaio", "psync": "psync"}
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class HugePages:
    """Raise vm.nr_hugepages for fio's shmhuge buffers; restore the old value on exit."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.saved: Optional[int] = None
        self.changed = False
        self.ok = False
        self.why = ""

    def __enter__(self) -> HugePages:
        try:
            with open(NR_HUGEPAGES) as f:
                self.saved = int(f.read())
            if self.saved < self.pages:
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(str(self.pages))
                self.changed = True
            with open(NR_HUGEPAGES) as f:
                got = int(f.read())
            self.ok = got >= self.pages
            if not self.ok:
                self.why = f"kernel gave only {got} of {self.pages} huge pages"
        except OSError as e:
            self.why = f"cannot set {NR_HUGEPAGES}: {e}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.changed:
            try:
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(str(self.saved))
            except OSError:
                pass


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cpu_seconds() -> float:
    # getrusage, not os.times: microseconds instead of 10 ms ticks; covers all our threads (io-wq included).
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ours(
    backend: str, op: str, path: str, buf: np.ndarray, block: int, depth: int, threads: int
) -> Callable[[], Dict[str, float]]:
    handle = AioHandle(block, depth, intra_op_parallelism=threads, backend=backend, direct="on")

    def run() -> Dict[str, float]:
        if op == "read":
            drop_cache(path)
        c0, t0 = cpu_seconds(), time.perf_counter()
        if op == "read":
            handle.sync_pread(buf, path)
        else:
            handle.sync_pwrite(buf, path)
        dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
        return {"gbps": buf.nbytes / dt / 1e9, "cpu_s_per_gb": dc / (buf.nbytes / 1e9)}

    return run


def fio(
    engine: str, op: str, path: str, size: int, block: int, depth: int, threads: int, iomem: str
) -> Callable[[], Dict[str, float]]:
    per_job = size // threads
    cmd = [
        "fio", "--name=zo", f"--filename={path}", f"--rw={op}", f"--bs={block}", f"--ioengine={engine}",
        "--direct=1", f"--size={per_job}", f"--numjobs={threads}", f"--offset_increment={per_job}",
        "--thread", "--group_reporting", f"--iomem={iomem}", "--output-format=json", "--invalidate=1",
    ]  # fmt: skip
    if engine != "psync":
        cmd.append(f"--iodepth={depth}")

    def run() -> Dict[str, float]:
        if op == "read":
            drop_cache(path)
        c0 = children_cpu_seconds()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed ({' '.join(cmd)}):\n{proc.stderr or proc.stdout}")
        job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
        moved_gb = job[op]["io_bytes"] / 1e9
        # fio's own usr/sys percentages cover the I/O phase only, as our numbers do; the rusage figure
        # adds fio's start-up (buffer allocation, file layout checks).
        in_run = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job[op]["runtime"] / 1e3 * threads
        return {
            "gbps": job[op]["bw_bytes"] / 1e9,
            "cpu_s_per_gb": in_run / moved_gb,
            "cpu_s_per_gb_with_startup": (children_cpu_seconds() - c0) / moved_gb,
        }

    return run


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=parse_size, default=1 << 30, help="file size (default 1GiB)")
    p.add_argument("--dir", default="/var/tmp", help="directory on the disk to measure (default /var/tmp)")
    p.add_argument("--block-size", type=parse_size, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="intra_op_parallelism = fio numjobs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", nargs="*", default=None, help="default: every available one")
    p.add_argument("--no-fio", action="store_true")
    args = p.parse_args(argv)

    backends = args.backends or available_backends()
    fio_path = None if args.no_fio else shutil.which("fio")
    notes: List[str] = []
    if fio_path is None:
        notes.append("fio not found (apt-get install -y fio): measuring our backends alone")
    size = args.size // (args.threads * args.block_size) * args.threads * args.block_size
    if size <= 0:
        p.error("--size must be at least threads * block size")

    workdir = tempfile.mkdtemp(prefix="zo-bench-aio-", dir=args.dir)
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    try:
        path = os.path.join(workdir, "bench.bin")
        host = alloc_host_buffer(size)
        buf = np.frombuffer(host.as_ctypes(), dtype=np.uint8)
        buf[:] = np.random.default_rng(0).integers(0, 256, size=size, dtype=np.uint8)
        # A fresh file, fully written and out of the page cache, shared by every contender.
        with AioHandle(args.block_size, args.queue_depth, direct="on") as h:
            h.sync_pwrite(buf, path)
        drop_cache(path)

        pages = (args.block_size * args.queue_depth * args.threads) // (2 << 20) + 8
        with HugePages(pages) as huge:
            iomem = "shmhuge" if huge.ok else "malloc"
            if fio_path and not huge.ok:
                notes.append(f"fio buffers not huge-page backed ({huge.why})")
            for backend in backends:
                for op in ("write", "read"):
                    contenders = {
                        "ours": ours(backend, op, path, buf, args.block_size, args.queue_depth, args.threads)
                    }
                    if fio_path:
                        contenders["fio"] = fio(
                            FIO_ENGINE[backend], op, path, size, args.block_size, args.queue_depth,
                            args.threads, iomem,
                        )  # fmt: skip
                    res = interleave(contenders, repeats=args.repeats, warmup=1)
                    results.setdefault(backend, {})[op] = {
                        f"{name}_{key}": value for name, r in res.items() for key, value in r.extra.items()
                    }
                    summary = {k: round(v, 3) for k, v in results[backend][op].items()}
                    print(f"{backend:8s} {op:5s} {json.dumps(summary)}", flush=True)
                    results[backend][op].update(
                        {
                            f"{name}_wall_s_samples": [round(s, 4) for s in r.samples]
                            for name, r in res.items()
                        }
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    for backend, per_op in results.items():
        for op, r in per_op.items():
            fio_gbps = r.get("fio_gbps")
            rows.append(
                [
                    backend, op, r["ours_gbps"], fio_gbps if fio_gbps else "-",
                    f"{r['ours_gbps'] / fio_gbps:.2f}" if fio_gbps else "-",
                    r["ours_cpu_s_per_gb"], r.get("fio_cpu_s_per_gb", "-"),
                ]
            )  # fmt: skip
    table = markdown_table(
        ["backend", "op", "ours GB/s", "fio GB/s", "ours/fio", "ours CPU s/GB", "fio CPU s/GB"], rows
    )
    if notes:
        table += "\n\n" + "\n".join(f"note: {n}" for n in notes)
    payload = {
        "config": {
            "size": size, "block_size": args.block_size, "queue_depth": args.queue_depth,
            "threads": args.threads, "repeats": args.repeats, "dir": args.dir, "fio": fio_path,
            "o_direct": True,
        },
        "results": results,
        "notes": notes,
        "median_of": "per-run GB/s and CPU s/GB (harness extras); *_wall_s_samples: s per run incl. setup",
    }  # fmt: skip
    write_outputs("bench_aio", payload, table)


if __name__ == "__main__":
    main()
