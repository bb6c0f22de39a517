"""Reads of checkpoint tensors served at unaligned file offsets: landed at the file's 4 KiB alignment
(`ServedPartition.lead`: each tensor's aligned middle straight into the buffer) against landed at the
buffer's start (every piece through the I/O core's bounce buffers and a copy).

    python -m benchmarks.bench_served_reads --checkpoint DIR [--gb 2] [--rounds 3]

The tensors of the safetensors files in DIR are taken in file order until `--gb` GB, each read as a
one-extent ServedPartition with O_DIRECT (descriptors opened as the engine's are: CheckpointFds) into one
pinned buffer, through an aio handle with DeepSpeed's default `aio` settings (block 1 MiB, queue depth 8).
Rounds alternate the two placements (A B A B). Reported per placement: GB/s and CPU seconds per GB (this
process, every thread: the bounce copies run on the I/O core's workers), and whether both read the same
bytes. Output: benchmarks/out/bench_served_reads.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import time
import zlib
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.harness import markdown_table, write_outputs

MODES = ("at the file's alignment", "at the buffer's start")


def tensors(ckpt: str, limit: int) -> List[Tuple[str, int, int]]:
    """(file, data offset, bytes) of the checkpoint's tensors in file order, up to `limit` bytes."""
    out: List[Tuple[str, int, int]] = []
    total = 0
    for name in sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")):
        path = os.path.join(ckpt, name)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
        for a, b in spans:
            if b > a:
                out.append((path, 8 + n + a, b - a))
                total += b - a
                if total >= limit:
                    return out
    return out


def run(ckpt: str, gb: float, rounds: int) -> Dict[str, Any]:
    """Read the tensors `rounds` times in each placement; the timings and checksums."""
    import torch

    from offload.aio import AioHandle
    from zero.stage3.served import ALIGN, CheckpointFds, Extent, ServedPartition

    todo = tensors(ckpt, int(gb * 1e9))
    held = CheckpointFds()
    for path in sorted({p for p, _, _ in todo}):
        held.add(path, os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
    direct = held.for_direct_io()
    parts = [
        ServedPartition(f"t{i}", [Extent(0, direct.fd(p), off, n, p, f"t{i}")], n)
        for i, (p, off, n) in enumerate(todo)
    ]
    times: Dict[str, List[Tuple[float, float]]] = {m: [] for m in MODES}
    sums: Dict[str, int] = {}
    try:
        with AioHandle(block_size=1 << 20, queue_depth=8) as h:
            buf = h.new_cpu_locked_tensor(
                max(n for _, _, n in todo) + ALIGN, torch.empty(0, dtype=torch.uint8)
            )
            for r in range(rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    crc = 0
                    w0, c0 = time.perf_counter(), time.process_time()
                    for part in parts:
                        lead = part.lead(0) if mode == MODES[0] else 0
                        view = buf[lead : lead + part.nbytes]
                        part.read_into(h, view, 0)
                        if r == 0:
                            crc = zlib.crc32(view.numpy().tobytes(), crc)
                    times[mode].append((time.perf_counter() - w0, time.process_time() - c0))
                    if r == 0:
                        sums[mode] = crc
            h.free_cpu_locked_tensor(buf)
    finally:
        direct.close()
        held.close()
    nbytes = sum(n for _, _, n in todo)
    return {"tensors": len(todo), "bytes": nbytes, "times": times, "same_bytes": len(set(sums.values())) == 1}


def main(argv: Optional[List[str]] = None) -> int:
    """Measure both placements and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a folder of safetensors files")
    ap.add_argument("--gb", type=float, default=2.0, help="GB of tensors read per round and placement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (A B, then B A, ...)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/out)")
    args = ap.parse_args(argv)
    res = run(args.checkpoint, args.gb, args.rounds)
    gbytes = res["bytes"] / 1e9
    rows = []
    for mode, ts in res["times"].items():
        rows.append(
            [
                mode,
                f"{statistics.median(gbytes / w for w, _ in ts):.2f}",
                ", ".join(f"{gbytes / w:.2f}" for w, _ in ts),
                f"{statistics.median(c / gbytes for _, c in ts):.3f}",
            ]
        )
    title = (
        f"{res['tensors']} tensors, {gbytes:.2f} GB per round, {args.rounds} rounds, load average "
        f"{os.getloadavg()[0]:.1f}; bytes {'identical' if res['same_bytes'] else 'DIFFERENT'}"
    )
    table = title + "\n\n" + markdown_table(["landed", "GB/s (median)", "GB/s each round", "CPU s/GB"], rows)
    write_outputs("bench_served_reads", {"args": vars(args), **res}, table, args.out)
    return 0 if res["same_bytes"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
