"""The interim main job: move 1 GiB through AioHandle to disk and back, verify it, print the throughput.

    python -m offload.demo [--size 1GiB] [--dir /path/on/nvme] [--backend auto|io_uring|aio|psync]

Writes into a private temporary directory (mode 0700) under --dir, removed at the end even on failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from typing import List, Optional

import numpy as np

from offload.aio import AioError, AioHandle, BackendUnavailableError, available_backends
from offload.pinned import MemlockLimitWarning, alloc_host_buffer

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9})


def parse_size(text: str) -> int:
    """'1GiB', '512M', '1000000' -> bytes (binary for K/M/G/KiB/..., decimal for kB/MB/GB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1GiB, 256MiB, 64M, 1000000")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _fill_random(buf: np.ndarray, seed: int) -> None:
    # Chunked so a multi-GiB buffer never needs a second multi-GiB temporary.
    rng = np.random.default_rng(seed)
    chunk = 64 << 20
    for start in range(0, buf.size, chunk):
        part = buf[start : start + chunk]
        part[:] = rng.integers(0, 256, size=part.size, dtype=np.uint8)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the tiers demo with `argv`; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m offload.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="bytes to move (default 1GiB)")
    parser.add_argument(
        "--dir", default=None, help="where to put the private temporary directory (default $TMPDIR)"
    )
    parser.add_argument("--backend", default="auto", choices=["auto", "io_uring", "aio", "psync"])
    parser.add_argument("--block-size", type=parse_size, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=32)
    args = parser.parse_args(argv)

    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir!r} is not a directory")
    workdir = tempfile.mkdtemp(prefix="zero-offload-demo-", dir=args.dir)  # created 0700
    os.chmod(workdir, 0o700)
    try:
        return _run(args, workdir)
    except (AioError, BackendUnavailableError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, workdir: str) -> int:
    size = args.size
    path = os.path.join(workdir, "demo.bin")
    print(f"zero-offload demo: {size / 2**30:.3g} GiB through {path}")
    print(f"available backends: {', '.join(available_backends())}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemlockLimitWarning)
        src_host = alloc_host_buffer(size)
        dst_host = alloc_host_buffer(size)
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)
    src = np.frombuffer(src_host.as_ctypes(), dtype=np.uint8)
    dst = np.frombuffer(dst_host.as_ctypes(), dtype=np.uint8)
    _fill_random(src, seed=int(time.time()))
    dst[:] = 0  # fault the pages in now so the read timing measures I/O, not page faults

    with AioHandle(args.block_size, args.queue_depth, backend=args.backend) as h:
        print(
            f"backend: {h.backend} (block {h.get_block_size() >> 10} KiB, queue depth {h.get_queue_depth()}, "
            f"alignment {h.get_alignment()})"
        )
        t0 = time.perf_counter()
        h.sync_pwrite(src, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # count the write as done only once it is on the device
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
        finally:
            os.close(fd)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        h.sync_pread(dst, path)
        t_read = time.perf_counter() - t0

    if not np.array_equal(src, dst):
        bad = int(np.flatnonzero(src != dst)[0])
        print(f"FAILED: data read back differs from data written, first at byte {bad}", file=sys.stderr)
        return 1
    print(f"verified: {size} bytes bit-exact")
    print(f"write: {size / t_write / 1e9:.2f} GB/s ({t_write:.2f} s)")
    print(f"read:  {size / t_read / 1e9:.2f} GB/s ({t_read:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
